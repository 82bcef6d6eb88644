"""Interleaved A/B measurement: every variant of a case built once, timed in shuffled rounds.

A machine drifts (clocks, temperature, other tenants) by more than the differences worth
finding, so variants are never timed in blocks of their own. :func:`run_case` builds all the
variants of a :class:`Case` on the same processes, warms them up, then runs rounds: each round
visits the variants in an order shuffled from a shared seed (the same order on every rank),
times a few steps of each (``Policy.steps``, whole periods of the case) with the device synchronized,
and keeps the slowest rank's time. The number of rounds adapts to a time budget. Each
:class:`Pair` is then reported as the median of its per-round ratios with a 95% bootstrap
interval of that median (:func:`compare`).

Example::

    >>> case = Case("demo", {"a": build_a, "b": build_b}, [Pair("demo", "a", "b", "dcomm/torch")])  # doctest: +SKIP
    >>> result = run_case(bench, case, Policy(budget_s=5.0))  # doctest: +SKIP
    >>> result.pairs[0].ratio, result.pairs[0].low, result.pairs[0].high  # doctest: +SKIP
    (0.981, 0.975, 0.990)
    >>> median_ratio_interval([2.0, 4.0], [1.0, 2.0])
    (2.0, 2.0, 2.0)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.bench.profile import profile_details
from tools.bench.timing import Bench, Step, release_memory
from tools.launch import short_error

__all__ = [
    "Case",
    "CaseResult",
    "Pair",
    "PairResult",
    "Policy",
    "Variant",
    "VariantResult",
    "bootstrap_median_interval",
    "compare",
    "keep_variants",
    "median_ratio_interval",
    "run_case",
    "steps_per_block",
    "with_control",
]

PAIR_KINDS = ("dcomm/torch", "dcomm/reference", "torch/reference", "A/A")
"""``A/A``: a variant over a second, separately built copy of itself (:func:`with_control`)."""


@dataclass
class Variant:
    """A built variant: its step, and what it reports about itself after the rounds."""

    step: Step
    details: Callable[[], dict[str, Any]] = dict


@dataclass(frozen=True)
class Pair:
    """A ratio to report: time of variant ``a`` over time of variant ``b``, per round."""

    label: str
    """The row it belongs to, e.g. ``ddp/fp16``."""
    a: str
    b: str
    kind: str
    """``dcomm/torch``, ``dcomm/reference``, ``torch/reference`` or ``A/A``."""

    def __post_init__(self) -> None:
        if self.kind not in PAIR_KINDS:
            raise ValueError(f"kind: expected one of {PAIR_KINDS}, got {self.kind!r}")


@dataclass
class Case:
    """Variants to build (name -> builder) and the pairs of them to compare."""

    name: str
    variants: dict[str, Callable[[], Variant]]
    pairs: list[Pair]
    steps_per_round: int = 1
    warmup_steps: int = 2
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    """How long a case's timed rounds may take, and the bounds on their number."""

    budget_s: float = 6.0
    min_rounds: int = 5
    max_rounds: int = 60
    steps: int = 1
    """Steps of each variant per round at least (rounded up to whole ``steps_per_round`` periods)."""
    draws: int = 2000
    """Bootstrap resamples per interval."""
    seed: int = 0
    profile: bool = False
    """After the rounds, add each variant's GPU time per step by kernel kind to its details (CUDA)."""


@dataclass
class VariantResult:
    """Seconds per step of each round (slowest rank), peak extra device memory, or an error."""

    samples_s: list[float] = field(default_factory=list)
    peak_extra_bytes: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.samples_s) if self.samples_s and not self.error else None

    def to_json(self) -> dict[str, Any]:
        if self.error:
            return {"error": self.error}
        return {
            "median_ms": round(self.median_s * 1e3, 4),
            "samples_ms": [round(s * 1e3, 4) for s in self.samples_s],
            "peak_extra_bytes": self.peak_extra_bytes,
            "details": self.details,
        }


@dataclass
class PairResult:
    """The median per-round ratio of a pair with its 95% bootstrap interval (or why there is none)."""

    pair: Pair
    ratio: float | None = None
    low: float | None = None
    high: float | None = None
    faster_rounds: int = 0
    rounds: int = 0
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.pair.label, "a": self.pair.a, "b": self.pair.b, "kind": self.pair.kind}
        if self.error:
            out["error"] = self.error
            return out
        out.update(ratio=_round(self.ratio), low=_round(self.low), high=_round(self.high))
        out.update(faster_rounds=self.faster_rounds, rounds=self.rounds)
        return out


@dataclass
class CaseResult:
    """Everything measured for one case on one workload and precision."""

    case: str
    workload: str
    precision: str
    steps_per_round: int
    rounds: int
    seconds: float
    details: dict[str, Any]
    variants: dict[str, VariantResult]
    pairs: list[PairResult]

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "workload": self.workload,
            "precision": self.precision,
            "steps_per_round": self.steps_per_round,
            "rounds": self.rounds,
            "seconds": round(self.seconds, 2),
            "details": self.details,
            "variants": {name: result.to_json() for name, result in self.variants.items()},
            "pairs": [pair.to_json() for pair in self.pairs],
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


# --------------------------------------------------------------------------------------------
# Statistics


def bootstrap_median_interval(
    values: list[float], draws: int = 2000, seed: int = 1, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval (default 95%) of the median of ``values``."""
    if not values:
        raise ValueError("values: expected at least one value, got none")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1.0 - level) / 2
    return medians[int(tail * draws)], medians[min(draws - 1, int((1.0 - tail) * draws))]


def median_ratio_interval(a_s: list[float], b_s: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """(median, low, high) of the per-round ratios ``a_s[i] / b_s[i]`` with a 95% bootstrap interval."""
    if len(a_s) != len(b_s) or not a_s:
        raise ValueError(f"a_s, b_s: expected two equally long, non-empty lists, got {len(a_s)} and {len(b_s)}")
    ratios = [a / b for a, b in zip(a_s, b_s, strict=True)]
    low, high = bootstrap_median_interval(ratios, draws)
    return statistics.median(ratios), low, high


def compare(pair: Pair, variants: dict[str, VariantResult], draws: int = 2000) -> PairResult:
    """The pair's ratio from the two variants' per-round samples (paired by round)."""
    for name in (pair.a, pair.b):
        result = variants.get(name)
        if result is None or result.error or not result.samples_s:
            reason = result.error if result is not None and result.error else "not measured"
            return PairResult(pair, error=f"{name}: {reason}")
    a_s, b_s = variants[pair.a].samples_s, variants[pair.b].samples_s
    rounds = min(len(a_s), len(b_s))
    a_s, b_s = a_s[-rounds:], b_s[-rounds:]
    ratio, low, high = median_ratio_interval(a_s, b_s, draws)
    faster = sum(a < b for a, b in zip(a_s, b_s, strict=True))
    return PairResult(pair, ratio, low, high, faster, rounds)


# --------------------------------------------------------------------------------------------
# Running a case


def keep_variants(case: Case, patterns: Sequence[str]) -> Case:
    """``case`` with only the variants whose names match one of the glob ``patterns``, and their pairs.

    Example::

        >>> pairs = [Pair("c", "dcomm a", "torch a", "dcomm/torch")]
        >>> case = Case("c", {"torch a": dict, "dcomm a": dict, "no overlap": dict}, pairs)
        >>> kept = keep_variants(case, ["dcomm *", "no overlap"])
        >>> sorted(kept.variants), kept.pairs
        (['dcomm a', 'no overlap'], [])
    """
    if not patterns:
        return case
    kept = {name: build for name, build in case.variants.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)}
    pairs = [pair for pair in case.pairs if pair.a in kept and pair.b in kept]
    return dataclasses.replace(case, variants=kept, pairs=pairs)


def with_control(case: Case) -> Case:
    """``case`` plus an A/A control: its reference variant built a second time, timed against itself.

    The reference is the torch side of the first ``dcomm/torch`` pair (else the ``b`` of the
    first pair). Both copies run the same code in the same rounds, so their ratio, ideally 1,
    shows how far this case's ratios move with nothing changed: the resolution of the others.

    Example::

        >>> pairs = [Pair("c", "dcomm a", "torch a", "dcomm/torch")]
        >>> case = with_control(Case("c", {"dcomm a": dict, "torch a": dict}, pairs))
        >>> sorted(case.variants), case.pairs[-1]
        (['dcomm a', 'torch a', 'torch a again'], Pair(label='c/A-A', a='torch a again', b='torch a', kind='A/A'))
    """
    if not case.pairs:
        return case
    versus_torch = [pair for pair in case.pairs if pair.kind == "dcomm/torch"]
    reference = (versus_torch or case.pairs)[0].b
    copy = f"{reference} again"
    variants = {**case.variants, copy: case.variants[reference]}
    control = Pair(f"{case.name}/A-A", copy, reference, "A/A")
    return dataclasses.replace(case, variants=variants, pairs=[*case.pairs, control])


def _build_all(bench: Bench, case: Case) -> tuple[dict[str, Variant], dict[str, str]]:
    """Build and warm up every variant; those that raise on any rank become errors."""
    built: dict[str, Variant] = {}
    errors: dict[str, str] = {}
    for name, build in case.variants.items():
        error = ""
        variant = None
        try:
            variant = build()
            for _ in range(case.warmup_steps):
                variant.step()
            bench.sync()
        except Exception as exc:  # any failure of the code under test is a result
            error = short_error(exc)
        agreed = bench.agree(error)
        if agreed:
            errors[name] = f"error: {agreed}"
            del variant
            release_memory()
        else:
            built[name] = variant
    return built, errors


def _time_block(bench: Bench, step: Step, steps: int) -> tuple[float, int | None, str]:
    """Seconds per step over ``steps`` steps (the steps' own times when they return them)."""
    bench.barrier()
    bench.sync()
    mark = bench.memory_mark()
    try:
        start = time.perf_counter()
        own: list[float] = []
        for _ in range(steps):
            returned = step()
            if isinstance(returned, float):
                own.append(returned)
        bench.sync()
        wall = time.perf_counter() - start
    except Exception as exc:  # reported as the variant's error
        return 0.0, None, short_error(exc)
    seconds = sum(own) if len(own) == steps else wall
    return seconds / steps, bench.peak_extra(mark), ""


def steps_per_block(steps: int, period: int) -> int:
    """``steps`` rounded up to whole periods of ``period`` steps."""
    return -(-steps // period) * period


def _target_rounds(round_s: float, policy: Policy) -> int:
    fitting = int(policy.budget_s / max(round_s, 1e-9))
    return max(policy.min_rounds, min(policy.max_rounds, fitting))


def run_case(bench: Bench, case: Case, policy: Policy, workload: str = "", precision: str = "") -> CaseResult:
    """Build the case's variants, time them in shuffled rounds, and compare its pairs."""
    started = time.perf_counter()
    built, errors = _build_all(bench, case)
    results = {name: VariantResult(error=errors[name]) if name in errors else VariantResult() for name in case.variants}
    order = list(built)
    steps = steps_per_block(policy.steps, case.steps_per_round)
    shuffle = random.Random(policy.seed)
    rounds, target = 0, policy.min_rounds
    while order and rounds < target:
        shuffle.shuffle(order)
        times, local_errors = [], {}
        for name in order:
            seconds, peak, error = _time_block(bench, built[name].step, steps)
            times.append(seconds)
            if error:
                local_errors[name] = error
            elif peak is not None:
                results[name].peak_extra_bytes = max(peak, results[name].peak_extra_bytes or 0)
        # One reduction per round: the slowest rank's time, and whether any rank failed, per variant.
        reduced = bench.slowest(times + [1.0 if name in local_errors else 0.0 for name in order])
        slowest, failed_flags = reduced[: len(order)], reduced[len(order) :]
        for name, seconds, failed in zip(order, slowest, failed_flags, strict=True):
            if failed:
                results[name] = VariantResult(error=f"error: {bench.agree(local_errors.get(name, ''))}")
            else:
                results[name].samples_s.append(seconds)
        order = [name for name, failed in zip(order, failed_flags, strict=True) if not failed]
        for name in list(built):
            if results[name].error:
                del built[name]
        rounds += 1
        if rounds == 1:
            target = _target_rounds(sum(slowest) * steps, policy)
    for name, variant in built.items():
        results[name].details = variant.details()
        if policy.profile and bench.is_cuda:
            results[name].details.update(profile_details(variant.step, case.steps_per_round))
    built.clear()
    release_memory()
    pairs = [compare(pair, results, policy.draws) for pair in case.pairs]
    seconds = time.perf_counter() - started
    return CaseResult(case.name, workload, precision, steps, rounds, seconds, case.details, results, pairs)
