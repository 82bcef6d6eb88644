"""ZeRO overlap with element-wise shards: the ``reduce_scatter=True`` path.

Every expected DDP bucket is a flat buffer cut into ``world`` equal slices (see
:func:`dcomm.ddp._zero.layout.pack_shards`); rank ``r``'s local optimizer steps slice ``r`` of
every shard. Per shard and step: one reduce-scatter of ``gradient / world`` (in the wrapped
hook's dtype), the step, one all-gather of the updated slices into the flat buffer.

DDP's real buckets need not be the planned ones: DDP settles its buckets in the order gradients
became ready in the first iteration, which the plan cannot know (a Linear's weight gradient may
come before its bias, so every bucket boundary moves). Each real bucket is therefore cut into
*pieces*, one per shard it touches; a piece's runs of parameters are divided into the shard's
send buffer (one kernel for a whole shard, a foreach copy otherwise), and a shard is
reduce-scattered as soon as its last parameter has arrived, whichever real bucket brought it. No
bucket is ever allreduced for ZeRO's sake. Only a real bucket that also holds parameters the
``ZeroRedundancyOptimizer`` does not update is, in addition, averaged by the wrapped hook (so
that those parameters get averaged gradients); after DDP has settled such a bucket warns once
and is counted in ``fallbacks`` (see :func:`dcomm.ddp.fallback_count`).

Once DDP has settled its buckets, with ``hook_with_zero_step``, a C++ hook on DDP's reducer takes over (see
:mod:`dcomm.ddp.native_hooks`): given the pieces of every bucket, it divides them into the shards
and starts each shard's reduce-scatter itself, and calls :meth:`ShardedDriver.run_scattered` once
per backward pass, at the last bucket (no Python call per bucket).

``param.grad`` keeps this rank's local gradient (the averaged slice goes to the optimizer only),
so gradients accumulated over several backward passes reduce to exactly the sum that a
non-overlapped ZeRO steps with. With ``hook_with_zero_step`` the slices of every shard are stepped together
at the last bucket, and their all-gathers follow back to back (one NCCL group where torch
allows).

Example::

    >>> driver = ShardedDriver(Setup(allreduce_hook, ddp, zero, buckets, True, checks), None)  # doctest: +SKIP
    >>> ddp.register_comm_hook(None, driver)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import dcomm.ddp._torch_private as private
from dcomm.core import (
    completed_future,
    divide_into,
    foreach_copy_,
    foreach_div_,
    start_reduce_scatter,
    warn_once,
)
from dcomm.ddp._zero.driver import Driver, Setup, all_gather, all_gathers, optimizer_class
from dcomm.ddp._zero.layout import Shard, pack_shards


@dataclass
class _Piece:
    """The parameters of one real DDP bucket that belong to one shard."""

    shard: Shard
    count: int  # parameters
    runs: list[tuple[int, int, int]]  # (bucket offset, flat offset, numel), contiguous in both
    # (address of DDP's bucket buffer, its run views, ``shard.send``'s run views), made once
    views: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None


@dataclass
class _Plan:
    """How one real DDP bucket reaches the shards: its pieces, and whether ZeRO owns all of it."""

    key: tuple[int, ...]
    pieces: list[_Piece] = field(default_factory=list)
    covered: bool = True  # every parameter is updated by ZeRO (else the wrapped hook averages too)


@dataclass
class _Pending:
    plan: _Plan
    fut: torch.futures.Future  # what DDP gets
    ready: list[Shard]  # shards whose whole gradient has arrived with this bucket
    scattered: list[dist.Work]  # their reduce-scatters, in the same order
    stepped: bool = False


class ShardedDriver(Driver):
    """Per-(ddp, zero) state of a ``reduce_scatter=True`` overlap hook (element-wise sharding)."""

    def __init__(self, setup: Setup, reduce_dtype: torch.dtype | None) -> None:
        super().__init__(setup, False)
        zero = setup.zero
        builder = "hook_with_zero_step_interleaved" if setup.interleaved else "hook_with_zero_step"
        self.name = f"{builder}(reduce_scatter=True)"
        self.fast_buckets = 0  # over the last backward: buckets only reduce-scattered
        self.fallback_buckets = 0  # over the last backward: buckets also averaged by the wrapped hook
        self._counting = [0, 0]
        self.layout = pack_shards(setup.buckets, self.rank, self.world, reduce_dtype)
        self.shard_of = {id(p): (s, o) for s in self.layout for p, o in zip(s.params, s.offsets, strict=True)}
        zero.optim = optimizer_class(zero)([s.slice for s in self.layout], **private.optim_defaults(zero))
        private.sync_param_groups(zero, zero.optim.param_groups, zero.param_groups)

    def _gather(self, shards: list[Shard]) -> None:
        """All-gather the updated slices of ``shards`` into their flat buffers.

        Waited for at the end of backward; with ``gather_during_forward``, one all-gather per
        shard, first layers first, each waited for by the next forward of the modules it holds.
        """
        if self.forward_waits is None:
            self.works.extend(all_gathers([(shard.flat, shard.slice) for shard in shards], self.group))
            return
        for shard in sorted(shards, key=lambda shard: -shard.index):  # buckets hold the last layers first
            self.defer(shard.params, all_gather(shard.flat, shard.slice, self.group))

    # -- planning ---------------------------------------------------------------------------

    def make_plan(self, key: tuple[int, ...], params: list[torch.Tensor]) -> _Plan:
        plan = _Plan(key)
        by_shard: dict[int, _Piece] = {}
        offset = 0
        for p in params:
            found = self.shard_of.get(id(p))
            if found is None:
                plan.covered = False
            else:
                shard, flat_offset = found
                piece = by_shard.get(shard.index)
                if piece is None:
                    piece = by_shard[shard.index] = _Piece(shard, 0, [])
                    plan.pieces.append(piece)
                piece.count += 1
                runs = piece.runs
                if runs and runs[-1][0] + runs[-1][2] == offset and runs[-1][1] + runs[-1][2] == flat_offset:
                    src, dst, numel = runs[-1]
                    runs[-1] = (src, dst, numel + p.numel())
                else:
                    runs.append((offset, flat_offset, p.numel()))
            offset += p.numel()
        return plan

    # -- communication --------------------------------------------------------------------------

    def _divide_into_send(self, piece: _Piece, buffer: torch.Tensor) -> None:
        """``shard.send[run] = bucket[run] / world`` for each run of ``piece`` (the padding stays 0)."""
        send = piece.shard.send
        if len(piece.runs) == 1:
            # Copy, cast to the communication dtype and divide (one kernel from fp32).
            src, dst, numel = piece.runs[0]
            divide_into(send[dst : dst + numel], buffer[src : src + numel], self.world)
            return
        address = buffer.data_ptr()
        if piece.views is None or piece.views[0] != address:
            sources = [buffer[src : src + n] for src, _, n in piece.runs]
            targets = [send[dst : dst + n] for _, dst, n in piece.runs]
            # Views into DDP's persistent bucket buffer: keeping them holds no extra memory.
            piece.views = (address, sources, targets)
        _, sources, targets = piece.views
        if buffer.dtype == send.dtype:
            foreach_copy_(targets, sources)  # then the division in place: the same values as torch.div
            foreach_div_(targets, self.world)
        else:
            for source, target in zip(sources, targets, strict=True):
                divide_into(target, source, self.world)  # as the hooks do

    def _scatter(self, plan: _Plan, buffer: torch.Tensor) -> tuple[list[Shard], list[dist.Work]]:
        """Put the bucket's pieces into their shards; reduce-scatter each shard now complete."""
        ready, scattered = [], []
        for piece in plan.pieces:
            self._divide_into_send(piece, buffer)
            shard = piece.shard
            shard.seen += piece.count
            if shard.seen == len(shard.params):
                shard.seen = 0
                ready.append(shard)
                scattered.append(start_reduce_scatter(shard.recv, shard.send, self.group))
        return ready, scattered

    def _warn_uncovered(self, bucket: dist.GradBucket, plan: _Plan) -> None:
        if private.has_rebuilt_buckets(self.ddp):
            self.fallbacks += 1
            if self.fallbacks == 1:
                warn_once(
                    ("zero overlap fallback", id(self)),
                    f"{self.name}: DDP bucket {bucket.index()} ({len(plan.key)} parameters) holds parameters "
                    "that the ZeroRedundancyOptimizer does not update, so besides the reduce-scatter of its "
                    "ZeRO parameters it is allreduced by the wrapped hook (more traffic); fallback_count(hook) "
                    "counts such buckets",
                    RuntimeWarning,
                )

    # -- per-bucket work ----------------------------------------------------------------------

    def start_backward(self) -> None:
        self._counting = [0, 0]

    def launch(self, state: Any, bucket: dist.GradBucket) -> _Pending:
        plan = self.plan(bucket)
        buffer = bucket.buffer()
        ready, scattered = self._scatter(plan, buffer)
        if plan.covered:
            # DDP gets the bucket back unchanged: param.grad keeps the local gradient, so a gradient
            # accumulated over several backward passes still averages to plain ZeRO's.
            self._counting[0] += 1
            fut = completed_future(buffer)
        else:
            self._counting[1] += 1
            self._warn_uncovered(bucket, plan)
            fut = self.hook(state, bucket)
        item = _Pending(plan, fut, ready, scattered)
        if self.stream is not None and self.interleaved:
            # Queue this bucket's step now, behind its reduce-scatters: it runs on the side stream
            # while backward computes the next buckets (no CPU wait on NCCL).
            self.step(item)
        return item

    def step(self, item: _Pending) -> None:
        """Step the slices of the buckets ``item`` completes (on CUDA: queued on the side stream)."""
        if not item.stepped:
            item.stepped = True
            self.in_stream(lambda: self._step(item))

    def _step(self, item: _Pending) -> None:
        self._gather_grads(item)
        for shard in item.ready:
            self.local_step([shard.slice])

    def _gather_grads(self, item: _Pending) -> None:
        """Put the averaged gradient of this rank's slices into ``shard.grad`` for ``item``'s shards."""
        for shard, scattered in zip(item.ready, item.scattered, strict=True):
            # A stream wait on CUDA (the CPU does not block on NCCL), a real wait on gloo.
            scattered.wait()
            self._take_grad(shard)

    def _take_grad(self, shard: Shard) -> None:
        """``shard.grad`` from its reduce-scatter's result (already waited for)."""
        if shard.recv is not shard.grad:
            shard.grad.copy_(shard.recv)
        if self.stream is not None:
            shard.grad.record_stream(self.stream)

    def complete(self, item: _Pending) -> None:
        """Step (if not done yet) and all-gather the updated slices into the flat buffers."""
        self.step(item)

        self.in_stream(lambda: self._gather(item.ready))

    def complete_all(self, items: list[_Pending]) -> None:
        """``hook_with_zero_step``: one step over every slice, then all their all-gathers back to back."""

        def step_and_gather() -> None:
            for item in items:
                self._gather_grads(item)
            self._step_and_gather([shard for item in items for shard in item.ready])

        self.in_stream(step_and_gather)

    def _step_and_gather(self, shards: list[Shard]) -> None:
        """One step over the slices of ``shards`` (their ``grad`` set), then their all-gathers back to back."""
        if shards:
            self.local_step([shard.slice for shard in shards])
        self._gather(shards)

    def end_backward(self) -> None:
        self.fast_buckets, self.fallback_buckets = self._counting

    # -- run by DDP's reducer in C++ ------------------------------------------------------------

    def can_run_in_cpp(self) -> bool:
        return not self.interleaved  # the C++ hook steps at the last bucket only

    def register_in_cpp(self, extension: Any, reducer: Any, state: object, python_hook: Any) -> Any:
        return extension.register_scatter_hook(reducer, self.group, state, python_hook, self.run_scattered)

    def ready_for_cpp(self) -> bool:
        """Give the C++ hook every bucket's pieces; not where a bucket holds parameters ZeRO does not own.

        Such a bucket is also averaged by the wrapped hook, which stays in Python.
        """
        plans = [self.frozen[index] for index in range(self.bucket_count)]
        if not all(plan.covered for plan in plans):
            return False
        shards = [(shard.send, shard.recv, len(shard.params)) for shard in self.layout]
        buckets = [[(piece.shard.index, piece.count, piece.runs) for piece in plan.pieces] for plan in plans]
        self.native_switch.set_layout(shards, buckets)
        return True

    def run_scattered(self, indices: list[int]) -> None:
        """The fused step, called by the C++ hook at the last bucket with the shards it reduce-scattered.

        The C++ hook has ordered the side stream (CUDA) or the host after every reduce-scatter;
        ``indices`` are the shards in the order they were sent.
        """
        shards = [self.layout[index] for index in indices]
        self.begin_backward()
        self._counting = [self.bucket_count, 0]  # every bucket only reduce-scattered

        def step_and_gather() -> None:
            for shard in shards:
                self._take_grad(shard)
            self._step_and_gather(shards)

        self.in_stream(step_and_gather)
        self._backward_ended(self.bucket_count)

    def reset(self) -> None:
        super().reset()
        for shard in self.layout:
            shard.seen = 0
