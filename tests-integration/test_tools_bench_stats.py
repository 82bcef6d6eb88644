"""The benchmark's statistics, plan and implementation table, on synthetic numbers (no processes)."""

from __future__ import annotations

import itertools
import pathlib
import statistics
from types import SimpleNamespace

import pytest
import torch

from tools.bench.ab import (
    Pair,
    VariantResult,
    bootstrap_median_interval,
    compare,
    median_ratio_interval,
    steps_per_block,
)
from tools.bench.cases import PER_WORKLOAD_CASES, TRAINING_CASES
from tools.bench.cli import parse_args, planned_runs, policy_of
from tools.bench.profile import Kernel, _kernels, after_first_collective, kernel_kind, stream_summary, time_by_kind
from tools.bench.report import table_lines
from tools.bench_chart import chart_points, write_chart
from tools.bench_results import rows_of
from tools.bench_table import table
from tools.impls import IMPLEMENTATIONS, resolve


def test_median_ratio_pairs_rounds_not_medians() -> None:
    # Per-round ratios are 2, 2, 2 although the per-variant medians (20 and 4) give 5.
    a = [2.0, 20.0, 200.0]
    b = [1.0, 10.0, 100.0]
    b_shuffled = [1.0, 4.0, 100.0]
    assert median_ratio_interval(a, b) == (2.0, 2.0, 2.0)
    ratio, low, high = median_ratio_interval(a, b_shuffled)
    assert ratio == 2.0
    assert (low, high) == (2.0, 5.0)


def test_median_ratio_ignores_one_outlier_round() -> None:
    a = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02, 0.98, 1.0, 9.0]
    b = [1.0] * len(a)
    ratio, low, high = median_ratio_interval(a, b)
    assert ratio == 1.0
    assert 0.9 <= low <= ratio <= high <= 1.1


def _exact_bootstrap_quantiles(values: list[float], level: float) -> tuple[float, float]:
    """The interval from every resample of ``values`` (exact, for a handful of values)."""
    medians = sorted(statistics.median(draw) for draw in itertools.product(values, repeat=len(values)))
    tail = (1 - level) / 2
    return medians[int(tail * len(medians))], medians[int((1 - tail) * len(medians))]


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0, 4.0, 5.0], [0.95, 0.97, 1.0, 1.01, 1.3], [3.0, 1.0, 2.0, 2.0]])
def test_bootstrap_interval_matches_exact_resampling(values: list[float]) -> None:
    low, high = bootstrap_median_interval(values, draws=20000)
    assert (low, high) == _exact_bootstrap_quantiles(values, 0.95)


def test_bootstrap_interval_is_reproducible_and_brackets_the_median() -> None:
    values = [1.0 + 0.01 * ((7 * i) % 13) for i in range(40)]
    assert bootstrap_median_interval(values) == bootstrap_median_interval(values)
    low, high = bootstrap_median_interval(values)
    assert low <= statistics.median(values) <= high
    assert low > min(values)
    assert high < max(values)
    with pytest.raises(ValueError, match="values"):
        bootstrap_median_interval([])


def test_compare_reports_ratio_wins_and_errors() -> None:
    variants = {
        "dcomm": VariantResult(samples_s=[0.9, 1.8, 1.1]),
        "torch": VariantResult(samples_s=[1.0, 2.0, 1.0]),
        "broken": VariantResult(error="error: RuntimeError: boom (rank 1)"),
    }
    result = compare(Pair("x", "dcomm", "torch", "dcomm/torch"), variants)
    assert result.ratio == pytest.approx(0.9)
    assert result.faster_rounds == 2
    assert result.rounds == 3
    assert result.low <= result.ratio <= result.high
    failed = compare(Pair("x", "dcomm", "broken", "dcomm/torch"), variants)
    assert failed.ratio is None
    assert failed.error == "broken: error: RuntimeError: boom (rank 1)"
    assert compare(Pair("x", "dcomm", "missing", "dcomm/torch"), variants).error == "missing: not measured"
    with pytest.raises(ValueError, match="kind"):
        Pair("x", "a", "b", "dcomm/dcomm")


def test_plan_runs_each_training_case_on_every_workload_and_precision() -> None:
    args = parse_args(["--workload", "mlp-deep", "transformer", "--precision", "tf32", "bf16-autocast"])
    runs = planned_runs(args)
    training = [run for run in runs if run[0] == "ddp"]
    assert training == [
        ("ddp", "mlp-deep", "tf32"),
        ("ddp", "mlp-deep", "bf16-autocast"),
        ("ddp", "transformer", "tf32"),
        ("ddp", "transformer", "bf16-autocast"),
    ]
    averaging = [run for run in runs if run[0] == "averaging"]
    assert averaging == [("averaging", "mlp-deep", "-"), ("averaging", "transformer", "-")]
    assert runs[-1] == ("hook-latency", "-", "-")
    assert len(runs) == 2 * 2 * len(TRAINING_CASES) + 2 * len(PER_WORKLOAD_CASES) + 1
    everything = parse_args(["--workload", "all", "--precision", "all"])
    assert everything.workload == ["mlp-wide", "mlp-deep", "transformer", "gpt-deep", "llama", "demo-lm", "cnn"]
    assert everything.precision == ["fp32", "tf32", "bf16-autocast"]


def test_policy_flags_override_the_defaults() -> None:
    policy = policy_of(parse_args(["--quick", "--case-budget-s", "2.5", "--max-rounds", "9"]))
    assert (policy.budget_s, policy.min_rounds, policy.max_rounds, policy.profile) == (2.5, 3, 9, False)
    assert policy.steps == 1
    assert policy_of(parse_args([])).steps == 3
    assert policy_of(parse_args(["--steps", "5"])).steps == 5
    assert [steps_per_block(steps, 4) for steps in (1, 3, 4, 5)] == [4, 4, 4, 8]
    assert steps_per_block(3, 1) == 3
    assert policy_of(parse_args(["--profile"])).profile
    with pytest.raises(SystemExit):
        parse_args(["--min-rounds", "5", "--max-rounds", "4"])


@pytest.mark.parametrize(("name", "impl"), [(n, i) for n in IMPLEMENTATIONS for i in ("torch", "dcomm")])
def test_every_table_entry_resolves(name: str, impl: str) -> None:
    obj = resolve(impl, name)
    assert callable(obj)
    short = name.rsplit(".", 1)[-1]
    assert obj.__name__.endswith(short)  # dcomm's bf16 hook is named dcomm_bf16_compress_hook
    assert obj.__module__.split(".")[0] == impl


def test_resolve_names_a_wrong_argument() -> None:
    with pytest.raises(ValueError, match="impl"):
        resolve("deepspeed", "allreduce_hook")
    with pytest.raises(ValueError, match="powersgd_hook"):
        resolve("torch", "powersgd_hook")


def test_table_lines_show_ratio_interval_and_errors() -> None:
    from tools.bench.ab import CaseResult

    variants = {
        "dcomm": VariantResult(samples_s=[0.001, 0.002], details={"rs buckets": "2/2"}),
        "torch": VariantResult(samples_s=[0.001, 0.002]),
        "ref": VariantResult(error="error: RuntimeError: boom (rank 0)"),
    }
    pairs = [compare(Pair("zero/step", "dcomm", "torch", "dcomm/torch"), variants)]
    pairs.append(compare(Pair("zero/step", "dcomm", "ref", "dcomm/reference"), variants))
    lines = table_lines([CaseResult("zero", "mlp-deep", "tf32", 1, 2, 1.0, {}, variants, pairs)])
    assert "95% interval" in lines[0]
    assert "1.000-1.000" in lines[2]
    assert "dcomm rs buckets=2/2" in lines[4]
    assert lines[5] == "    ref: error: RuntimeError: boom (rank 0)"


def _synthetic_run() -> dict[str, object]:
    def variant(ms: list[float]) -> dict[str, object]:
        return {"median_ms": statistics.median(ms), "samples_ms": ms, "peak_extra_bytes": 3 * 2**20, "details": {}}

    pairs = [
        {"label": "ddp/fp16", "a": "dcomm fp16", "b": "torch fp16", "kind": "dcomm/torch", "ratio": 0.9},
        {"label": "ddp/fp16", "a": "dcomm fp16", "b": "builtin", "kind": "dcomm/reference", "ratio": 1.2},
        {"label": "ddp/fp16", "a": "torch fp16", "b": "builtin", "kind": "torch/reference", "ratio": 1.3},
        {"label": "ddp/bf16", "a": "dcomm bf16", "b": "torch bf16", "kind": "dcomm/torch", "error": "torch bf16: x"},
    ]
    for pair in pairs[:3]:
        pair.update(low=pair["ratio"] - 0.05, high=pair["ratio"] + 0.05, faster_rounds=1, rounds=2)
    variants = {
        "dcomm fp16": variant([9.0, 9.0]),
        "torch fp16": variant([10.0, 10.0]),
        "builtin": variant([7.5, 7.5]),
        "dcomm bf16": variant([9.0, 9.0]),
        "torch bf16": {"error": "error: TypeError: BF16 all reduce needs NCCL (rank 0)"},
    }
    case = {"case": "ddp", "workload": "transformer", "precision": "tf32", "variants": variants, "pairs": pairs}
    meta = {"world_size": 4, "device": "NVIDIA H100", "link": "fast", "torch": "2.11.0", "date": "2026-11-26T07:00"}
    return {**meta, "results": [case]}


def test_results_rows_table_and_chart_points_from_json(tmp_path: pathlib.Path) -> None:
    run = _synthetic_run()
    rows = rows_of(run)
    assert [(r.label, r.workload, r.precision) for r in rows] == [
        ("ddp/fp16", "transformer", "tf32"),
        ("ddp/bf16", "transformer", "tf32"),
    ]
    assert rows[0].vs_torch.ratio == 0.9
    assert [r.b for r in rows[0].vs_reference] == ["builtin"]
    assert rows[0].milliseconds == {"dcomm fp16": 9.0, "torch fp16": 10.0, "builtin": 7.5}
    markdown = table(run).splitlines()
    assert markdown[0] == "**4x NVIDIA H100, fast link, torch 2.11.0, 2026-11-26 07:00 UTC**"
    assert table({**run, "code": "31cb92c"}).splitlines()[0].endswith("07:00 UTC, dcomm 31cb92c**")  # an A/B of commits
    assert markdown[4] == (
        "| ddp/fp16 | transformer | tf32 | 0.90 (0.85-0.95) | 1.20 (1.15-1.25) vs builtin | 9.00 | 10.00 | 3 | 3 |"
    )
    assert markdown[5].startswith("| ddp/bf16 | transformer | tf32 | n/a: x |")
    torch_points = chart_points(rows, "torch")
    expected_point = ("ddp/fp16 · transformer", "transformer", "tf32", 0.9)
    assert [(p[0], p[1], p[2], p[3].ratio) for p in torch_points] == [expected_point]
    assert [p[0] for p in chart_points(rows, "reference")] == ["ddp/fp16 · transformer (vs builtin)"]
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart.png"
    write_chart([run], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "nccl reduce-scatter"),
        ("ncclDevKernel_AllGather_RING_LL", "nccl all-gather"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl all-reduce"),
        ("ncclDevKernel_Broadcast_RING_LL", "nccl other"),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "gemm/attention"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise/copy"),
    ],
)
def test_kernel_kinds(kernel: str, kind: str) -> None:
    assert kernel_kind(kernel) == kind


def test_stream_summary_tells_idle_from_busy_on_the_gemm_stream() -> None:
    gemm, add = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", "vectorized_elementwise_kernel"
    nccl = "ncclDevKernel_AllGather_RING_LL"
    kernels = [
        Kernel(3, add, 0.0, 100.0),  # a busy copy stream with no GEMM is not the compute stream
        Kernel(3, add, 100.0, 200.0),
        Kernel(3, add, 200.0, 300.0),
        Kernel(7, gemm, 10.0, 40.0),
        Kernel(7, add, 30.0, 50.0),  # overlaps the GEMM: counted once
        Kernel(7, gemm, 70.0, 90.0),  # 20 us idle before it
        Kernel(9, nccl, 0.0, 60.0),
    ]
    assert stream_summary(kernels, steps=2) == {
        "compute busy": 30.0,
        "compute idle": 10.0,
        "compute kernels": 1.5,
        "nccl busy": 30.0,
    }
    assert stream_summary([], steps=1) == {}


def test_profile_counts_only_kernels_after_the_ranks_meet() -> None:
    # The meeting allreduce waited 900 us for a rank whose profiler started late: neither it nor
    # the kernels queued before it may count as a step's NCCL or idle time.
    gemm, add = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", "vectorized_elementwise_kernel"
    meet, step_nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"
    kernels = [
        Kernel(9, meet, 100.0, 1000.0),
        Kernel(7, add, 50.0, 60.0),
        Kernel(7, gemm, 1000.0, 1040.0),
        Kernel(9, step_nccl, 1010.0, 1030.0),
        Kernel(7, add, 1050.0, 1060.0),
    ]
    counted = after_first_collective(kernels)
    assert counted == kernels[2:]
    assert time_by_kind(counted, steps=2) == {
        "gemm/attention": 20.0,
        "nccl reduce-scatter": 10.0,
        "elementwise/copy": 5.0,
    }
    assert stream_summary(counted, steps=1)["compute idle"] == 10.0
    no_collective = [Kernel(7, gemm, 0.0, 5.0)]
    assert after_first_collective(no_collective) == no_collective


def _event(name: str, annotation: bool | None, start: int = 0, end: int = 5, stream: int = 7) -> SimpleNamespace:
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    event = SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, time_range=span)
    event.device_resource_id = stream
    if annotation is not None:
        event.is_user_annotation = annotation
    return event


@pytest.mark.parametrize("marked", [True, False])
def test_profile_keeps_aten_kernels_and_drops_annotations(marked: bool) -> None:
    # ATen's kernel names hold C++ namespaces ("at::native::"); the ranges of record_function on the
    # GPU timeline ("nccl:all_reduce", "DistributedDataParallel.forward") are not kernels. Whether
    # torch marks the annotations (is_user_annotation) or not, only the kernels are kept.
    kernels = [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >(int)",
        "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_256x128_16x3_nt_align4>(Params)",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "Memcpy DtoD (Device -> Device)",
    ]
    annotations = ["nccl:all_reduce", "DistributedDataParallel.forward", "Optimizer.step#Adam.step"]
    events = [_event(name, False if marked else None) for name in kernels]
    events += [_event(name, True if marked else None) for name in annotations]
    kept = _kernels(SimpleNamespace(events=lambda: events))
    assert [k.name for k in kept] == kernels
