"""ZeRO overlap with element-wise shards: the ``reduce_scatter=True`` path.

Every expected DDP bucket is a flat buffer cut into ``world`` equal slices (see
:func:`dcomm.ddp._zero.layout.pack_shards`); rank ``r``'s local optimizer steps slice ``r`` of
every bucket. Per bucket and step: one reduce-scatter of ``bucket / world`` (in the wrapped
hook's dtype), the step, one all-gather of the updated slices into the flat buffer.

A DDP bucket that holds exactly the parameters of one expected bucket in another order (a
LayerNorm's weight gradient is ready before its bias) is copied into the planned order before its
reduce-scatter (one foreach copy). Any other DDP bucket (the first iteration's single bucket, or a
layout DDP chose differently) falls back: the wrapped hook averages it (an allreduce) and each
rank copies out its slices. Slower, never wrong. After DDP has settled its buckets such a
fallback warns once and is counted in ``fallbacks`` (see :func:`dcomm.ddp.fallback_count`).

``param.grad`` keeps this rank's local gradient on the fast path (the averaged slice goes to the
optimizer only), so gradients accumulated over several backward passes reduce to exactly the
sum that a non-overlapped ZeRO steps with. On the fused path the slices of every bucket are
stepped together at the last bucket, and their all-gathers follow back to back (one NCCL group
where torch allows).

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
from dcomm.core import reduce_scatter_future, warn_once
from dcomm.ddp._zero import checkpoint
from dcomm.ddp._zero.driver import Driver, Setup, all_gather, all_gathers, averaged_bucket, optimizer_class
from dcomm.ddp._zero.layout import Shard, pack_shards


@dataclass
class _Plan:
    """How one real DDP bucket is handled: ``fast`` (exactly one expected bucket) or member copies."""

    key: tuple[int, ...]
    numel: int
    fast: Shard | None
    # fallback: (shard, bucket offset, flat offset, numel) of each ZeRO parameter in the bucket
    members: list[tuple[Shard, int, int, int]] = field(default_factory=list)
    # fast, in another order: (bucket offset, flat offset, numel) of runs contiguous in both
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    # (address of DDP's bucket buffer, its run views, ``fast.send``'s run views), made once
    run_views: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None


@dataclass
class _Pending:
    plan: _Plan
    fut: torch.futures.Future
    ready: list[Shard]  # shards whose whole gradient has arrived with this bucket
    stepped: bool = False


class ShardedDriver(Driver):
    """Per-(ddp, zero) state of a ``reduce_scatter=True`` overlap hook (element-wise sharding)."""

    def __init__(self, setup: Setup, reduce_dtype: torch.dtype | None) -> None:
        super().__init__(setup, False)
        zero = setup.zero
        builder = "hook_with_zero_step_interleaved" if setup.interleaved else "hook_with_zero_step"
        self.name = f"{builder}(reduce_scatter=True)"
        self.fast_buckets = 0  # over the last backward
        self.fallback_buckets = 0  # over the last backward, the first iterations' included
        self._counting = [0, 0]
        self.layout = pack_shards(setup.buckets, self.rank, self.world, reduce_dtype)
        self.where = {id(p): (s, o) for s in self.layout for p, o in zip(s.params, s.offsets, strict=True)}
        zero.optim = optimizer_class(zero)([s.slice for s in self.layout], **private.optim_defaults(zero))
        private.sync_param_groups(zero, zero.optim.param_groups, zero.param_groups)
        checkpoint.install(zero, self.layout)

    # -- planning ---------------------------------------------------------------------------

    def make_plan(self, key: tuple[int, ...], params: list[torch.Tensor]) -> _Plan:
        numel = sum(p.numel() for p in params)
        fast = self.where.get(key[0], (None, 0))[0] if key else None
        if fast is not None and fast.key == key:
            plan = _Plan(key, numel, fast)
        elif fast is not None and len(key) == len(fast.params) and set(key) == set(fast.key):
            plan = _Plan(key, numel, fast, runs=self._runs(params))
        else:
            plan = _Plan(key, numel, None)
            offset = 0
            for p in params:
                if id(p) in self.where:
                    shard, flat_offset = self.where[id(p)]
                    plan.members.append((shard, offset, flat_offset, p.numel()))
                offset += p.numel()
        return plan

    def _runs(self, params: list[torch.Tensor]) -> list[tuple[int, int, int]]:
        """Where each run of ``params`` (DDP's order) goes in its planned flat buffer."""
        runs: list[tuple[int, int, int]] = []
        offset = 0
        for p in params:
            flat_offset = self.where[id(p)][1]
            if runs and runs[-1][0] + runs[-1][2] == offset and runs[-1][1] + runs[-1][2] == flat_offset:
                src, dst, numel = runs[-1]
                runs[-1] = (src, dst, numel + p.numel())
            else:
                runs.append((offset, flat_offset, p.numel()))
            offset += p.numel()
        return runs

    # -- communication --------------------------------------------------------------------------

    def _divide_into_send(self, plan: _Plan, buffer: torch.Tensor) -> None:
        """``shard.send[:numel] = bucket / world`` in the planned order (the padding stays 0)."""
        shard = plan.fast
        assert shard is not None
        if not plan.runs:
            # Copy, cast to the communication dtype and divide: one kernel.
            torch.div(buffer, self.world, out=shard.send[: shard.numel])
            return
        address = buffer.data_ptr()
        if plan.run_views is None or plan.run_views[0] != address:
            sources = [buffer[src : src + n] for src, _, n in plan.runs]
            targets = [shard.send[dst : dst + n] for _, dst, n in plan.runs]
            # Views into DDP's persistent bucket buffer: keeping them holds no extra memory.
            plan.run_views = (address, sources, targets)
        _, sources, targets = plan.run_views
        copy = private.foreach_copy()
        if copy is not None and buffer.dtype == shard.send.dtype:
            copy(targets, sources)  # then the division in place: the same values as torch.div
            shard.send[: shard.numel].div_(self.world)
        else:
            for source, target in zip(sources, targets, strict=True):
                torch.div(source, self.world, out=target)  # divide before the cast, as the hooks do

    def _reduce_scatter(self, plan: _Plan, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Sum ``bucket / world`` onto the slices' owners (``shard.recv``); DDP keeps the local bucket."""
        shard = plan.fast
        assert shard is not None
        buffer = bucket.buffer()
        self._divide_into_send(plan, buffer)

        # DDP gets the bucket back unchanged: param.grad keeps the local gradient, so a gradient
        # accumulated over several backward passes still averages to plain ZeRO's.
        def local_bucket(done: torch.futures.Future) -> torch.Tensor:
            done.wait()
            return buffer

        return reduce_scatter_future(shard.recv, shard.send, self.group).then(local_bucket)

    def _fallback(self, state: Any, bucket: dist.GradBucket, plan: _Plan) -> tuple[Any, list[Shard]]:
        """The wrapped hook averages the whole bucket; return its future and the shards it completes."""
        self._counting[1] += 1
        if private.has_rebuilt_buckets(self.ddp):
            self.fallbacks += 1
            if self.fallbacks == 1:
                warn_once(
                    ("zero overlap fallback", id(self)),
                    f"{self.name}: DDP bucket {bucket.index()} ({len(plan.key)} parameters) is not one "
                    "of the buckets planned from bucket_cap_mb (its gradients become ready in another "
                    "order than the reverse of the parameters'), so it is allreduced by the wrapped hook "
                    "instead of reduce-scattered: same result, more traffic; fallback_count(hook) "
                    "counts such buckets",
                    RuntimeWarning,
                )
        ready = []
        for shard, *_ in plan.members:
            shard.seen += 1
            if shard.seen == len(shard.params):
                shard.seen = 0
                ready.append(shard)
        return self.hook(state, bucket), ready

    # -- per-bucket work ----------------------------------------------------------------------

    def start_backward(self) -> None:
        self._counting = [0, 0]

    def launch(self, state: Any, bucket: dist.GradBucket) -> _Pending:
        plan = self.plan(bucket)
        if plan.fast is not None:
            self._counting[0] += 1
            item = _Pending(plan, self._reduce_scatter(plan, bucket), [plan.fast])
        else:
            item = _Pending(plan, *self._fallback(state, bucket, plan))
        if self.stream is not None and self.mode == "per_bucket":
            # Queue this bucket's step now, behind its reduce-scatter: it runs on the side stream
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
        # A stream wait on CUDA (the CPU does not block on NCCL), a real wait on gloo.
        value = item.fut.wait()
        plan = item.plan
        if plan.fast is None:
            self._copy_owned(averaged_bucket(value, plan.numel), plan)
        for shard in item.ready:
            if shard.recv is not shard.grad and plan.fast is not None:
                shard.grad.copy_(shard.recv)
            if self.stream is not None:
                shard.grad.record_stream(self.stream)

    def _copy_owned(self, averaged: torch.Tensor, plan: _Plan) -> None:
        """Copy this rank's slice [lo, hi) of every member parameter into its shard's gradient."""
        for shard, offset, flat_offset, numel in plan.members:
            base = self.rank * shard.chunk
            lo = max(flat_offset, base)
            hi = min(flat_offset + numel, base + shard.chunk)
            if hi > lo:
                shard.grad[lo - base : hi - base].copy_(averaged[offset + lo - flat_offset : offset + hi - flat_offset])

    def complete(self, item: _Pending) -> None:
        """Step (if not done yet) and all-gather the updated slices into the flat buffers."""
        self.step(item)

        def gather() -> None:
            for shard in item.ready:
                self.works.append(all_gather(shard.flat, shard.slice, self.group))

        self.in_stream(gather)

    def complete_all(self, items: list[_Pending]) -> None:
        """The fused path: one step over every slice, then all their all-gathers back to back."""

        def step_and_gather() -> None:
            for item in items:
                self._gather_grads(item)
            ready = [shard for item in items for shard in item.ready]
            if ready:
                self.local_step([shard.slice for shard in ready])
            self.works.extend(all_gathers([(shard.flat, shard.slice) for shard in ready], self.group))

        self.in_stream(step_and_gather)

    def end_backward(self) -> None:
        self.fast_buckets, self.fallback_buckets = self._counting

    def reset(self) -> None:
        super().reset()
        for shard in self.layout:
            shard.seen = 0
