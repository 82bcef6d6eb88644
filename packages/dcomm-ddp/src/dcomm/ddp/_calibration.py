"""Choosing between two ways to run a backward pass by timing both, the same choice on every rank.

Some choices depend on the machine more than on the model, such as whether int8 codes on the wire
save more time than quantizing costs. :class:`Calibration` times a few whole iterations of each
of two paths right after DDP has settled its buckets, in blocks (first, second, second, first: a
drift over the calibration, such as a warming clock or a growing allocator, weighs on both paths
alike), and every rank takes the decision from the same numbers: each path's slowest-rank time,
from a MAX all-reduce.

Blocks, not alternation: a path may leave work to the next iteration (collectives waited for in
the next forward, say), and an interval that starts in one path and ends in the other charges
that work to the wrong one.

Example::

    >>> calibration = Calibration(group, ("bf16", "int8"), choose=faster, report=log_choice)  # doctest: +SKIP
    >>> path = calibration.next_path(torch.device("cuda"))  # at the start of every backward pass  # doctest: +SKIP
    >>> calibration.chosen  # None until the last block has been timed  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Calibration", "agree"]


def agree(
    times: dict[str, float],
    group: dist.ProcessGroup,
    device: torch.device,
    choose: Callable[[dict[str, float]], str],
    report: Callable[[str, dict[str, float]], None] | None = None,
) -> str:
    """``choose`` applied to each path's slowest-rank time, so that every rank of ``group`` gets one answer.

    ``times`` maps each path to this rank's time of one iteration (seconds). ``report(chosen,
    slowest)`` runs on the group's first rank only (to log the choice once).

    Example::

        >>> agree({"a": 1.0, "b": 2.0}, group, device, choose=lambda t: min(t, key=t.get))  # doctest: +SKIP
        'a'
    """
    paths = list(times)
    local = torch.tensor([times[path] for path in paths], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    slowest = dict(zip(paths, local.tolist(), strict=True))
    chosen = choose(slowest)
    if report is not None and dist.get_rank(group) == 0:
        report(chosen, slowest)
    return chosen


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
    """Times two paths in blocks of whole iterations, then holds the path :func:`agree` chose.

    Call :meth:`next_path` at the same point of every backward pass once DDP has settled its
    buckets (at its start, or at its end for the pass after it): the next ``4 * (warmup + steps +
    1)`` passes run the paths in blocks of ``warmup + steps + 1`` (first, second, second, first),
    and each interval between two calls within a block is timed (a CUDA event on the current
    stream, or ``clock``, default ``time.perf_counter``, off CUDA): a whole steady-state
    iteration of that path. The first
    ``warmup`` intervals of each block are dropped; the medians of the rest go to :func:`agree`
    with ``choose`` and ``report``. ``clock`` exists so that tests can choose the times.

    Example::

        >>> calibration = Calibration(dist.group.WORLD, ("bf16", "int8"), choose=min_time)  # doctest: +SKIP
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        paths: tuple[str, str],
        choose: Callable[[dict[str, float]], str],
        report: Callable[[str, dict[str, float]], None] | None = None,
        *,
        steps: int = 2,
        warmup: int = 1,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.group = group
        self.paths = paths
        self.choose = choose
        self.report = report
        self.clock = clock
        self.blocks = (paths[0], paths[1], paths[1], paths[0])
        self.block = warmup + steps + 1  # passes per block
        self.schedule = [path for path in self.blocks for _ in range(self.block)]
        self.warmup = warmup
        self.marks: list[_Mark] = []
        self.chosen: str | None = None

    def __len__(self) -> int:
        """Backward passes timed before the choice (it is made at the start of the next one)."""
        return len(self.schedule)

    def next_path(self, device: torch.device) -> str:
        """The path for the next backward pass (the chosen one once calibrated)."""
        if self.chosen is not None:
            return self.chosen
        self.marks.append(_Mark(device, self.clock))
        done = len(self.marks) - 1  # timed backward passes, each ended by the mark after it
        if done < len(self.schedule):
            return self.schedule[done]
        samples: dict[str, list[float]] = {path: [] for path in self.paths}
        for number, path in enumerate(self.blocks):
            first = number * self.block  # an iteration of one path, start to start, within the block
            intervals = [self.marks[i].until(self.marks[i + 1]) for i in range(first, first + self.block - 1)]
            samples[path] += intervals[self.warmup :]
        times = {path: statistics.median(values) for path, values in samples.items()}
        self.chosen = agree(times, self.group, device, self.choose, self.report)
        self.marks.clear()
        return self.chosen
