"""The benchmark CLI and the fully_shard A/B run end to end on gloo (2 CPU ranks, tiny sizes, few steps)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tools.bench_results import rows_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINING_CASES = ("ddp", "compression", "post-local-sgd", "zero", "fsdp", "fully_shard")
EXPECTED_ROWS = {
    "averaging": {"averaging", "averaging/flattened"},
    # With torchft importable, dcomm's DiLoCo on torchft's manager runs too (its cost: "diloco ft").
    "diloco": {"diloco"} | ({"diloco ft"} if importlib.util.find_spec("torchft") else set()),
    "ddp": {
        "ddp/allreduce",
        "ddp/fp16",
        "ddp/bf16",
        "ddp/python floor",
        "ddp/allreduce vs python floor",
        "ddp/fp16 C++ vs python",
        "ddp/bf16 C++ vs python",
        "ddp/fp16 python",
        "ddp/bf16 python",
        "ddp/fp16 grad views",
    },
    "compression": {
        "compression/int8",
        "compression/fp8",
        "compression/int8 vs bf16",
        "compression/fp8 vs bf16",
        "compression/int8 vs torch uint8",
        "compression/floor",
        "compression/powersgd",
    },
    "post-local-sgd": {"post-local-sgd/periodic", "post-local-sgd/hierarchical"},
    "zero": {"zero/bound", "zero/step", "zero/interleaved", "zero/step+rs", "zero/interleaved+rs"}
    | {f"zero/{hook}{rs}+gather_during_forward" for hook in ("step", "interleaved") for rs in ("", "+rs")}
    | {"zero/step C++ vs python", "zero/step+rs C++ vs python", "zero/step fused-adam", "zero/step+rs fused-adam"}
    | {"zero/step fused local step", "zero/step+rs fused local step"},
    "fsdp": {"fsdp/reduce_scatter", "fsdp/fp16", "fsdp/bf16", "fsdp/allreduce"},
    "fully_shard": {"fully_shard/fp16", "fully_shard/bf16"},
    "hook-latency": {f"hook-latency/{h} {kind}" for h in ("allreduce", "fp16", "bf16") for kind in ("call", "step")},
}


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _check_variant(where: str, variant: dict[str, object]) -> None:
    if "error" in variant:
        reason = variant["error"]
        assert isinstance(reason, str), where
        assert reason.startswith(("error: ", "skipped: ")), (where, reason)
        assert len(reason.split(": ", 1)[1]) > 3, (where, reason)  # says what went wrong
        return
    samples = variant["samples_ms"]
    assert isinstance(samples, list), where
    assert len(samples) >= 2, where
    assert all(isinstance(s, float) and s > 0 for s in samples), where
    assert variant["median_ms"] > 0, where
    assert variant["peak_extra_bytes"] is None, where  # n/a on CPU


def _check_pair(where: str, pair: dict[str, object], variants: dict[str, dict[str, object]]) -> None:
    both_measured = "error" not in variants[pair["a"]] and "error" not in variants[pair["b"]]
    if not both_measured:
        assert "error" in pair, where
        return
    assert pair["low"] <= pair["ratio"] <= pair["high"], where
    assert math.isfinite(pair["ratio"]), where
    assert pair["ratio"] > 0, where
    assert pair["rounds"] == len(variants[pair["a"]]["samples_ms"]), where
    assert 0 <= pair["faster_rounds"] <= pair["rounds"], where


def _dcomm_errors(run: dict[str, object]) -> dict[str, str]:
    return {name: v["error"] for name, v in run["variants"].items() if name.startswith("dcomm") and "error" in v}


def _bench(tmp_path: pathlib.Path, *flags: str) -> dict[str, object]:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "tools.bench", "--size", "small", "--quick", "--json", str(out), *flags]
    proc = _run(command, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "95% interval" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_small_workload_trains_and_counts_its_parameters() -> None:
    """Each workload's CPU size builds, counts its parameters right and trains; the Llama ties its LM head."""
    import torch

    from tools.bench.workloads import WORKLOADS

    for name, sizes in WORKLOADS.items():
        workload = sizes["small"]
        model = workload.build(torch.device("cpu"))
        assert sum(p.numel() for p in model.parameters()) == workload.parameters, name
        loss = workload.loss(model, workload.make_batch(torch.device("cpu")))
        loss.backward()
        assert math.isfinite(loss.item()), name
        assert all(p.grad is not None for p in model.parameters()), name
    llama = WORKLOADS["llama"]["small"].build(torch.device("cpu"))
    assert llama.head.weight is llama.token.weight
    assert len(list(llama.parameters())) == len(list(llama.state_dict())) - 1  # the tied weight, once


def test_bench_runs_every_case_on_each_kind_of_small_workload(tmp_path: pathlib.Path) -> None:
    # mlp-wide is mlp-deep's model class at other sizes; CI time goes to the three model classes.
    workloads = ("mlp-deep", "transformer", "cnn")
    flags = ["--workload", *workloads, "--precision", "fp32", "--min-rounds", "2", "--max-rounds", "2"]
    result = _bench(tmp_path, *flags)
    assert result["backend"] == "gloo"
    assert result["world_size"] == 2
    assert result["device"] == "cpu"
    for key in ("date", "torch", "link", "gpu_count", "dcomm", "workloads", "precisions", "policy"):
        assert key in result, key
    runs = {(r["case"], r["workload"], r["precision"]): r for r in result["results"]}
    expected = {(case, w, "fp32") for case in TRAINING_CASES for w in workloads}
    expected |= {(case, w, "-") for case in ("averaging", "diloco") for w in workloads}
    expected |= {("hook-latency", "-", "-")}
    assert set(runs) == expected
    for key, run in runs.items():
        assert run["rounds"] == 2, key
        labels = {pair["label"] for pair in run["pairs"]}
        assert labels == EXPECTED_ROWS[run["case"]], key
        for name, variant in run["variants"].items():
            _check_variant(f"{key} {name}", variant)
        for pair in run["pairs"]:
            _check_pair(f"{key} {pair['label']} {pair['a']}/{pair['b']}", pair, run["variants"])
        if run["case"] in ("ddp", "compression", "averaging", "diloco"):  # dcomm runs all of them on gloo
            assert _dcomm_errors(run) == {}, key
    # torch's ZeRO overlap refuses gloo: the benchmark reports that and carries on.
    zero = runs[("zero", "transformer", "fp32")]
    assert "Gloo" in zero["variants"]["torch step"]["error"]
    assert "error" not in zero["variants"]["dcomm step"]
    # reduce_scatter=True variants say how many buckets fell back to an allreduce: none (dcomm
    # owns every parameter), whatever DDP's real buckets.
    assert zero["variants"]["dcomm step+rs"]["details"]["fallback buckets"] == 0
    assert "error" not in zero["variants"]["dcomm step+rs+gf"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_runs_the_transformer_in_each_precision(tmp_path: pathlib.Path) -> None:
    flags = ["--workload", "transformer", "--precision", "tf32", "bf16-autocast", "--cases", "ddp"]
    result = _bench(tmp_path, *flags, "--min-rounds", "2", "--max-rounds", "2", "--control")
    runs = {(r["case"], r["precision"]) for r in result["results"]}
    assert runs == {("ddp", "tf32"), ("ddp", "bf16-autocast")}
    for run in result["results"]:
        assert _dcomm_errors(run) == {}, run["precision"]
        assert "error" not in run["variants"]["builtin"], run["precision"]
        # --control: torch's allreduce hook (the first dcomm/torch pair's reference) timed against a copy.
        (control,) = [pair for pair in run["pairs"] if pair["kind"] == "A/A"]
        assert (control["label"], control["a"], control["b"]) == ("ddp/A-A", "torch allreduce again", "torch allreduce")
        _check_pair(run["precision"], control, run["variants"])
    rows = {(row.label, row.precision): row for row in rows_of(result)}
    assert [ratio.b for ratio in rows[("ddp/A-A", "tf32")].vs_reference] == ["torch allreduce"]
