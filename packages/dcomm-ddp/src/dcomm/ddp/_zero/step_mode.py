"""When the ZeRO overlap hooks step the local optimizer: per bucket, once per backward, or timed.

``"per_bucket"`` steps each bucket's parameters as soon as its gradient is averaged (the update
overlaps the rest of backward); ``"fused"`` runs one ``optim.step()`` over all of this rank's
parameters at the last bucket, then sends them out back to back. Both give the parameters of a
non-overlapped ``ZeroRedundancyOptimizer``. ``"auto"`` lets :class:`Calibration` time a few
iterations of each, in blocks per path, once DDP has settled its buckets, agree on one path on
every rank, and log the choice once.

Example::

    >>> calibration = Calibration(group)  # doctest: +SKIP
    >>> mode = calibration.next_mode(settled=True, device=torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

StepMode = Literal["auto", "per_bucket", "fused"]
STEP_MODES: tuple[str, ...] = ("auto", "per_bucket", "fused")
PATHS: tuple[str, ...] = ("per_bucket", "fused")  # what "auto" chooses between
BLOCKS: tuple[str, ...] = ("per_bucket", "fused", "fused", "per_bucket")  # a drift weighs on both paths alike
PER_BUCKET_MARGIN = 0.98
"""The per-bucket path is chosen only where it is at least 2% faster: it makes one optimizer call
per bucket, and its gain, where there is one, is larger than that."""

logger = logging.getLogger("dcomm.ddp.zero_overlap")


def check_step_mode(step_mode: object) -> str:
    if not isinstance(step_mode, str) or step_mode not in STEP_MODES:
        raise ValueError(
            f"step_mode: expected one of {list(STEP_MODES)}, got {step_mode!r}; pass e.g. step_mode='auto'"
        )
    return step_mode


def agree(times: dict[str, float], group: dist.ProcessGroup, device: torch.device) -> str:
    """The path with the smaller slowest-rank time; every rank of ``group`` gets the same answer.

    ``times`` maps each of :data:`PATHS` to this rank's time of one step. A MAX all-reduce makes
    every rank compare the same two numbers, so they all choose the same path; the per-bucket
    path must be faster by :data:`PER_BUCKET_MARGIN`.
    """
    local = torch.tensor([times[path] for path in PATHS], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    slowest = dict(zip(PATHS, local.tolist(), strict=True))
    chosen = "per_bucket" if slowest["per_bucket"] < PER_BUCKET_MARGIN * slowest["fused"] else "fused"
    if dist.get_rank(group) == 0:
        logger.info(
            "ZeRO overlap: step_mode='auto' chose %r (per step, slowest rank: per_bucket %.3f ms, fused %.3f ms)",
            chosen,
            slowest["per_bucket"] * 1e3,
            slowest["fused"] * 1e3,
        )
    return chosen


def log_fixed_choice(group: dist.ProcessGroup, interleaved: bool) -> None:
    """Say once, on the group's first rank, that ``"auto"`` is ``"fused"`` without timing."""
    if dist.get_rank(group) == 0:
        builder = "hook_with_zero_step_interleaved" if interleaved else "hook_with_zero_step"
        logger.info(
            "ZeRO overlap: step_mode='auto' chose 'fused' without timing: the per-bucket path of %s with "
            "reduce_scatter=False updates every bucket at the last one too, with one optimizer call per bucket",
            builder,
        )


class _Mark:
    """A point in time: a CUDA event on the current stream, or the host clock."""

    def __init__(self, device: torch.device, clock: Callable[[], float] | None) -> None:
        self.event: Any = None
        self.seconds = 0.0
        if clock is None and device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record(torch.cuda.current_stream(device))
        else:
            self.seconds = (clock or time.perf_counter)()

    def until(self, later: _Mark) -> float:
        if self.event is not None:
            later.event.synchronize()
            return self.event.elapsed_time(later.event) / 1e3
        return later.seconds - self.seconds


class Calibration:
    """Chooses a step path by timing the backward passes right after DDP settled its buckets.

    :meth:`next_mode` is called at the start of every backward pass. Once ``settled``, the next
    ``4 * (warmup + steps + 1)`` backward passes run the paths in blocks of that length, in the
    order of :data:`BLOCKS` (per-bucket, fused, fused, per-bucket: a drift over the calibration,
    such as a warming clock or a growing allocator, weighs on both paths alike), and each interval
    between the starts of two passes of one block is timed (a CUDA event on the current stream,
    or ``clock``, default ``time.perf_counter``, off CUDA): a whole steady-state iteration of
    that path. Blocks, not alternation: the per-bucket path leaves its parameter collectives to
    the next forward and the fused one does its work at the end of backward, so an interval that
    starts in one path and ends in the other charges one path's work to the other (alternating
    chose the per-bucket path at 1.13x the fused one's step on 4x H100). The first ``warmup``
    intervals of each block are dropped, the median of the rest of both blocks goes to
    :func:`agree`, and the choice holds from then on. Before DDP settled, the per-bucket path
    runs untimed. ``clock`` exists so that tests can choose the times.

    Example::

        >>> calibration = Calibration(dist.group.WORLD, steps=2)  # doctest: +SKIP
    """

    def __init__(
        self, group: dist.ProcessGroup, steps: int = 2, warmup: int = 1, clock: Callable[[], float] | None = None
    ) -> None:
        self.group = group
        self.clock = clock
        self.block = warmup + steps + 1  # passes per block
        self.schedule = [path for path in BLOCKS for _ in range(self.block)]
        self.warmup = warmup
        self.marks: list[_Mark] = []
        self.chosen: str | None = None

    def next_mode(self, settled: bool, device: torch.device) -> str:
        """The path for the backward pass starting now."""
        if self.chosen is not None:
            return self.chosen
        if not settled:
            return "per_bucket"
        self.marks.append(_Mark(device, self.clock))
        done = len(self.marks) - 1  # timed backward passes, each ended by the mark after it
        if done < len(self.schedule):
            return self.schedule[done]
        samples: dict[str, list[float]] = {path: [] for path in PATHS}
        for number, path in enumerate(BLOCKS):
            first = number * self.block  # an iteration of one path, start to start, within the block
            intervals = [self.marks[i].until(self.marks[i + 1]) for i in range(first, first + self.block - 1)]
            samples[path] += intervals[self.warmup :]
        times = {path: statistics.median(values) for path, values in samples.items()}
        self.chosen = agree(times, self.group, device)
        self.marks.clear()
        return self.chosen
