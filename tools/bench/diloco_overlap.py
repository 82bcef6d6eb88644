"""DiLoCo's overlap: how long each kind of sync step takes next to a plain inner step (issue 16).

Trains the ``transformer`` workload (on GPUs its ``large-slow`` size at :data:`GPU_BATCH`
sequences a step, so that the GPU, not Python, sets each rank's pace) with ``DiLoCoOptimizer``
(AdamW inner, SGD with Nesterov momentum outer) once per setting: fragments ``F``, delay ``tau``,
compression and ``sync_every`` ``H``, written ``F:tau[:compression[:H]]``. Before and after the
settings it trains with AdamW alone, the no-sync baseline. Every step (zero_grad, forward,
backward, ``opt.step()``) is timed on the training stream only: on CUDA by events recorded on the
current stream between steps, with no device synchronisation inside the timed loop (perf_counter
on CPU). A transfer running behind the next steps is therefore free, and a real stall counts in
the step where it happens: the apply step's stream waiting for an unfinished transfer.

Steps are classed by what DiLoCo does in them: ``launch`` (a fragment's averaging starts: seen in
``opt.bytes_sent``), ``advance`` (compressed on gloo, ``(tau + 1) // 2`` steps later: its second
stage starts; on NCCL it is queued at the launch), ``apply`` (``tau`` steps after the launch: the
outer step on the averaged change) or ``plain``; a step that does several is named by all of them
(``apply+launch``). Per setting: the median plain step, the median of each special kind, the worst
kind's median over the plain median (the goal: at most 1.10 with ``F >= 2`` and ``tau >= 1``) with
a 95% bootstrap interval, the run's throughput against the baseline (its time over the timed steps
times the baseline's median step), bytes per inner step, and the slowest rank.

Three views of the same steps. Between syncs the ranks do not wait for each other, so they drift
apart, and at a sync the ranks that arrive first wait for the last one to launch it: a
straggler's wait, not communication. ``least waiting rank``: every step on the rank that waited
least (its time over its own plain median, the minimum over the ranks; the last rank to launch a
sync never waits), which isolates what the sync itself costs. ``slowest rank``: the steps of the
rank with the largest total, the one that sets the job's pace, with its throughput. ``each
step's slowest rank``: every step's maximum over the ranks, which charges every wait to the sync
steps: an upper bound. A link probe (an fp32 allreduce) estimates how many plain steps one
fragment's transfer takes (which delays can cover it) and the link load (bytes per step over
what the link carries in a plain step; above 1 no delay can hide the syncs).

4 GPUs, emulated slow link (sockets over loopback, ~1 GB/s)::

    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0 \\
        torchrun --standalone --nproc-per-node 4 -m tools.bench.diloco_overlap --json diloco-overlap-slow.json

4 GPUs, fast link (NVLink)::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 4 -m tools.bench.diloco_overlap \\
        --json diloco-overlap-fast.json

On CPU (gloo, the ``small`` size), a smoke run::

    torchrun --standalone --nproc-per-node 2 -m tools.bench.diloco_overlap --steps 8 --sync-every 4 \\
        --settings 1:0 2:1:int8
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tools.bench.ab import steps_per_block
from tools.bench.cases.common import Context, train_step
from tools.bench.cases.diloco import INNER_LR, OUTER
from tools.bench.timing import Bench, Step, release_memory
from tools.bench.workloads import PRECISIONS, SIZE_TIERS, WORKLOADS, set_tf32
from tools.launch import init_rank, short_error

__all__ = [
    "DEFAULT_SETTINGS",
    "GPU_BATCH",
    "Setting",
    "StepTimer",
    "link_of",
    "main",
    "parse_setting",
    "step_kinds",
    "summarize",
    "worst_ratio_interval",
]

DEFAULT_SETTINGS = ("1:0", "2:1", "4:1", "4:4", "2:9", "4:1:int8", "4:4:int8", "2:9:int8", "4:10:none:50")
"""F:tau[:compression[:H]]: plain DiLoCo, then fragments with delays too short and long enough to hide a
transfer, in fp32 and int8 (a quarter of the bytes), and fp32 at H=50 (less than half the link load of H=20)."""
GPU_BATCH = 64
"""Sequences per step on GPUs: the ``large-slow`` transformer's 8 leave a step host-bound (~30 ms of
Python for ~9 ms of GPU work on an H200), and host-bound ranks drift apart between syncs at their
own hosts' pace (one rank steadily 20% slower, say), so the first ranks at a sync wait for the last:
a cost of the hosts, not of the communication, that DDP's per-step sync would pay every step. At 64
the GPU sets every rank's pace (~44 ms on an H200), as in real training."""
SLOW_LINK_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")
LINK_ENV = (*SLOW_LINK_ENV, "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE")
COMPRESSIONS = ("none", "bf16", "fp8", "int8", "int4")


@dataclass(frozen=True)
class Setting:
    """One DiLoCo configuration: fragments, delay (tau), compression (None: fp32) and sync_every (H)."""

    fragments: int
    delay: int
    compression: str | None
    sync_every: int

    @property
    def label(self) -> str:
        return f"F{self.fragments} tau{self.delay} {self.compression or 'fp32'} H{self.sync_every}"

    @property
    def spacing(self) -> float:
        """Inner steps between two fragments' syncs (``H / F``)."""
        return self.sync_every / self.fragments

    def problem(self) -> str:
        """Why DiLoCo would refuse this setting ('' when it is valid)."""
        if self.delay >= self.sync_every:
            return f"tau={self.delay} is not below H={self.sync_every}"
        return ""


def parse_setting(text: str, sync_every: int) -> Setting:
    """``"F:tau[:compression[:H]]"`` (compression ``none`` for fp32; ``H`` defaults to ``sync_every``).

    Example::

        >>> parse_setting("4:4:int8", 20)
        Setting(fragments=4, delay=4, compression='int8', sync_every=20)
    """
    parts = text.split(":")
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"setting {text!r}: expected F:tau[:compression[:H]], e.g. 4:4:int8 or 2:1:none:20")
    compression = parts[2] if len(parts) > 2 else "none"
    if compression not in COMPRESSIONS:
        raise ValueError(f"setting {text!r}: compression {compression!r} is not one of {COMPRESSIONS}")
    try:
        numbers = [int(parts[0]), int(parts[1]), int(parts[3]) if len(parts) > 3 else sync_every]
    except ValueError:
        raise ValueError(f"setting {text!r}: F, tau and H must be whole numbers, e.g. 4:4:int8:20") from None
    fragments, delay, every = numbers
    if fragments < 1 or delay < 0 or every < 1:
        raise ValueError(f"setting {text!r}: expected F >= 1, tau >= 0 and H >= 1")
    return Setting(fragments, delay, None if compression == "none" else compression, every)


def step_kinds(launches: list[int], setting: Setting, steps: int, advance_midway: bool = True) -> list[str]:
    """The kind of each of ``steps`` steps (index 0 is inner step 1), given the steps that launched a sync.

    ``advance_midway``: a compressed sync advances on a step of its own (gloo), not at its launch (NCCL).

    Example::

        >>> step_kinds([2, 4], Setting(2, 1, None, 4), 5)
        ['plain', 'launch', 'apply', 'launch', 'apply']
        >>> step_kinds([2], Setting(1, 0, None, 2), 3)
        ['plain', 'apply+launch', 'plain']
    """
    kinds: list[set[str]] = [set() for _ in range(steps)]

    def add(step: int, kind: str) -> None:
        if 1 <= step <= steps:
            kinds[step - 1].add(kind)

    for launch in launches:
        add(launch, "launch")
        add(launch + setting.delay, "apply")
        advance = launch + (setting.delay + 1) // 2  # as DiLoCoOptimizer schedules it
        if advance_midway and setting.compression is not None and 0 < advance - launch < setting.delay:
            add(advance, "advance")
    return ["+".join(sorted(k)) if k else "plain" for k in kinds]


def worst_ratio_interval(
    plain: list[float], special: dict[str, list[float]], draws: int = 2000, seed: int = 1
) -> tuple[float, float]:
    """95% bootstrap interval of ``max over kinds of median(kind) / median(plain)`` (each list resampled).

    Example::

        >>> worst_ratio_interval([1.0, 1.0], {"apply": [2.0, 2.0]})
        (2.0, 2.0)
    """
    rng = random.Random(seed)

    def median_of_draw(values: list[float]) -> float:
        return statistics.median(rng.choices(values, k=len(values)))

    ratios = sorted(max(median_of_draw(v) for v in special.values()) / median_of_draw(plain) for _ in range(draws))
    return ratios[int(0.025 * draws)], ratios[min(draws - 1, int(0.975 * draws))]


def summarize(times_s: list[float], kinds: list[str], baseline_s: float | None) -> dict[str, Any]:
    """The medians per kind (ms), the worst special kind over plain, and the throughput against ``baseline_s``.

    Example::

        >>> out = summarize([1.0, 1.2, 1.0, 1.1], ["plain", "launch", "plain", "apply"], 1.0)
        >>> out["worst kind"], out["sync/plain"], out["throughput ratio"]
        ('launch', 1.2, 1.075)
    """
    by_kind: dict[str, list[float]] = {}
    for seconds, kind in zip(times_s, kinds, strict=True):
        by_kind.setdefault(kind, []).append(seconds)
    plain = by_kind.pop("plain", [])
    out: dict[str, Any] = {
        "steps": len(times_s),
        "total ms": round(sum(times_s) * 1e3, 3),
        "plain ms": round(statistics.median(plain) * 1e3, 4) if plain else None,
        "plain steps": len(plain),
        "kinds": {
            kind: {"median ms": round(statistics.median(v) * 1e3, 4), "count": len(v)} for kind, v in by_kind.items()
        },
    }
    if plain and by_kind:
        worst = max(by_kind, key=lambda kind: statistics.median(by_kind[kind]))
        out["worst kind"] = worst
        out["sync/plain"] = round(statistics.median(by_kind[worst]) / statistics.median(plain), 4)
        low, high = worst_ratio_interval(plain, by_kind)
        out["sync/plain 95%"] = [round(low, 4), round(high, 4)]
        slowest = max(max(v) for v in by_kind.values())  # one step, not a median: what a single stall costs
        out["slowest sync step/plain"] = round(slowest / statistics.median(plain), 4)
    if baseline_s:
        out["throughput ratio"] = round(sum(times_s) / (len(times_s) * baseline_s), 4)
    return out


class StepTimer:
    """Boundaries between consecutive steps: CUDA events on the current stream, or the host clock on CPU.

    ``mark()`` before the first step and after each one; ``seconds()`` (after the loop; it waits
    for the last event) gives each step's time. Nothing in between synchronizes the device.

    Example::

        >>> timer = StepTimer(torch.device("cpu"), steps=2)
        >>> for _ in range(3):
        ...     timer.mark()
        >>> len(timer.seconds())
        2
    """

    def __init__(self, device: torch.device, steps: int) -> None:
        self.cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if self.cuda else []
        self._clock: list[float] = []
        self._marks = 0

    def mark(self) -> None:
        if self.cuda:
            self._events[self._marks].record()
        else:
            self._clock.append(time.perf_counter())
        self._marks += 1

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in itertools.pairwise(self._clock)]
        marks = self._events[: self._marks]
        marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]


def link_of(env: dict[str, str] | os._Environ[str]) -> str:
    """``"slow"`` when NCCL may use neither P2P, shared memory nor InfiniBand (sockets only), else ``"fast"``.

    Example::

        >>> link_of({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"})
        'slow'
    """
    return "slow" if all(env.get(key) == "1" for key in SLOW_LINK_ENV) else "fast"


# --------------------------------------------------------------------------------------------
# Running


@dataclass
class Run:
    """One timed run: every rank's step times, the steps' kinds, and the bytes per step."""

    rank_times_s: list[list[float]]
    kinds: list[str]
    bytes_per_step: float = 0.0

    @property
    def times_s(self) -> list[float]:
        """Each step's time on its slowest rank."""
        return [max(step) for step in zip(*self.rank_times_s, strict=True)]

    @property
    def rank_totals_s(self) -> list[float]:
        return [sum(times) for times in self.rank_times_s]

    @property
    def slowest_rank(self) -> int:
        """The rank with the largest total: the one that sets the job's pace."""
        totals = self.rank_totals_s
        return max(range(len(totals)), key=totals.__getitem__)


def _timed(
    bench: Bench, step: Step, warmup: int, steps: int, on_step: Callable[[int], None] | None = None
) -> list[list[float]]:
    """Run ``warmup`` untimed then ``steps`` timed steps; every rank's step times (rank-major)."""
    for index in range(warmup):
        step()
        if on_step is not None:
            on_step(index)
    bench.sync()
    bench.barrier()
    timer = StepTimer(bench.device, steps)
    timer.mark()
    for index in range(warmup, warmup + steps):
        step()
        if on_step is not None:
            on_step(index)
        timer.mark()
    mine = torch.tensor(timer.seconds(), dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(bench.world)]
    dist.all_gather(every, mine, group=bench.side_group)
    return [times.tolist() for times in every]


def run_baseline(ctx: Context, warmup: int, steps: int) -> Run:
    """AdamW alone: no sync at all."""
    model = ctx.model()
    step = train_step(ctx, model, torch.optim.AdamW(model.parameters(), lr=INNER_LR))
    return Run(_timed(ctx.bench, step, warmup, steps), ["plain"] * steps)


def run_setting(ctx: Context, setting: Setting, warmup: int, steps: int) -> Run:
    """DiLoCo with ``setting``: ``warmup`` untimed then ``steps`` timed steps, then the averaging in flight finished."""
    from dcomm.averaging import DiLoCoOptimizer

    model = ctx.model()
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    outer = torch.optim.SGD(model.parameters(), **OUTER)
    opt = DiLoCoOptimizer(
        inner,
        outer,
        sync_every=setting.sync_every,
        fragments=setting.fragments,
        fragment_sync_delay=setting.delay,
        compression=setting.compression,
    )
    launches: list[int] = []
    sent = [opt.bytes_sent]

    def on_step(index: int) -> None:  # host integers only: no device sync
        if opt.bytes_sent != sent[0]:
            launches.append(index + 1)
            sent[0] = opt.bytes_sent

    rank_times = _timed(ctx.bench, train_step(ctx, model, opt), warmup, steps, on_step)
    opt.state_dict()  # finishes the averaging in flight on every rank (outside the timed steps)
    kinds = step_kinds(launches, setting, warmup + steps, advance_midway=not ctx.bench.is_cuda)[warmup:]
    return Run(rank_times, kinds, opt.bytes_sent / opt.inner_steps)


def link_probe(bench: Bench, numel: int, repeats: int = 3) -> float:
    """Bytes per second one rank sends in an fp32 allreduce of ``numel`` values (ring count, best of ``repeats``)."""
    tensor = torch.ones(numel, dtype=torch.float32, device=bench.device)
    dist.all_reduce(tensor)  # warm-up (NCCL's connections)
    best = float("inf")
    for _ in range(repeats):
        bench.sync()
        bench.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        bench.sync()
        best = min(best, bench.slowest([time.perf_counter() - start])[0])
    return 2 * (bench.world - 1) * numel * 4 / bench.world / best


SLOWEST_RANK_KEYS = ("plain ms", "kinds", "worst kind", "sync/plain", "sync/plain 95%", "throughput ratio")


def slowest_rank_view(run: Run, baseline: Run) -> dict[str, Any]:
    """The summary of ``run`` on its slowest rank alone, its throughput against that rank's baseline.

    Example::

        >>> run = Run([[1.0, 1.0, 1.2], [1.0, 1.3, 1.0]], ["plain", "plain", "apply"])
        >>> view = slowest_rank_view(run, Run([[1.0], [1.0]], ["plain"]))
        >>> view["rank"], view["sync/plain"], view["throughput ratio"], view["run/own plain"]
        (1, 0.8696, 1.1, 0.9565)
    """
    rank = run.slowest_rank
    own = summarize(run.rank_times_s[rank], run.kinds, statistics.median(baseline.rank_times_s[rank]))
    view = {"rank": rank, **{key: own[key] for key in SLOWEST_RANK_KEYS if key in own}}
    if own["plain ms"]:  # what the syncs add over this run's own plain steps (immune to drift between runs)
        view["run/own plain"] = round(own["total ms"] / (own["steps"] * own["plain ms"]), 4)
    return view


def least_waiting_view(run: Run) -> dict[str, Any]:
    """Each step on the rank that waited least: its time over that rank's plain median, the minimum over ranks.

    At a sync the rank that launches it last never waits for a peer, so the minimum leaves out
    the straggler's wait and keeps what the sync itself costs. Plain steps go through the same
    minimum, so the ratio of medians carries no bias from taking it.

    Example::

        >>> run = Run([[1.0, 1.0, 1.5, 1.0], [1.0, 1.0, 1.1, 1.0]], ["plain", "plain", "apply", "plain"])
        >>> least_waiting_view(run)["sync/plain"]
        1.1
    """
    if "plain" not in run.kinds:  # every step syncs (tau fills the spacing H/F): nothing to compare with
        return {}
    plains = [
        statistics.median(t for t, kind in zip(times, run.kinds, strict=True) if kind == "plain")
        for times in run.rank_times_s
    ]
    least = [
        min(t / plain for t, plain in zip(step, plains, strict=True)) for step in zip(*run.rank_times_s, strict=True)
    ]
    own = summarize(least, run.kinds, None)
    return {key: own[key] for key in ("worst kind", "sync/plain", "sync/plain 95%") if key in own}


def _finish(
    result: dict[str, Any], run: Run, baseline: Run, setting: Setting, bytes_per_s: float, plain_s: float
) -> None:
    """Add the per-rank views, every rank's step times, the bytes and the transfer estimate of ``run``."""
    result["slowest rank view"] = slowest_rank_view(run, baseline)
    result["least waiting rank view"] = least_waiting_view(run)
    result["rank step ms"] = [[round(t * 1e3, 3) for t in times] for times in run.rank_times_s]
    result["rank totals ms"] = [round(t * 1e3, 3) for t in run.rank_totals_s]
    result["slowest rank"] = run.slowest_rank
    result["bytes/inner step"] = round(run.bytes_per_step)
    per_sync = run.bytes_per_step * setting.sync_every / setting.fragments  # one fragment's averaging
    result["bytes/fragment sync"] = round(per_sync)
    transfer_s = per_sync / bytes_per_s
    result["transfer ms (estimate)"] = round(transfer_s * 1e3, 3)
    result["transfer steps (estimate)"] = round(transfer_s / plain_s, 2)
    result["tau covers transfer (estimate)"] = setting.delay * plain_s >= transfer_s
    # Above 1 the link cannot carry the syncs as fast as the steps make them: no delay hides that.
    result["link load (estimate)"] = round(run.bytes_per_step / plain_s / bytes_per_s, 3)


# --------------------------------------------------------------------------------------------
# The command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.diloco_overlap", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--json", default="", help="write the results here (rank 0)")
    parser.add_argument(
        "--settings", nargs="+", default=list(DEFAULT_SETTINGS), help="F:tau[:compression[:H]] each, e.g. 4:4:int8"
    )
    parser.add_argument("--sync-every", type=int, default=20, help="H of the settings that do not give one")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per setting (rounded up to whole H)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: one period H)")
    parser.add_argument("--size", choices=["auto", *SIZE_TIERS], default="auto", help="auto: large-slow on GPUs")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"sequences per step (default: {GPU_BATCH} on GPUs, where steps are then GPU-bound; the size's on CPU)",
    )
    parser.add_argument(
        "--precision", choices=["auto", *PRECISIONS], default="auto", help="auto: bf16-autocast on GPUs, fp32 on CPU"
    )
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="auto: nccl on GPUs")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.sync_every < 1 or (args.warmup is not None and args.warmup < 0):
        parser.error("--steps and --sync-every must be at least 1, --warmup at least 0")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch: expected at least 1, got {args.batch}")
    try:
        args.settings = [parse_setting(text, args.sync_every) for text in args.settings]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # run from source
        return None


def metadata(bench: Bench, backend: str, size: str, precision: str, workload: Any) -> dict[str, Any]:
    """Where and how the run was measured."""
    nccl = torch.cuda.nccl.version() if backend == "nccl" else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(bench.device) if bench.is_cuda else "cpu",
        "world_size": bench.world,
        "backend": backend,
        "link": link_of(os.environ),
        "link_env": {key: os.environ.get(key) for key in LINK_ENV},
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "dcomm-averaging": _version("dcomm-averaging"),
        "workload": {"size": size, **workload.__dict__},
        "precision": precision,
        "inner": {"optimizer": "AdamW", "lr": INNER_LR},
        "outer": {"optimizer": "SGD", **OUTER},
        "method": (
            "per-step time on the training stream (CUDA events, no device sync in the loop; perf_counter on CPU), "
            "medians per step kind; 95% bootstrap of the worst kind's median over the plain median; top level: each "
            "step's maximum over the ranks (includes waiting for a slower rank); 'slowest rank view': the steps of the "
            "rank with the largest total, against its own baseline (the goal's figure)"
        ),
    }


def plan_lines(settings: list[Setting]) -> list[str]:
    """One line per setting: H, F, tau, the spacing H/F and whether tau < H (DiLoCo's requirement)."""
    lines = []
    for s in settings:
        if s.problem():
            lines.append(f"  {s.label}: SKIPPED: {s.problem()}")
            continue
        shared = f"; tau > H/F: up to {-(-s.delay // s.spacing):g} syncs in flight" if s.delay > s.spacing else ""
        lines.append(f"  {s.label}: a fragment every H/F = {s.spacing:g} steps, tau < H{shared}")
    return lines


def result_line(label: str, result: dict[str, Any]) -> str:
    if "error" in result:
        return f"  {label}: {result['error']}"
    kinds = ", ".join(f"{k} {v['median ms']:.2f}" for k, v in result["kinds"].items())
    plain = result["plain ms"]
    parts = [f"plain {plain:.2f} ms" if plain is not None else "no plain step"] + ([kinds] if kinds else [])
    if "sync/plain" in result:
        low, high = result["sync/plain 95%"]
        parts.append(f"worst/plain {result['sync/plain']:.3f} [{low:.3f}, {high:.3f}] ({result['worst kind']})")
    if "throughput ratio" in result:
        parts.append(f"run/baseline {result['throughput ratio']:.3f}")
    least = result.get("least waiting rank view", {})
    if "sync/plain" in least:
        low, high = least["sync/plain 95%"]
        parts.append(f"least waiting: {least['sync/plain']:.3f} [{low:.3f}, {high:.3f}] ({least['worst kind']})")
    view = result.get("slowest rank view", {})
    if "sync/plain" in view:
        low, high = view["sync/plain 95%"]
        parts.append(
            f"slowest rank {view['rank']}: worst/plain {view['sync/plain']:.3f} [{low:.3f}, {high:.3f}] "
            f"({view['worst kind']}), run/baseline {view['throughput ratio']:.3f}, "
            f"run/own plain {view['run/own plain']:.3f}"
        )
    if "bytes/inner step" in result:
        parts.append(f"{result['bytes/inner step'] / 2**20:.3f} MiB/step")
    if "transfer steps (estimate)" in result:
        parts.append(f"transfer ~{result['transfer steps (estimate)']:.1f} steps")
        parts.append(f"link load ~{result['link load (estimate)']:.2f}")
    return f"  {label}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    backend = init_rank(args.backend, args.timeout_s)
    bench = Bench.create(timeout_s=args.timeout_s)
    if bench.world < 2:
        dist.destroy_process_group()
        print("diloco_overlap: a group of one sends nothing, so no sync step shows; run 2 or more ranks")
        return 2
    size = args.size if args.size != "auto" else ("large-slow" if bench.is_cuda else "small")
    precision = args.precision if args.precision != "auto" else ("bf16-autocast" if bench.is_cuda else "fp32")
    set_tf32(precision != "fp32")
    batch = args.batch if args.batch is not None else (GPU_BATCH if bench.is_cuda else None)
    workload = WORKLOADS["transformer"][size]
    if batch is not None:
        workload = dataclasses.replace(workload, batch=batch)
    ctx = Context(bench, workload, precision)
    meta = metadata(bench, backend, size, precision, workload)
    say = print if bench.rank == 0 else (lambda *a, **k: None)
    say(f"[diloco-overlap] {meta['device']} x{bench.world} {backend} link={meta['link']} {size} {precision}")
    say("\n".join(plan_lines(args.settings)), flush=True)

    runnable = [s for s in args.settings if not s.problem()]
    longest = max([s.sync_every for s in runnable], default=args.sync_every)
    baseline_warmup = longest if args.warmup is None else args.warmup
    base_steps = steps_per_block(args.steps, longest)
    before = run_baseline(ctx, baseline_warmup, base_steps)
    plain_s = statistics.median(before.times_s)
    bytes_per_s = link_probe(bench, max(ctx.workload.parameters // 4, 1))
    meta["link probe GB/s (ring bytes sent per rank)"] = round(bytes_per_s / 1e9, 3)
    results: dict[str, dict[str, Any]] = {}
    for setting in args.settings:
        if setting.problem():
            results[setting.label] = {"error": f"skipped: {setting.problem()}"}
            continue
        steps = steps_per_block(args.steps, setting.sync_every)
        warmup = setting.sync_every if args.warmup is None else args.warmup
        error, run = "", None
        try:
            run = run_setting(ctx, setting, warmup, steps)
        except Exception as exc:  # reported as this setting's result
            error = short_error(exc)
        error = bench.agree(error)
        if error or run is None:
            results[setting.label] = {"error": f"error: {error}"}
        else:
            results[setting.label] = {"setting": setting.__dict__, **summarize(run.times_s, run.kinds, plain_s)}
            _finish(results[setting.label], run, before, setting, bytes_per_s, plain_s)
        release_memory()
        say(result_line(setting.label, results[setting.label]), flush=True)
    after = run_baseline(ctx, baseline_warmup, base_steps)
    meta["baseline"] = {
        "before": summarize(before.times_s, before.kinds, plain_s),
        "after": summarize(after.times_s, after.kinds, plain_s),
        "drift (after/before)": round(statistics.median(after.times_s) / plain_s, 4),
    }
    say(result_line("baseline after", meta["baseline"]["after"]))
    meta["results"] = results
    meta["seconds"] = round(time.perf_counter() - started, 2)
    if bench.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=2)
    say(f"[diloco-overlap] {meta['seconds']}s" + (f", wrote {args.json}" if args.json else ""), flush=True)
    bench.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
