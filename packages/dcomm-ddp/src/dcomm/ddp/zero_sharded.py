"""Element-wise ZeRO sharding for the overlap hooks' ``reduce_scatter=True`` path.

Every (expected) DDP bucket is packed into one flat buffer of ``world * chunk`` elements
(``chunk = ceil(bucket / world)``, so fewer than ``world`` elements of padding) that the model's
parameters become views of. Rank ``r`` owns the slice ``[r * chunk, (r + 1) * chunk)`` of every
bucket, whatever the parameter boundaries: the local optimizer's parameters are these slices
(one per bucket), so a bucket holding one huge weight is still split evenly. Per bucket and per
step: one ``reduce_scatter`` of the gradient (divided by the world size in the wrapped hook's
dtype), the optimizer step on the slice, one ``all_gather_into_tensor`` of the updated slices
straight into the flat buffer.

The layout is computed when the hook is built, with DDP's own bucket assignment
(``dist._compute_bucket_assignment_by_size`` over the parameters in reverse order, DDP's caps);
DDP only fixes its real buckets after the first iteration. A DDP bucket that is not exactly one
planned bucket (the first iteration's single bucket, or a layout DDP chose differently) is
averaged by the wrapped hook itself (an allreduce) and each rank copies out its slices: slower,
never wrong. ``fast_buckets`` / ``fallback_buckets`` count both kinds over the last backward.

Checkpoints: ``consolidate_state_dict``, ``state_dict`` and ``load_state_dict`` of the
``ZeroRedundancyOptimizer`` are replaced on the instance. ``state_dict()`` returns torch's
ordinary per-parameter format (the same as a non-overlapped ``ZeroRedundancyOptimizer``): every
state tensor of the slices' shape is concatenated over the ranks and cut back into parameters;
other values (Adam's ``step``) are taken from rank 0. ``load_state_dict()`` does the reverse, so
checkpoints move freely between this path, the other overlap paths and non-overlapped ZeRO.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from dcomm.core import reduce_scatter_future


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


# State entries that are per-step scalars even for 0-dim parameters (used only to classify the
# state of buckets made of 0-dim parameters alone, where shapes cannot tell).
_SCALAR_KEYS = ("step", "eta", "mu")


@dataclass
class _Shard:
    """One planned bucket: its flat buffer and this rank's slice of it."""

    index: int
    params: list[torch.Tensor]  # in DDP's bucket order
    offsets: list[int]  # of each parameter in the flat buffer (= in DDP's bucket buffer)
    numel: int
    chunk: int
    flat: torch.Tensor  # world * chunk elements; the parameters are views of it
    slice: torch.Tensor  # flat[rank * chunk : (rank + 1) * chunk]: the local optimizer's parameter
    grad: torch.Tensor  # chunk elements, the parameters' dtype: slice.grad
    key: tuple[int, ...]
    send: torch.Tensor | None = None  # world * chunk, communication dtype (fast path)
    recv: torch.Tensor | None = None  # chunk, communication dtype (is ``grad`` when dtypes agree)
    seen: int = 0  # parameters whose averaged gradient has arrived this backward (fallback)


@dataclass
class _Plan:
    """How one real DDP bucket is handled: ``fast`` (exactly one planned bucket) or member copies."""

    key: tuple[int, ...]
    numel: int
    fast: _Shard | None
    # fallback: (shard, bucket offset, flat offset, numel) of each ZeRO parameter in the bucket
    members: list[tuple[_Shard, int, int, int]] = field(default_factory=list)


@dataclass
class _Pending:
    plan: _Plan
    fut: torch.futures.Future
    ready: list[_Shard]
    stepped: bool = False


def _expected_layout(ddp: DistributedDataParallel, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """DDP's settled buckets, assuming gradients become ready in reverse parameter order."""
    from dcomm.ddp.zero_overlap import _DEFAULT_BUCKET_BYTES

    config = getattr(ddp, "_bucket_config", None)
    cap = int(getattr(ddp, "bucket_bytes_cap", _DEFAULT_BUCKET_BYTES) or _DEFAULT_BUCKET_BYTES)
    first = getattr(config, "first_bucket_bytes_cap", None)
    if first is None:
        default = getattr(ddp, "bucket_bytes_cap_default", cap == _DEFAULT_BUCKET_BYTES)
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if default else cap
    tensors = list(reversed(params))
    limits = [int(first), cap] if first < cap else [cap]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    return [[tensors[i] for i in bucket] for bucket in indices]


class ShardedDriver:
    """Per-(ddp, zero) state of a ``reduce_scatter=True`` overlap hook (element-wise sharding)."""

    def __init__(
        self,
        hook: Callable[..., Any],
        ddp: DistributedDataParallel,
        zero: ZeroRedundancyOptimizer,
        params: list[torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer],
        interleaved: bool,
        reduce_dtype: torch.dtype | None,
        first_call_checks: Callable[[Any], None] | None,
    ) -> None:
        self.hook = hook
        self.zero = zero
        self.group = zero.process_group
        self.rank = zero.rank
        self.world = zero.world_size
        self.interleaved = interleaved
        self.reduce_dtype = reduce_dtype
        self.first_call_checks = first_call_checks
        self.plans: dict[int, _Plan] = {}
        self.pending: list[_Pending] = []
        self.works: list[Any] = []
        self.stream: Any = None
        self.fast_buckets = 0
        self.fallback_buckets = 0
        self._counting = (0, 0)
        self.layout = self._pack(_expected_layout(ddp, params))
        self.where = {id(p): (s, o) for s in self.layout for p, o in zip(s.params, s.offsets, strict=True)}
        zero.optim = optimizer_class([s.slice for s in self.layout], **zero._optim_defaults)
        zero._sync_param_groups(zero.optim.param_groups, zero.param_groups)
        # Checkpoints in torch's per-parameter format (see the module docstring).
        zero.state_dict = self.state_dict
        zero.load_state_dict = self.load_state_dict

    # -- layout -------------------------------------------------------------------------------

    def _pack(self, buckets: list[list[torch.Tensor]]) -> list[_Shard]:
        shards = []
        with torch.no_grad():
            for index, params in enumerate(buckets):
                numel = sum(p.numel() for p in params)
                chunk = max(1, math.ceil(numel / self.world))
                first = params[0]
                flat = torch.zeros(self.world * chunk, dtype=first.dtype, device=first.device)
                offsets, offset = [], 0
                for p in params:
                    view = flat[offset : offset + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
                    offsets.append(offset)
                    offset += p.numel()
                piece = flat[self.rank * chunk : (self.rank + 1) * chunk]
                grad = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
                piece.grad = grad
                shard = _Shard(index, params, offsets, numel, chunk, flat, piece, grad, tuple(id(p) for p in params))
                dtype = flat.dtype if self.reduce_dtype is None else self.reduce_dtype
                shard.send = torch.zeros(self.world * chunk, dtype=dtype, device=flat.device)
                shard.recv = grad if dtype == flat.dtype else torch.zeros(chunk, dtype=dtype, device=flat.device)
                shards.append(shard)
        return shards

    def plan(self, bucket: dist.GradBucket) -> _Plan:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        plan = self.plans.get(bucket.index())
        if plan is not None and plan.key == key:
            return plan
        numel = sum(p.numel() for p in params)
        fast = self.where.get(key[0], (None, 0))[0] if key else None
        if fast is not None and fast.key == key:
            plan = _Plan(key, numel, fast)
        else:
            plan = _Plan(key, numel, None)
            offset = 0
            for p in params:
                if id(p) in self.where:
                    shard, flat_offset = self.where[id(p)]
                    plan.members.append((shard, offset, flat_offset, p.numel()))
                offset += p.numel()
        self.plans[bucket.index()] = plan
        return plan

    # -- communication --------------------------------------------------------------------------

    def _reduce_scatter(self, shard: _Shard, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Sum ``bucket / world`` onto the slices' owners; each writes its averaged slice back."""
        buffer = bucket.buffer()
        send, recv = shard.send, shard.recv
        assert send is not None
        assert recv is not None
        # Copy, cast to the communication dtype and divide: one kernel (the padding stays 0).
        torch.div(buffer, self.world, out=send[: shard.numel])
        fut = reduce_scatter_future(recv, send, self.group)
        start = self.rank * shard.chunk
        stop = min(shard.numel, start + shard.chunk)

        def write_back(f: torch.futures.Future) -> torch.Tensor:
            f.wait()
            if stop > start:
                buffer[start:stop].copy_(recv[: stop - start])
            return buffer

        return fut.then(write_back)

    # -- per-bucket work ----------------------------------------------------------------------

    def _in_stream(self, fn: Callable[[], None]) -> None:
        stream = self.stream
        if stream is None:
            fn()
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            fn()

    def step(self, item: _Pending) -> None:
        """Step the slices of the buckets ``item`` completes (on CUDA: queued on the side stream)."""
        if item.stepped:
            return
        item.stepped = True
        self._in_stream(lambda: self._step(item))

    def _step(self, item: _Pending) -> None:
        # A stream wait on CUDA (the CPU does not block on NCCL), a real wait on gloo.
        value = item.fut.wait()
        plan = item.plan
        if plan.fast is None:
            value = averaged_bucket(value, plan.numel)
            for shard, offset, flat_offset, numel in plan.members:
                # This rank's part of the parameter: its slice [lo, hi) of the flat buffer.
                lo = max(flat_offset, self.rank * shard.chunk)
                hi = min(flat_offset + numel, (self.rank + 1) * shard.chunk)
                if hi > lo:
                    base = self.rank * shard.chunk
                    src = value[offset + lo - flat_offset : offset + hi - flat_offset]
                    shard.grad[lo - base : hi - base].copy_(src)
        for shard in item.ready:
            if shard.recv is not shard.grad and plan.fast is not None:
                shard.grad.copy_(shard.recv)
            if self.stream is not None:
                shard.grad.record_stream(self.stream)
            self._local_step(shard)

    def _local_step(self, shard: _Shard) -> None:
        zero = self.zero
        optim = zero.optim
        zero._sync_param_groups(zero.param_groups, optim.param_groups)
        group = optim.param_groups[0]
        all_slices = group["params"]
        try:
            group["params"] = [shard.slice]
            optim.step()
        finally:
            group["params"] = all_slices
        zero._sync_param_groups(optim.param_groups, zero.param_groups)

    def send(self, item: _Pending) -> None:
        """Step (if not done yet) and all-gather the updated slices into the flat buffers."""
        self.step(item)
        from dcomm.ddp.zero_overlap import _all_gather

        def gather() -> None:
            for shard in item.ready:
                self.works.append(_all_gather(shard.flat, shard.slice, self.group))

        self._in_stream(gather)

    def finish(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()

    def reset(self) -> None:
        self.pending.clear()
        self.finish()
        for shard in self.layout:
            shard.seen = 0

    # -- the hook -------------------------------------------------------------------------------

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.first_call_checks is not None:
            checks, self.first_call_checks = self.first_call_checks, None
            checks(state)
        index = bucket.index()
        if index == 0:
            if self.pending or self.works:
                # A previous backward was interrupted: drop what it left behind.
                self.reset()
            self._counting = (0, 0)
        plan = self.plan(bucket)
        if plan.fast is not None:
            fut = self._reduce_scatter(plan.fast, bucket)
            ready = [plan.fast]
            self._counting = (self._counting[0] + 1, self._counting[1])
        else:
            fut = self.hook(state, bucket)
            ready = []
            for shard, *_ in plan.members:
                shard.seen += 1
                if shard.seen == len(shard.params):
                    shard.seen = 0
                    ready.append(shard)
            self._counting = (self._counting[0], self._counting[1] + 1)
        cuda = bucket.buffer().is_cuda
        if self.stream is None and cuda:
            self.stream = torch.cuda.Stream(device=bucket.buffer().device)
        item = _Pending(plan, fut, ready)
        self.pending.append(item)
        if cuda:
            # Queue this bucket's step now, behind its reduce-scatter: it runs on the side stream
            # while backward computes the next buckets (no CPU wait on NCCL).
            self.step(item)
        last = bucket.is_last()
        if self.interleaved:
            # The previous bucket's all-gather is queued behind this bucket's reduce-scatter.
            while len(self.pending) > (0 if last else 1):
                self.send(self.pending.pop(0))
        elif last:
            for pending in self.pending:
                self.send(pending)
            self.pending.clear()
        if last:
            for seen in [i for i in self.plans if i > index]:
                del self.plans[seen]
            self.fast_buckets, self.fallback_buckets = self._counting
            self.finish()
        return fut

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's per-parameter ZeRO format, from the slices ``consolidate_state_dict`` gathered."""
        zero = self.zero
        zero._check_overlap_initialized()
        if len(zero._all_state_dicts) == 0:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                "`consolidate_state_dict(to=...)` on all ranks beforehand if you meant to save the "
                "global state."
            )
        result = torch.optim.Optimizer.state_dict(zero)
        index_of = zero._param_to_index
        state: dict[int, dict[str, Any]] = {}
        for shard in self.layout:
            parts = [sd["state"].get(shard.index) for sd in zero._all_state_dicts]
            if all(part is None for part in parts):
                continue
            if any(part is None for part in parts):
                raise RuntimeError(f"state: bucket {shard.index} has optimizer state on some ranks only")
            per_param: list[dict[str, Any]] = [{} for _ in shard.params]
            for key, first in parts[0].items():
                if torch.is_tensor(first) and first.dim() == 1 and first.numel() == shard.chunk:
                    full = torch.cat([part[key].reshape(-1).cpu() for part in parts])
                    for entry, p, offset in zip(per_param, shard.params, shard.offsets, strict=True):
                        entry[key] = full[offset : offset + p.numel()].view_as(p).clone()
                else:
                    for entry in per_param:
                        entry[key] = first.clone() if torch.is_tensor(first) else first
            for p, entry in zip(shard.params, per_param, strict=True):
                state[index_of[p]] = entry
        result["state"] = dict(sorted(state.items()))
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a per-parameter ZeRO (or plain optimizer) state dict into this rank's slices."""
        zero = self.zero
        zero._check_overlap_initialized()
        groups = state_dict.get("param_groups", [])
        if len(groups) != 1 or len(groups[0]["params"]) != len(zero._all_params):
            raise ValueError(
                f"state_dict: expected 1 parameter group of {len(zero._all_params)} parameters, got "
                f"{[len(g['params']) for g in groups]}; load a checkpoint of this model's optimizer"
            )
        saved_index = dict(zip(zero._all_params, groups[0]["params"], strict=True))
        saved_state = state_dict.get("state", {})
        local: dict[int, dict[str, Any]] = {}
        for shard in self.layout:
            entries = [saved_state.get(saved_index[p]) for p in shard.params]
            if all(entry is None for entry in entries):
                continue
            if any(entry is None for entry in entries):
                raise ValueError(
                    f"state_dict: bucket {shard.index} mixes parameters with and without optimizer "
                    "state; reduce_scatter=True steps whole buckets, so every parameter needs state"
                )
            result: dict[str, Any] = {}
            for key in entries[0]:
                values = [entry[key] for entry in entries]
                if self._elementwise(key, values, shard.params):
                    full = torch.zeros(self.world * shard.chunk, dtype=values[0].dtype, device=shard.flat.device)
                    for value, p, offset in zip(values, shard.params, shard.offsets, strict=True):
                        full[offset : offset + p.numel()].copy_(value.reshape(-1))
                    result[key] = full[self.rank * shard.chunk : (self.rank + 1) * shard.chunk].clone()
                else:
                    result[key] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
            local[shard.index] = result
        group = {k: v for k, v in groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.layout)))
        zero.optim.load_state_dict({"state": local, "param_groups": [group]})
        zero._sync_param_groups(groups, zero.param_groups)
        zero._sync_param_groups(zero.param_groups, zero.optim.param_groups)

    @staticmethod
    def _elementwise(key: str, values: list[Any], params: list[torch.Tensor]) -> bool:
        if not all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, params, strict=True)):
            return False
        return any(p.dim() > 0 for p in params) or key not in _SCALAR_KEYS
