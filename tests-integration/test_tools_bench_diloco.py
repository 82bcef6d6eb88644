"""The DiLoCo bench case on 2 gloo ranks: dcomm, DDP and (where importable) torchft on the same task.

Without torchft the case leaves its variant out and says why; with it (torchft 0.2 on
``PYTHONPATH``), torchft's DiLoCo runs beside dcomm's, rebuilt for a second workload, and ends
on the same loss with the same bytes (the same fp32 arithmetic). No timing is asserted.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

import pytest

from dcomm_testing import run_ranks

ROUNDS = 2
SYNC_EVERY = 5
"""Not the bench's default H (8): the case takes it from the context."""
WORKLOADS = ("mlp-deep", "transformer")


def _run_case(rank: int, world: int, block_torchft: bool) -> tuple[list[dict[str, Any]], int]:
    """The case's results on each workload, and how many torchft variants were shut down after."""
    if block_torchft:
        sys.modules["torchft"] = None  # type: ignore[assignment]  # import torchft raises ImportError
    from tools.bench.ab import Policy, run_case
    from tools.bench.cases import diloco
    from tools.bench.cases.common import Context
    from tools.bench.timing import Bench
    from tools.bench.workloads import WORKLOADS as ALL_WORKLOADS

    shut_down = diloco._shut_down
    calls = []

    def counted_shut_down(*args: Any) -> None:
        calls.append(args)
        shut_down(*args)

    diloco._shut_down = counted_shut_down
    bench = Bench.create()
    policy = Policy(budget_s=0.0, min_rounds=ROUNDS, max_rounds=ROUNDS)
    results = []
    for workload in WORKLOADS:
        ctx = Context(bench, ALL_WORKLOADS[workload]["small"], "fp32", SYNC_EVERY)
        results.append(run_case(bench, diloco.diloco_case(ctx), policy, workload, "-").to_json())
    return results, len(calls)


def _check_run(run: dict[str, Any], names: set[str]) -> dict[str, dict[str, Any]]:
    variants = run["variants"]
    assert set(variants) == names
    assert run["rounds"] == ROUNDS
    details = {name: variant["details"] for name, variant in variants.items()}
    for name, variant in variants.items():
        assert "error" not in variant, (name, variant)
        assert len(variant["samples_ms"]) == ROUNDS
        # The warm-up and each round run one whole period: every variant ends on a sync.
        assert details[name]["inner steps"] == (ROUNDS + 1) * SYNC_EVERY, name
        assert 0 < details[name]["loss"] < float("inf"), name
    ddp, dcomm = details["ddp adamw"], details["dcomm diloco"]
    # DDP sends its fp32 gradients every step, DiLoCo its fp32 pseudo-gradients every H steps.
    assert dcomm["bytes/inner step"] == ddp["bytes/inner step"] // SYNC_EVERY > 0
    assert dcomm["loss"] != ddp["loss"]  # different algorithms: the losses say which ran
    for pair in run["pairs"]:
        assert pair["rounds"] == ROUNDS, pair
        assert pair["low"] <= pair["ratio"] <= pair["high"], pair
    return details


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_torchft_the_case_runs_dcomm_and_says_why() -> None:
    (results, shut_down), (others, _) = run_ranks(_run_case, 2, True, timeout=240)
    assert shut_down == 0
    for run, other in zip(results, others, strict=True):
        assert run["details"]["torchft"].startswith("skipped: torchft is not importable"), run["details"]
        assert [(p["a"], p["b"]) for p in run["pairs"]] == [("dcomm diloco", "ddp adamw")]
        details = _check_run(run, {"ddp adamw", "dcomm diloco"})
        # The losses are averaged over the ranks, so rank 1 reports what rank 0 does.
        assert {name: v["details"] for name, v in other["variants"].items()} == details


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchft_runs_beside_dcomm_with_the_same_loss_and_bytes() -> None:
    pytest.importorskip("torchft")
    results, shut_down = run_ranks(_run_case, 2, False, timeout=240)[0]
    # Each workload's lighthouse and managers, once their variant was freed: torchft's DiLoCo and
    # dcomm's on torchft's manager ("dcomm diloco ft").
    assert shut_down == 2 * len(WORKLOADS)
    for run in results:  # the second workload rebuilt them
        assert run["details"]["torchft"] == importlib.metadata.version("torchft")
        assert [(p["a"], p["b"]) for p in run["pairs"]] == [
            ("dcomm diloco", "torchft diloco"),
            ("dcomm diloco", "ddp adamw"),
            ("torchft diloco", "ddp adamw"),
            ("dcomm diloco ft", "dcomm diloco"),
            ("dcomm diloco ft", "torchft diloco"),
        ]
        details = _check_run(run, {"ddp adamw", "dcomm diloco", "torchft diloco", "dcomm diloco ft"})
        assert details["torchft diloco"] == details["dcomm diloco"]
        assert details["dcomm diloco ft"] == details["dcomm diloco"]  # no failure: the same training


def test_torchft_missing_says_why_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    from tools.bench.cases.diloco import torchft_missing

    monkeypatch.setitem(sys.modules, "torchft", None)
    reason = torchft_missing()
    assert reason.startswith("skipped: torchft is not importable (")
    assert "torchft" in reason.split("(", 1)[1]


class _GpuBench:
    """A stand-in bench that says it runs on CUDA (the case is only planned, nothing is built)."""

    is_cuda = True

    def agree(self, message: str) -> str:
        return message


@pytest.mark.parametrize("torchft_importable", [True, False])
def test_gpu_runs_also_compare_fp8_pseudo_gradients(monkeypatch: pytest.MonkeyPatch, torchft_importable: bool) -> None:
    from tools.bench.cases import diloco
    from tools.bench.cases.common import Context
    from tools.bench.workloads import WORKLOADS as ALL_WORKLOADS

    monkeypatch.setattr(diloco, "torchft_missing", lambda: "" if torchft_importable else "skipped: no torchft")
    monkeypatch.setattr(diloco, "_torchft_version", lambda: "0.2.0")
    case = diloco.diloco_case(Context(_GpuBench(), ALL_WORKLOADS["mlp-deep"]["small"], "fp32"))  # type: ignore[arg-type]
    pairs = {(pair.label, pair.a, pair.b) for pair in case.pairs}
    assert "dcomm diloco fp8" in case.variants
    assert ("diloco/fp8", "dcomm diloco fp8", "ddp adamw") in pairs
    if torchft_importable:
        assert "torchft diloco fp8" in case.variants
        assert ("diloco/fp8", "dcomm diloco fp8", "torchft diloco fp8") in pairs
    else:
        assert not any("torchft" in name for name in case.variants)
