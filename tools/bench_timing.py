"""Measuring one benchmark variant on every rank: step time, peak extra memory, agreed errors.

``tools/bench.py`` builds a :class:`Bench` once per run; each case in ``tools/bench_cases.py``
calls :meth:`Bench.run` with a function that builds its model and returns a step closure. The
step is warmed up, then timed sample by sample (device synchronized around each sample, so
CUDA's asynchrony never hides work), and peak device memory above the level at the start of the
timed loop is recorded. Every rank agrees on the outcome over a gloo side group, so a variant
that raises on one rank is reported as an error on all of them and the run goes on.

Example::

    >>> bench = Bench.create(warmup=2, iters=10, cap_s=3.0)  # doctest: +SKIP
    >>> result = bench.run(lambda: (lambda: dist.all_reduce(flat)))  # doctest: +SKIP
    >>> result.median_s  # doctest: +SKIP
    0.0047
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Bench", "Failure", "Measurement", "Outcome", "Step", "release_memory"]

Step = Callable[[], object]
"""One training or communication step; its return value is ignored."""


@dataclass
class Measurement:
    """Seconds per step of each timed sample, and the peak extra device memory (None on CPU)."""

    samples_s: list[float]
    peak_extra_bytes: int | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    def to_json(self) -> dict[str, object]:
        return {
            "median_ms": round(self.median_s * 1e3, 4),
            "samples_ms": [round(s * 1e3, 4) for s in self.samples_s],
            "peak_extra_bytes": self.peak_extra_bytes,
        }


@dataclass
class Failure:
    """A variant that raised on at least one rank (or was skipped); ``reason`` says why."""

    reason: str

    def to_json(self) -> dict[str, object]:
        return {"error": self.reason}


Outcome = Measurement | Failure


def release_memory() -> None:
    """Drop unreachable objects and give cached device memory back between variants."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _short_error(exc: BaseException) -> str:
    """The exception's type and first message line, plus where in our code it came from."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:160]
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for frame in reversed(frames):
        if "/dcomm/" in frame.filename or "/tools/" in frame.filename:
            where = f" [{os.path.basename(frame.filename)}:{frame.lineno}]"
            break
    return f"{type(exc).__name__}: {first_line}{where}"


@dataclass
class Bench:
    """This rank's device, the side group used to agree, and the iteration policy."""

    device: torch.device
    side_group: dist.ProcessGroup
    warmup: int
    iters: int
    cap_s: float
    min_iters: int = 3
    deadline: float = math.inf
    """``time.perf_counter()`` on rank 0 after which variants are skipped, not run."""

    @classmethod
    def create(cls, warmup: int, iters: int, cap_s: float) -> Bench:
        """Build the bench for an initialized process group (call on every rank)."""
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        side_group = dist.new_group(backend="gloo")
        return cls(device=device, side_group=side_group, warmup=warmup, iters=iters, cap_s=cap_s)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def world(self) -> int:
        return dist.get_world_size()

    def sync(self) -> None:
        """Wait for this rank's device to finish its queued work."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def _time_sample(self, step: Step, steps_per_sample: int) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(steps_per_sample):
            step()
        self.sync()
        return (time.perf_counter() - start) / steps_per_sample

    def _agreed_iters(self, first_sample_s: float, steps_per_sample: int) -> int:
        """How many samples fit in ``cap_s``, from the slowest rank's first sample (same on all)."""
        slowest = torch.tensor([first_sample_s * steps_per_sample], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.side_group)
        fitting = int(self.cap_s / max(slowest.item(), 1e-9))
        return max(self.min_iters, min(self.iters, fitting))

    def measure(self, step: Step, steps_per_sample: int = 1, warmup: int | None = None) -> Measurement:
        """Warm ``step`` up, then time samples of ``steps_per_sample`` steps each."""
        for _ in range((self.warmup if warmup is None else warmup) * steps_per_sample):
            step()
        self.sync()
        baseline = 0
        if self.is_cuda:
            baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        samples = [self._time_sample(step, steps_per_sample)]
        for _ in range(self._agreed_iters(samples[0], steps_per_sample) - 1):
            samples.append(self._time_sample(step, steps_per_sample))
        peak = None
        if self.is_cuda:
            peak = max(0, torch.cuda.max_memory_allocated(self.device) - baseline)
        return Measurement(samples, peak)

    def out_of_time(self) -> bool:
        """Rank 0's clock decides for every rank whether the time budget is spent."""
        verdict = [time.perf_counter() > self.deadline]
        dist.broadcast_object_list(verdict, src=0, group=self.side_group)
        return bool(verdict[0])

    def agree(self, error: str) -> str:
        """The first error any rank reported (with its rank), or '' when all succeeded."""
        errors: list[str] = [""] * self.world
        dist.all_gather_object(errors, error, group=self.side_group)
        for rank, message in enumerate(errors):
            if message:
                return f"{message} (rank {rank})"
        return ""

    def run(self, build: Callable[[], Step], steps_per_sample: int = 1, warmup: int | None = None) -> Outcome:
        """Build a step with ``build()``, measure it; any exception becomes a :class:`Failure`.

        ``build`` holds the imports of the implementation under test, so a missing dcomm piece
        is reported like any other error. Memory the step holds is released afterwards. Once
        the deadline has passed the variant is skipped.
        """
        if self.out_of_time():
            return Failure("skipped: the benchmark's time budget was spent")
        error = ""
        result: Measurement | None = None
        try:
            step = build()
            result = self.measure(step, steps_per_sample, warmup)
            del step
        except Exception as exc:  # any failure of the code under test is a result
            error = _short_error(exc)
        release_memory()
        agreed = self.agree(error)
        if agreed or result is None:
            return Failure(f"error: {agreed or error}")
        return result
