"""The demo: its byte counter counts exactly what each collective sends, its verdict fails the
right runs, and its short configuration trains every algorithm end to end on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dcomm_testing import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.demo import exit_code  # noqa: E402
from tools.demo import main as demo_main  # noqa: E402
from tools.demo_lm.comm_bytes import CommCounter  # noqa: E402
from tools.demo_lm.config import CONFIGS  # noqa: E402
from tools.demo_lm.corpus import Corpus  # noqa: E402
from tools.demo_lm.report import (  # noqa: E402
    COMPRESSION_CHART,
    DILOCO_CHART,
    convergence_goal,
    family_chart,
    savings,
    verdict,
    write_report,
)
from tools.demo_lm.runs import BASELINE, CONVERGENCE_GOAL, DILOCO_GOAL, DILOCO_TOLERANCE, FAMILIES  # noqa: E402
from tools.demo_lm.train import RunResult, rank_main  # noqa: E402


def _counted(counter: CommCounter, collective) -> int:  # type: ignore[no-untyped-def]
    before = counter.bytes_sent
    with counter.counting():
        collective()
    return counter.bytes_sent - before


def _count_each_collective(rank: int, world: int) -> dict[str, int]:
    counter = CommCounter.install()
    numel = 6 * world
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    torch.set_default_device(device)
    outside_before = counter.bytes_sent
    dist.all_reduce(torch.ones(numel))  # outside counting(): not counted
    counts = {"outside": counter.bytes_sent - outside_before}
    counts["all_reduce"] = _counted(counter, lambda: dist.all_reduce(torch.ones(numel, dtype=torch.float16)))
    counts["broadcast"] = _counted(counter, lambda: dist.broadcast(torch.ones(numel), src=1))
    counts["all_gather"] = _counted(
        counter, lambda: dist.all_gather_into_tensor(torch.empty(world * 5), torch.ones(5, dtype=torch.float32))
    )
    counts["reduce_scatter"] = _counted(
        counter,
        lambda: dist.reduce_scatter_tensor(
            torch.empty(3, dtype=torch.float64), torch.ones(3 * world, dtype=torch.float64)
        ),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=None if device is None else [device])
    counts["ddp_builtin"] = _counted(counter, lambda: ddp(torch.randn(4, 7) + rank).sum().backward())
    counts["ddp_params"] = sum(p.numel() * 4 for p in ddp.parameters())
    return counts


NCCL = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("backend", "world"), [("gloo", 2), ("gloo", 3), pytest.param("nccl", 2, marks=NCCL)])
def test_counter_counts_the_bytes_each_rank_sends(backend: str, world: int) -> None:
    counted = run_ranks(_count_each_collective, world, backend=backend, timeout=120)
    for rank, counts in enumerate(counted):
        assert counts["outside"] == 0
        assert counts["all_reduce"] == 6 * world * 2  # fp16
        assert counts["broadcast"] == (6 * world * 4 if rank == 1 else 0)  # the root only
        assert counts["all_gather"] == 5 * 4  # this rank's shard
        assert counts["reduce_scatter"] == 3 * world * 8  # the whole input
        # DDP's built-in allreduce runs in C++: it is counted all the same, every bucket once.
        assert counts["ddp_builtin"] == counts["ddp_params"]


def _result(impl: str, losses: list[float], algorithm: str = "DDP fp16_compress_hook", **fields: str) -> RunResult:
    steps = list(range(len(losses)))
    return RunResult(
        algorithm,
        impl,
        steps=steps,
        val_loss=losses,
        bytes_sent=[0.0] * len(losses),
        wall_s=[0.0] * len(losses),
        **fields,
    )


def test_verdict_fails_dcomm_runs_that_fail_stall_or_end_above_torch() -> None:
    torch_run = _result("torch", [5.0, 2.00])
    assert verdict([_result("dcomm", [5.0, 2.019]), torch_run], tolerance=0.01) == []
    (above,) = verdict([_result("dcomm", [5.0, 2.021]), torch_run], tolerance=0.01)
    assert "more than 1% above torch's 2.0000" in above
    (stalled,) = verdict([_result("dcomm", [5.0, 5.0])], tolerance=0.01)
    assert "did not fall" in stalled
    (crashed,) = verdict([_result("dcomm", [], error="RuntimeError: boom")], tolerance=0.01)
    assert "boom" in crashed
    # Not installed yet, or torch's run failing: nothing to fail.
    assert verdict([_result("dcomm", [], skipped="not installed"), _result("torch", [], error="x")], 0.01) == []


def test_the_demo_exits_1_by_default_only_when_a_run_breaks_and_with_check_on_the_tolerance() -> None:
    torch_run = _result("torch", [5.0, 2.00])
    above = [_result("dcomm", [5.0, 2.05]), torch_run]
    assert exit_code(above, 0.01, check=False) == 0
    assert exit_code(above, 0.01, check=True) == 1
    assert exit_code([_result("dcomm", [5.0, 2.0]), torch_run], 0.01, check=True) == 0
    for broken in (_result("dcomm", [], error="RuntimeError: boom"), _result("dcomm", [5.0, 5.0])):
        assert exit_code([broken, torch_run], 0.01, check=False) == 1


def test_savings_compare_each_dcomm_run_with_the_baseline() -> None:
    baseline = _result("torch", [5.0, 2.00], algorithm=BASELINE, step_ms=10.0)
    baseline.bytes_sent = [0.0, 400.0]
    half = _result("dcomm", [5.0, 2.02], algorithm="DDP bf16_compress_hook", step_ms=12.5)
    half.bytes_sent = [0.0, 200.0]
    torch_run = _result("torch", [5.0, 2.0], algorithm="DDP bf16_compress_hook")
    assert savings([baseline, half, torch_run]) == [("DDP bf16_compress_hook", "0.50x", "1.25x", "+1.00%")]
    assert savings([half]) == []  # no baseline: nothing to compare with


INT8, FP8, POWERSGD = CONVERGENCE_GOAL


def test_verdict_holds_int8_and_fp8_to_fp32_ddp_and_powersgd_to_torch() -> None:
    baseline = _result("torch", [5.0, 2.00], algorithm=BASELINE)
    for hook in (INT8, FP8):  # torch has no such hook: fp32 DDP is the reference
        assert verdict([baseline, _result("dcomm", [5.0, 2.019], algorithm=hook)], tolerance=0.01) == []
        (above,) = verdict([baseline, _result("dcomm", [5.0, 2.021], algorithm=hook)], tolerance=0.01)
        assert above == f"{hook} [dcomm]: final validation loss 2.0210 is more than 1% above fp32 DDP's 2.0000"
        # No baseline run (it failed): nothing to compare with.
        assert verdict([_result("dcomm", [5.0, 2.5], algorithm=hook)], tolerance=0.01) == []
    # PowerSGD 3% above fp32 DDP like torch's PowerSGD: the algorithm's gap, not a dcomm failure;
    # 2% above torch's: a failure, named against torch.
    torch_powersgd = _result("torch", [5.0, 2.06], algorithm=POWERSGD)
    assert verdict([baseline, _result("dcomm", [5.0, 2.06], algorithm=POWERSGD), torch_powersgd], 0.01) == []
    (above,) = verdict([baseline, _result("dcomm", [5.0, 2.10], algorithm=POWERSGD), torch_powersgd], 0.01)
    assert "more than 1% above torch's 2.0600" in above
    # Runs outside the goal and without a torch counterpart (DiLoCo) are not held to fp32 DDP.
    assert verdict([baseline, _result("dcomm", [5.0, 2.5], algorithm="DiLoCo")], tolerance=0.01) == []


def test_convergence_goal_compares_each_compression_run_with_fp32_ddp() -> None:
    results = [
        _result("torch", [5.0, 2.00], algorithm=BASELINE),
        _result("dcomm", [5.0, 2.015], algorithm=INT8),
        _result("dcomm", [5.0, 2.03], algorithm=FP8),
        _result("dcomm", [], algorithm=POWERSGD, skipped="not installed"),
        _result("torch", [5.0, 2.038], algorithm=POWERSGD),
        _result("dcomm", [5.0, 2.5], algorithm="DiLoCo"),
    ]
    assert convergence_goal(results, tolerance=0.02) == [
        f"{INT8} [dcomm]: 2.0150, +0.75% vs fp32 DDP's 2.0000 at step 1: met",
        f"{FP8} [dcomm]: 2.0300, +1.50% vs fp32 DDP's 2.0000 at step 1: met",
        f"{POWERSGD} [torch]: 2.0380, +1.90% vs fp32 DDP's 2.0000 at step 1: met",
    ]
    verdicts = [line.rsplit(": ", 1)[1] for line in convergence_goal(results, tolerance=0.01)]
    assert verdicts == ["met", "missed", "missed"]
    assert convergence_goal(results[1:], tolerance=0.01) == []  # no baseline


def test_report_charts_the_compression_runs_against_fp32_ddp(tmp_path: pathlib.Path) -> None:
    losses = {BASELINE: [5.0, 3.0, 2.0], INT8: [5.0, 3.01, 2.01], POWERSGD: [5.0, 3.2, 2.05]}
    results = [_result("dcomm", curve, algorithm=name) for name, curve in losses.items()]
    results[0].impl = "torch"
    for r in results:
        r.bytes_sent = [0.0, 1e6, 2e6]
    report = write_report(tmp_path / "goal", results, {"torch": torch.__version__}, tolerance=0.01).read_text()
    assert (tmp_path / "goal" / COMPRESSION_CHART).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({COMPRESSION_CHART})" in report
    assert "## Compression against fp32 DDP" in report
    assert f"- {POWERSGD} [dcomm]: 2.0500, +2.50% vs fp32 DDP's 2.0000 at step 2: missed" in report
    record = json.loads((tmp_path / "goal" / "results.json").read_text())
    assert record["convergence_goal"] == convergence_goal(results, 0.01)
    # Without a compression run: neither the chart nor the section.
    report = write_report(tmp_path / "none", results[:1], {}, tolerance=0.01).read_text()
    assert not (tmp_path / "none" / COMPRESSION_CHART).exists()
    assert "Compression against" not in report


def test_report_states_and_charts_the_diloco_runs_against_their_two_percent_goal(tmp_path: pathlib.Path) -> None:
    fp32, int8 = DILOCO_GOAL
    losses = {BASELINE: [5.0, 3.0, 2.0], fp32: [5.0, 3.1, 2.03], int8: [5.0, 3.1, 2.05], INT8: [5.0, 3.0, 2.01]}
    results = [_result("dcomm", curve, algorithm=name) for name, curve in losses.items()]
    results[0].impl = "torch"
    for r in results:
        r.bytes_sent = [0.0, 1e6, 2e6]
    assert DILOCO_TOLERANCE == 0.02
    expected = [
        f"{fp32} [dcomm]: 2.0300, +1.50% vs fp32 DDP's 2.0000 at step 2: met",
        f"{int8} [dcomm]: 2.0500, +2.50% vs fp32 DDP's 2.0000 at step 2: missed",
    ]
    assert convergence_goal(results, DILOCO_TOLERANCE, DILOCO_GOAL) == expected
    # The compression goal leaves DiLoCo out, and DiLoCo's gap fails nothing (no torch counterpart).
    assert [line.split(" [")[0] for line in convergence_goal(results, 0.01)] == [INT8]
    assert verdict(results, tolerance=0.01) == []
    report = write_report(tmp_path, results, {"diloco": "H = 2"}, tolerance=0.01).read_text()
    assert (tmp_path / DILOCO_CHART).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({DILOCO_CHART})" in report
    assert "## DiLoCo against fp32 DDP" in report
    assert "within 2% of fp32 DDP" in report
    assert all(f"- {line}" in report for line in expected)
    assert json.loads((tmp_path / "results.json").read_text())["diloco_goal"] == expected


def test_demo_refuses_steps_that_leave_no_diloco_step_after_the_ddp_start(capsys: pytest.CaptureFixture[str]) -> None:
    start = CONFIGS["diloco"].diloco_start
    assert demo_main(["--config", "diloco", "--steps", str(start)]) == 2
    assert f"--steps: {start} leaves no DiLoCo step after {start} DDP steps" in capsys.readouterr().err
    assert demo_main(["--config", "tiny", "--steps", "5", "--diloco-start", "5"]) == 2
    with pytest.raises(SystemExit):
        demo_main(["--diloco-start", "-1"])
    with pytest.raises(SystemExit):
        demo_main(["--diloco-every", "0"])
    assert "--diloco-every: expected at least 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_diloco_start_trains_exactly_as_ddp_then_sends_only_the_syncs() -> None:
    config = dataclasses.replace(CONFIGS["tiny"], steps=12, eval_every=4, diloco_every=4, diloco_start=4)
    corpus = Corpus.load(config.corpus_bytes)
    per_rank = run_ranks(rank_main, 2, config, corpus, ["DiLoCo"], False, timeout=200)
    runs = {r["algorithm"]: r for r in per_rank[0]}
    ddp = runs[BASELINE]
    params = sum(p.numel() for p in config.new_model().parameters())
    for name in DILOCO_GOAL:
        run = runs[name]
        assert not run["error"], run
        assert not run["skipped"], run
        assert run["steps"] == ddp["steps"] == [0, 4, 8, 12]
        # The first 4 steps are DDP's: the same losses, bit for bit, and the same bytes.
        assert run["val_loss"][:2] == ddp["val_loss"][:2]
        assert run["bytes_sent"][1] == ddp["bytes_sent"][1]
        assert run["val_loss"][2] != ddp["val_loss"][2]
        # Steps 9 to 12: no DDP traffic, one sync of the pseudo-gradient (fp32: params * 4 bytes in).
        last_sync = run["bytes_sent"][3] - run["bytes_sent"][2]
        if name == "DiLoCo":
            assert last_sync == params * 4
        else:
            assert 0 < last_sync < params * 4 / 2
    assert ddp["bytes_sent"][3] - ddp["bytes_sent"][2] == 4 * params * 4


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=NCCL)])
def test_demo_short_configuration_writes_the_report_and_every_loss_falls(backend: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable,
        "-m",
        "tools.demo",
        "--config",
        "tiny",
        "--backend",
        backend,
        "--out",
        str(out),
        "--check",
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 dcomm runs outside the tolerance" in proc.stdout
    assert "Compression with error feedback vs fp32 DDP at equal steps" in proc.stdout
    assert "What each algorithm saves against DDP's fp32 allreduce" in proc.stdout
    assert re.search(r"^DDP fp16_compress_hook +0\.50x ", proc.stdout, re.M)  # half the baseline's bytes per step
    assert ("not speed on GPUs" in proc.stdout) == (backend == "gloo")

    report = (out / "report.md").read_text()
    charts = [family_chart(family) for family in FAMILIES] + [COMPRESSION_CHART]
    for chart in charts:
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", chart
        assert f"]({chart})" in report, chart
    assert torch.__version__ in report
    assert "tolerance" in report

    record = json.loads((out / "results.json").read_text())
    runs = {(r["algorithm"], r["impl"]): r for r in record["runs"]}
    dcomm_runs = [r for r in record["runs"] if r["impl"] == "dcomm"]
    assert len(dcomm_runs) >= 9
    for run in dcomm_runs:
        assert not run["error"], run
    trained = [r for r in record["runs"] if not r["error"] and not r["skipped"]]
    assert len(trained) >= 12
    for run in trained:
        assert run["val_loss"][-1] < run["val_loss"][0] - 0.5, run  # from ~ln(256) = 5.5 nats
        assert run["steps"][-1] == 12, run

    params = sum(p.numel() for p in CONFIGS["tiny"].new_model().parameters())
    # After the first step (when DDP also broadcasts its rebuilt bucket order once), exactly the
    # gradients' bytes per step: fp32 for the built-in allreduce and the allreduce hook, fp16 for fp16.
    per_step = {
        name: (r["bytes_sent"][-1] - r["bytes_sent"][-2]) / (r["steps"][-1] - r["steps"][-2])
        for name, r in runs.items()
        if r in trained
    }
    assert per_step[(BASELINE, "torch")] == params * 4
    assert runs[(BASELINE, "torch")]["bytes_by_collective"]["allreduce_"] == 12 * params * 4  # DDP's C++ allreduce
    assert per_step[("DDP allreduce_hook", "dcomm")] == params * 4
    assert per_step[("DDP fp16_compress_hook", "dcomm")] == params * 2
