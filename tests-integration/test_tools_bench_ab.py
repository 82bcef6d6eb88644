"""The A/B runner on 3 gloo ranks: slowest rank per round, agreed errors, paired ratios.

Steps here return their own "time" (a number that depends on the rank), so the test checks the
runner's bookkeeping exactly and never measures a clock.
"""

from __future__ import annotations

import math

import pytest

from dcomm_testing import run_ranks

ROUNDS = 4


def _ab_rank(rank: int, world: int) -> dict[str, object]:
    from tools.bench.ab import Case, Pair, Policy, Variant, run_case
    from tools.bench.timing import Bench

    calls = {"flaky": 0}

    def flaky() -> float:
        calls["flaky"] += 1
        if rank == world - 1 and calls["flaky"] == 3:  # fails in the first timed round, on one rank
            raise RuntimeError("flaky step failed")
        return 0.001

    def build_broken() -> Variant:
        if rank == 0:
            raise ValueError("cannot build on rank 0")
        return Variant(lambda: 0.001)

    variants = {
        "slow": lambda: Variant(lambda: 0.002 * (rank + 1), details=lambda: {"calls": 3}),
        "fast": lambda: Variant(lambda: 0.001 * (world - rank)),
        "flaky": lambda: Variant(flaky),
        "broken": build_broken,
    }
    pairs = [
        Pair("x", "slow", "fast", "dcomm/torch"),
        Pair("x", "flaky", "fast", "dcomm/reference"),
        Pair("x", "broken", "fast", "torch/reference"),
    ]
    bench = Bench.create()
    policy = Policy(budget_s=0.0, min_rounds=ROUNDS, max_rounds=ROUNDS)
    return run_case(bench, Case("x", variants, pairs, warmup_steps=2), policy, "w", "p").to_json()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [3])  # 2 ranks run in test_tools_bench_demo.py
def test_rounds_keep_the_slowest_rank_and_agree_on_errors(world: int) -> None:
    results = run_ranks(_ab_rank, world, timeout=240)
    assert all(result["variants"] == results[0]["variants"] for result in results)  # every rank agrees
    result = results[0]
    assert result["rounds"] == ROUNDS
    variants = result["variants"]
    # The slowest rank's number per round: slow is 2 ms x world on the last rank, fast 1 ms x world on rank 0.
    assert variants["slow"]["samples_ms"] == [2.0 * world] * ROUNDS
    assert variants["fast"]["samples_ms"] == [1.0 * world] * ROUNDS
    assert variants["slow"]["details"] == {"calls": 3}
    # The location names the innermost dcomm or tools frame, which depends on where the checkout lies.
    assert variants["flaky"]["error"].startswith("error: RuntimeError: flaky step failed [")
    assert variants["flaky"]["error"].endswith(f"(rank {world - 1})")
    assert variants["broken"]["error"].startswith("error: ValueError: cannot build on rank 0")
    assert variants["broken"]["error"].endswith("(rank 0)")
    ratio, flaky, broken = result["pairs"]
    assert ratio["ratio"] == ratio["low"] == ratio["high"] == 2.0
    assert (ratio["faster_rounds"], ratio["rounds"]) == (0, ROUNDS)
    assert flaky["error"].startswith("flaky: error: RuntimeError")
    assert broken["error"].startswith("broken: error: ValueError")
    assert math.isclose(variants["slow"]["median_ms"], 2.0 * world)
