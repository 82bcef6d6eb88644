"""This rank's side of a measurement: its device, the gloo group the ranks agree over, the clock.

Example::

    >>> bench = Bench.create(deadline=time.perf_counter() + 300)  # doctest: +SKIP
    >>> bench.sync(); bench.slowest([0.012, 0.030])  # the same list on every rank  # doctest: +SKIP
    [0.013, 0.031]
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tools.launch import agree_on_error, side_group

__all__ = ["Bench", "Step", "release_memory"]

Step = Callable[[], object]
"""One training or communication step; a float it returns is its own time in seconds."""


def release_memory() -> None:
    """Drop unreachable objects and give cached device memory back between cases."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class Bench:
    """This rank's device and side group, and the run's deadline (rank 0's clock decides)."""

    device: torch.device
    side_group: dist.ProcessGroup
    deadline: float = math.inf
    """``time.perf_counter()`` on rank 0 after which the remaining cases are skipped."""

    @classmethod
    def create(cls, deadline: float = math.inf, timeout_s: float = 300.0) -> Bench:
        """Build the bench for an initialized process group (call on every rank)."""
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(device=device, side_group=side_group(timeout_s), deadline=deadline)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def world(self) -> int:
        return dist.get_world_size()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def sync(self) -> None:
        """Wait for this rank's device to finish its queued work."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        dist.barrier(group=self.side_group)

    def slowest(self, values: list[float]) -> list[float]:
        """The element-wise maximum of ``values`` over all ranks (same length on every rank)."""
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.side_group)
        return tensor.tolist()

    def out_of_time(self) -> bool:
        """Whether rank 0's clock has passed the deadline (the same answer on every rank)."""
        verdict = [time.perf_counter() > self.deadline]
        dist.broadcast_object_list(verdict, src=0, group=self.side_group)
        return bool(verdict[0])

    def agree(self, error: str) -> str:
        """The first error any rank reported (with its rank), or '' when all succeeded."""
        return agree_on_error(error, self.side_group)

    def memory_mark(self) -> int:
        """Start measuring peak memory: returns the allocated bytes now (0 on CPU)."""
        if not self.is_cuda:
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_extra(self, mark: int) -> int | None:
        """Peak allocated bytes above ``mark`` since :meth:`memory_mark` (None on CPU)."""
        if not self.is_cuda:
            return None
        return max(0, torch.cuda.max_memory_allocated(self.device) - mark)
