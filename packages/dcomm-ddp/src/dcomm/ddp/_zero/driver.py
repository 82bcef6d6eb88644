"""What every ZeRO overlap driver does per DDP bucket, whatever it owns.

A driver is the state behind one wrapped hook. The base class runs the first-call checks, keeps
the CUDA side stream, queues each bucket until it is updated (at once, or behind the next bucket
with the interleaved hook), runs the local optimizer on a subset of its parameters, and waits for
the parameter collectives before the next forward. :class:`ParameterDriver` and
:class:`ShardedDriver` say what a bucket's update is.

Example::

    >>> class MyDriver(Driver):  # doctest: +SKIP
    ...     def launch(self, state, bucket): ...
    ...     def complete(self, item): ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import dcomm.ddp._torch_private as private
from dcomm.ddp._zero.layout import partition

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
Checks = Callable[[Any], None]


def optimizer_class(zero: ZeroRedundancyOptimizer) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class of ``zero``'s (functional) overlap optimizer."""
    constructor = private.optim_constructor(zero)
    table = private.functional_optimizers()
    for cls, functional in table.items():
        if constructor is functional or constructor is cls:
            return cls
    raise ValueError(
        f"zero: optimizer {constructor!r} has no torch.optim equivalent; use one of {sorted(c.__name__ for c in table)}"
    )


def averaged_bucket(value: object, numel: int) -> torch.Tensor:
    """The flat averaged bucket that a wrapped DDP hook's future gave, checked for its size."""
    if isinstance(value, (list, tuple)):
        value = value[0] if len(value) == 1 else None
    if not isinstance(value, torch.Tensor) or value.numel() != numel:
        got = type(value).__name__ if not isinstance(value, torch.Tensor) else f"{value.numel()} elements"
        raise RuntimeError(
            f"hook: the wrapped hook's future gave {got}, expected a tensor of the bucket's {numel} elements; "
            "wrap a hook that returns the averaged bucket (allreduce_hook, fp16_compress_hook, bf16_compress_hook)"
        )
    return value.reshape(-1)


def all_gather(output: torch.Tensor, piece: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Asynchronous ``all_gather_into_tensor`` (``all_gather_single`` from torch 2.13 on)."""
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(output, piece, group=group, async_op=True)


@dataclass(frozen=True)
class Setup:
    """What every driver is built from."""

    hook: Hook  # the wrapped DDP hook
    ddp: DistributedDataParallel
    zero: ZeroRedundancyOptimizer
    buckets: list[list[torch.Tensor]]  # DDP's expected settled buckets
    interleaved: bool  # update each bucket behind the next one, or all after the last
    first_call_checks: Checks


class Driver:
    """Per-(ddp, zero) state shared by every call of one wrapped hook.

    Subclasses implement :meth:`launch` (communicate one bucket's gradient; return an item with
    a ``fut`` attribute, the future DDP gets) and :meth:`complete` (update the bucket's
    parameters and send them out).
    """

    def __init__(self, setup: Setup, shard_buckets: bool) -> None:
        self.hook = setup.hook
        self.ddp = setup.ddp
        self.zero = zero = setup.zero
        self.group: dist.ProcessGroup = zero.process_group
        self.rank: int = zero.rank
        self.world: int = zero.world_size
        self.interleaved = setup.interleaved
        self.first_call_checks: Checks | None = setup.first_call_checks
        self.plans: dict[int, Any] = {}
        self.pending: list[Any] = []
        self.works: list[Any] = []
        self.stream: Any = None
        self.fallbacks = 0  # buckets allreduced instead of reduce-scattered once DDP settled
        # Fix every parameter's owner now, for good: the step can then run from iteration 1.
        private.clear_cache(zero)
        owners = partition(setup.buckets, self.world, shard_buckets)
        self.local_groups = private.partition_parameters(zero, owners)[self.rank]

    # -- what subclasses define -------------------------------------------------------------------

    def launch(self, state: Any, bucket: dist.GradBucket) -> Any:
        raise NotImplementedError

    def complete(self, item: Any) -> None:
        raise NotImplementedError

    def start_backward(self) -> None:
        """Called on the first bucket of every backward."""

    def end_backward(self) -> None:
        """Called on the last bucket of every backward, before :meth:`finish`."""

    # -- shared machinery ----------------------------------------------------------------------

    def cached_plan(self, bucket: dist.GradBucket) -> tuple[Any, tuple[int, ...]]:
        """The plan made for this bucket index if DDP still has the same parameters in it, and the key."""
        key = tuple(id(p) for p in bucket.parameters())
        plan = self.plans.get(bucket.index())
        return (plan if plan is not None and plan.key == key else None), key

    def in_stream(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the side stream (after the work queued so far), or directly off CUDA."""
        stream = self.stream
        if stream is None:
            fn()
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            fn()

    def local_step(self, params: list[torch.Tensor]) -> None:
        """Step the local optimizer on ``params`` only (their ``.grad`` set by the caller)."""
        zero = self.zero
        optim = zero.optim
        private.sync_param_groups(zero, zero.param_groups, optim.param_groups)
        group = optim.param_groups[0]
        everything = group["params"]
        try:
            group["params"] = params
            optim.step()
        finally:
            group["params"] = everything
        private.sync_param_groups(zero, optim.param_groups, zero.param_groups)

    def finish(self) -> None:
        """Make the next forward see every updated parameter (a stream wait on CUDA)."""
        works, self.works = self.works, []
        for work in works:
            work.wait()

    def reset(self) -> None:
        """Drop what an interrupted backward left behind."""
        self.pending.clear()
        self.finish()

    # -- the hook -----------------------------------------------------------------------------------

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.first_call_checks is not None:
            checks, self.first_call_checks = self.first_call_checks, None
            checks(state)
        index = bucket.index()
        if index == 0:
            if self.pending or self.works:
                self.reset()
            self.start_backward()
        buffer = bucket.buffer()
        if self.stream is None and buffer.is_cuda:
            self.stream = torch.cuda.Stream(device=buffer.device)
        item = self.launch(state, bucket)
        self.pending.append(item)
        last = bucket.is_last()
        if self.interleaved:
            # Update the previous bucket now: its step and parameter collective queue behind
            # this bucket's gradient collective, so the two pipeline instead of serializing.
            while len(self.pending) > (0 if last else 1):
                self.complete(self.pending.pop(0))
        elif last:
            for queued in self.pending:
                self.complete(queued)
            self.pending.clear()
        if last:
            for stale in [i for i in self.plans if i > index]:
                del self.plans[stale]
            self.end_backward()
            self.finish()
        return item.fut
