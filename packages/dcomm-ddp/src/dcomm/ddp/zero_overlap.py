"""Run a ``ZeroRedundancyOptimizer`` step inside DDP's backward pass, from the very first step.

:func:`hook_with_zero_step` and :func:`hook_with_zero_step_interleaved` wrap any DDP
communication hook (``dcomm.ddp.allreduce_hook``, ``bf16_compress_hook``, torch's default hooks,
...) so that a ``torch.distributed.optim.ZeroRedundancyOptimizer`` built with
``overlap_with_ddp=True`` updates its shard of the parameters as soon as the gradients of a
bucket have been averaged, then broadcasts the updated parameters from their owner. Call neither
``zero.step()`` nor anything else in the training loop: backward does it all.

How this differs from torch's ``ddp_zero_hook``:

- **No lost update.** Each parameter gets a fixed owner rank when the hook is built, so the
  step can run from iteration 1, before DDP has settled its bucket layout; a bucket whose layout
  changes is simply re-planned. After every step the parameters equal those of DDP followed by
  a non-overlapped ``ZeroRedundancyOptimizer`` (torch skips the first 2 or 3 updates).
- **Checkpoints at any step.** ``zero`` gets its ordinary local optimizer (``torch.optim.Adam``,
  not the TorchScript functional one) at hook construction, so ``consolidate_state_dict()``,
  ``state_dict()`` and ``load_state_dict()`` work before the first step, and the state dict has
  the same format as a non-overlapped ZeRO's (the two are interchangeable).
- **Any backend.** No collective is ever issued from a future callback, so gloo does not hang;
  on CUDA the optimizer runs on a side stream, and broadcasts are asynchronous, queued behind
  the next bucket's allreduce so that communication and the update pipeline.

``shard_buckets=False`` gives each (expected) DDP bucket to one rank; ``shard_buckets=True``
splits every bucket into contiguous, nearly equal pieces, one per rank, which balances the
per-bucket work of the interleaved hook. Ownership is computed from DDP's bucket size cap
(``bucket_cap_mb``), since DDP only fixes its real layout after the first iteration; the result
is the same either way. When a bucket's owned pieces are nearly equal (``(world - 1) * largest
piece <= bucket``, the usual case with ``shard_buckets=True``) the pieces are padded to one size
and a single ``all_gather_into_tensor`` returns the updated parameters; otherwise each owner
broadcasts its piece (one broadcast per bucket with ``shard_buckets=False``).

``reduce_scatter=True`` (opt-in, for dcomm's or torch's ``allreduce_hook`` /
``fp16_compress_hook`` / ``bf16_compress_hook`` only) replaces the wrapped hook's allreduce and
shards **element-wise** (:mod:`dcomm.ddp.zero_sharded`): every bucket is packed into one flat
buffer cut into ``world`` equal slices (fewer than ``world`` elements of padding), whatever the
parameter boundaries, and rank ``r``'s local optimizer steps slice ``r`` of every bucket. Per
bucket: one reduce-scatter of ``bucket / world`` (in the hook's dtype), the step, one
all-gather of the updated slices: 2 units of traffic per step instead of 3, and equal work on
every rank even when a bucket holds a single large weight (``shard_buckets`` is then ignored).
On CUDA each bucket's step is queued on a side stream as soon as its reduce-scatter is issued
(a stream wait, the CPU never blocks on NCCL), so it runs while backward computes the next
buckets; ``hook_with_zero_step`` issues the all-gathers after the last bucket,
``hook_with_zero_step_interleaved`` each one behind the next bucket's reduce-scatter. After
backward a ``param.grad`` holds the averaged gradient **only in this rank's slices**; elsewhere
the local gradient. The parameters equal those of non-overlapped ZeRO up to summation order
(float32: within rtol 1e-5 / atol 1e-6 after several Adam steps; bit-identical on 2 gloo ranks).
``zero.state_dict()`` stays torch's per-parameter format (slices are joined on consolidation and
cut again on load), so checkpoints move between every layout and non-overlapped ZeRO.

Example::

    >>> import torch
    >>> from torch.distributed.optim import ZeroRedundancyOptimizer
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> from dcomm.ddp import allreduce_hook, hook_with_zero_step
    >>> ddp = DDP(model)  # doctest: +SKIP
    >>> zero = ZeroRedundancyOptimizer(  # doctest: +SKIP
    ...     ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
    ... )
    >>> ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))  # doctest: +SKIP
    >>> for batch in loader:  # doctest: +SKIP
    ...     ddp(batch).sum().backward()  # the parameters are updated when this returns
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from dcomm.ddp.zero_sharded import ShardedDriver, averaged_bucket

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

# Marks the hooks built here, and the ZeroRedundancyOptimizer a hook drives.
_HOOK_MARK = "_dcomm_zero_overlap"
_ZERO_MARK = "_dcomm_zero_overlap_driver"
# Wrapped hooks that cannot feed a ZeRO step: they leave gradients different on every rank.
_REJECTED_HOOKS = ("post_localSGD_hook", "hook_with_zero_step", "hook_with_zero_step_interleaved")
_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Owner:
    """The parameters of one bucket that one rank updates: one contiguous piece of ``plan.flat``."""

    rank: int
    src: int  # global rank, for broadcast / reduce
    start: int  # of the piece in the bucket's packed buffers (plan.flat, plan.send)
    numel: int
    params: list[torch.Tensor]
    offsets: list[int]  # of each parameter in the bucket's flat gradient
    runs: list[tuple[int, int, int]]  # (bucket offset, packed offset, length): contiguous copies


@dataclass
class _BucketPlan:
    """How one DDP bucket is communicated and updated.

    ``flat`` holds the bucket's ZeRO parameters (they are views into it), packed by owner. With
    ``gather`` every owner's piece is padded to ``piece`` elements and laid out by rank
    (``[rank0 | rank1 | ...]``), so one ``all_gather_into_tensor`` returns the updated
    parameters; otherwise pieces are packed back to back and each owner broadcasts its own.
    """

    key: tuple[int, ...]
    numel: int
    owners: list[_Owner]
    mine: _Owner | None
    flat: torch.Tensor | None
    gather: bool
    piece: int


def _runs(members: list[tuple[torch.Tensor, int]], start: int) -> list[tuple[int, int, int]]:
    """Merge parameters adjacent both in the bucket and in the packed piece into single copies."""
    runs: list[list[int]] = []
    packed = start
    for p, offset in members:
        n = p.numel()
        if runs and runs[-1][0] + runs[-1][2] == offset and runs[-1][1] + runs[-1][2] == packed:
            runs[-1][2] += n
        else:
            runs.append([offset, packed, n])
        packed += n
    return [(b, k, n) for b, k, n in runs]


def _all_gather(output: torch.Tensor, piece: torch.Tensor, group: dist.ProcessGroup) -> Any:
    # torch >= 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(output, piece, group=group, async_op=True)


@dataclass
class _Driver:
    """Per-(ddp, zero) state shared by every call of one wrapped hook."""

    hook: Hook
    zero: ZeroRedundancyOptimizer
    group: dist.ProcessGroup
    rank: int
    interleaved: bool
    first_call_checks: Callable[[], None] | None
    plans: dict[int, _BucketPlan] = field(default_factory=dict)
    pending: list[tuple[int, torch.futures.Future]] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    stream: Any = None

    # -- planning ---------------------------------------------------------------------------

    def plan(self, bucket: dist.GradBucket) -> _BucketPlan:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        index = bucket.index()
        plan = self.plans.get(index)
        if plan is not None and plan.key == key:
            return plan
        # DDP changed this bucket (first iterations, or a rebuild): pack its parameters anew.
        owner_of = self.zero._param_to_rank
        per_rank: dict[int, list[tuple[torch.Tensor, int]]] = {}
        offset = 0
        for p in params:
            if p in owner_of:
                per_rank.setdefault(owner_of[p], []).append((p, offset))
            offset += p.numel()
        world = self.group.size()
        sizes = {rank: sum(p.numel() for p, _ in members) for rank, members in per_rank.items()}
        total = sum(sizes.values())
        piece = max(sizes.values(), default=0)
        # One all-gather of world equal (padded) pieces moves about (world - 1) * piece elements
        # per link; one broadcast per owner about `total`. Gather when that is no worse. Every
        # rank sees the same layout, so every rank makes the same choice.
        gather = len(per_rank) >= 2 and (world - 1) * piece <= total
        owners = []
        flat = None
        with torch.no_grad():
            if per_rank:
                first = next(iter(per_rank.values()))[0][0]
                flat = torch.zeros(world * piece if gather else total, dtype=first.dtype, device=first.device)
            start = 0
            for rank in sorted(per_rank):
                members = per_rank[rank]
                if gather:
                    start = rank * piece
                packed = start
                for p, _ in members:
                    view = flat[packed : packed + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
                    packed += p.numel()
                src = dist.get_global_rank(self.group, rank)
                owners.append(
                    _Owner(
                        rank,
                        src,
                        start,
                        sizes[rank],
                        [p for p, _ in members],
                        [o for _, o in members],
                        _runs(members, start),
                    )
                )
                start += sizes[rank]
        mine = next((o for o in owners if o.rank == self.rank), None)
        plan = _BucketPlan(key, offset, owners, mine, flat, gather, piece)
        self.plans[index] = plan
        return plan

    # -- per-bucket work ----------------------------------------------------------------------

    def update(self, index: int, fut: torch.futures.Future) -> None:
        """Wait for bucket ``index``'s averaged gradient, step this rank's share, send it out."""
        plan = self.plans[index]
        stream = self.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                self._step_and_send(plan, fut, stream)
        else:
            self._step_and_send(plan, fut, None)

    def _step_and_send(self, plan: _BucketPlan, fut: torch.futures.Future, stream: Any) -> None:
        grad = averaged_bucket(fut.wait(), plan.numel)
        mine = plan.mine
        if mine is not None:
            if grad.dtype != plan.flat.dtype:
                raise RuntimeError(
                    f"hook: the wrapped hook returned a {grad.dtype} bucket for {plan.flat.dtype} "
                    "parameters; wrap a hook that casts its result back to the bucket's dtype"
                )
            if stream is not None:
                grad.record_stream(stream)
            self._local_step(mine, grad)
        flat = plan.flat
        if flat is None:
            return
        if plan.gather:
            # One collective returns every owner's updated piece to every rank.
            mine_piece = flat[self.rank * plan.piece : (self.rank + 1) * plan.piece]
            self.works.append(_all_gather(flat, mine_piece, self.group))
        else:
            for owner in plan.owners:
                piece = flat[owner.start : owner.start + owner.numel]
                self.works.append(dist.broadcast(piece, src=owner.src, group=self.group, async_op=True))

    def _local_step(self, mine: _Owner, grad: torch.Tensor) -> None:
        zero = self.zero
        optim = zero.optim
        zero._sync_param_groups(zero.param_groups, optim.param_groups)
        group = optim.param_groups[0]
        all_params = group["params"]
        saved = [p.grad for p in mine.params]
        try:
            for p, off in zip(mine.params, mine.offsets, strict=True):
                p.grad = grad[off : off + p.numel()].view_as(p)
            group["params"] = mine.params
            optim.step()
        finally:
            group["params"] = all_params
            for p, g in zip(mine.params, saved, strict=True):
                p.grad = g
        zero._sync_param_groups(optim.param_groups, zero.param_groups)

    def finish(self) -> None:
        """Make the next forward see every updated parameter (a stream wait on CUDA)."""
        works, self.works = self.works, []
        for work in works:
            work.wait()

    # -- the hook -----------------------------------------------------------------------------

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.first_call_checks is not None:
            checks, self.first_call_checks = self.first_call_checks, None
            checks()
        index = bucket.index()
        if index == 0 and (self.pending or self.works):
            # A previous backward was interrupted: drop what it left behind.
            self.pending.clear()
            self.finish()
        self.plan(bucket)
        fut = self.hook(state, bucket)
        if self.stream is None and fut is not None and bucket.buffer().is_cuda:
            self.stream = torch.cuda.Stream(device=bucket.buffer().device)
        self.pending.append((index, fut))
        last = bucket.is_last()
        if self.interleaved:
            # Update the previous bucket now: its step and parameter collective queue behind
            # this bucket's gradient collective, so the two pipeline instead of serializing.
            while len(self.pending) > (0 if last else 1):
                self.update(*self.pending.pop(0))
        elif last:
            for item in self.pending:
                self.update(*item)
            self.pending.clear()
        if last:
            for index_seen in [i for i in self.plans if i > index]:
                del self.plans[index_seen]
            self.finish()
        return fut


# -- construction ------------------------------------------------------------------------------


def _optimizer_class(zero: ZeroRedundancyOptimizer) -> type[torch.optim.Optimizer]:
    from torch.distributed.optim.utils import functional_optim_map

    constructor = zero._optim_constructor
    for cls, functional in functional_optim_map.items():
        if constructor is functional or constructor is cls:
            return cls
    raise ValueError(
        f"zero: optimizer {constructor!r} has no torch.optim equivalent; use one of "
        f"{sorted(c.__name__ for c in functional_optim_map)}"
    )


def _expected_buckets(ddp: DistributedDataParallel, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Guess DDP's settled buckets: parameters in reverse order, cut at ``bucket_cap_mb``."""
    cap = int(getattr(ddp, "bucket_bytes_cap", _DEFAULT_BUCKET_BYTES) or _DEFAULT_BUCKET_BYTES)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _least_loaded(loads: list[int], taken: set[int]) -> int:
    return min((r for r in range(len(loads)) if r not in taken), key=lambda r: (loads[r], r))


def _partition(buckets: list[list[torch.Tensor]], world: int, shard_buckets: bool) -> list[list[torch.Tensor]]:
    """Owner rank of every parameter: whole buckets, or each bucket split into ``world`` pieces."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    loads = [0] * world
    for bucket in buckets:
        total = sum(p.numel() for p in bucket)
        if not shard_buckets:
            pieces = [bucket]
        else:
            # Contiguous pieces of about total / world elements, cut at parameter boundaries.
            cut: list[list[torch.Tensor]] = [[] for _ in range(world)]
            start = 0
            for p in bucket:
                middle = start + p.numel() / 2
                cut[min(world - 1, int(middle * world / max(total, 1)))].append(p)
                start += p.numel()
            pieces = sorted((c for c in cut if c), key=lambda c: -sum(p.numel() for p in c))
        taken: set[int] = set()
        for piece in pieces:
            rank = _least_loaded(loads, taken)
            taken.add(rank)
            per_rank[rank].extend(piece)
            loads[rank] += sum(p.numel() for p in piece)
    return per_rank


def _same_ranks(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    try:
        return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)
    except (RuntimeError, ValueError):  # pragma: no cover - groups unknown to this rank
        return a is b


def _check_hook(hook: object) -> None:
    if not callable(hook):
        raise ValueError(
            f"hook: expected a DDP communication hook (state, bucket) -> Future, got {hook!r}; "
            "pass e.g. dcomm.ddp.allreduce_hook"
        )
    name = getattr(hook, "__name__", type(hook).__name__)
    if getattr(hook, _HOOK_MARK, False) or name in _REJECTED_HOOKS:
        raise ValueError(
            f"hook: {name} cannot be wrapped: the ZeRO step needs the gradient averaged over all "
            "ranks at every step; wrap allreduce_hook, fp16_compress_hook or bf16_compress_hook"
        )
    try:
        inspect.signature(hook).bind(None, None)
    except TypeError as exc:
        raise ValueError(f"hook: {name} does not take (state, bucket): {exc}; wrap a DDP communication hook") from None
    except ValueError:  # pragma: no cover - builtins without a signature
        pass


def _averaging_dtype(hook: object) -> torch.dtype | None:
    """The communication dtype of a plain averaging hook (None: the bucket's own dtype).

    Recognised by identity: dcomm's and torch's ``allreduce_hook``, ``fp16_compress_hook`` and
    ``bf16_compress_hook``; anything else raises, since ``reduce_scatter=True`` replaces the
    hook's communication by its own and must know what that communication is.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

    from dcomm.ddp import default_hooks as dcomm_hooks

    known: list[tuple[object, torch.dtype | None]] = []
    for module in (dcomm_hooks, torch_hooks):
        known += [
            (module.allreduce_hook, None),
            (module.fp16_compress_hook, torch.float16),
            (module.bf16_compress_hook, torch.bfloat16),
        ]
    for candidate, dtype in known:
        if hook is candidate:
            return dtype
    name = getattr(hook, "__name__", type(hook).__name__)
    raise ValueError(
        f"reduce_scatter: True needs hook to be one of the plain averaging hooks (dcomm's or "
        f"torch's allreduce_hook, fp16_compress_hook, bf16_compress_hook), got {name}; pass one "
        "of those, or reduce_scatter=False to wrap any averaging hook"
    )


def _build(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool,
    interleaved: bool,
    name: str,
    reduce_scatter: bool = False,
) -> Hook:
    from torch.distributed.optim.zero_redundancy_optimizer import _OverlapStatus

    _check_hook(hook)
    if not isinstance(reduce_scatter, bool):
        raise ValueError(f"reduce_scatter: expected True or False, got {reduce_scatter!r}")
    reduce_dtype = _averaging_dtype(hook) if reduce_scatter else None
    if not isinstance(ddp, DistributedDataParallel):
        raise ValueError(f"ddp: expected a DistributedDataParallel, got {type(ddp).__name__}")
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise ValueError(f"zero: expected a ZeroRedundancyOptimizer, got {type(zero).__name__}")
    if not zero._overlap_with_ddp:
        raise ValueError(
            "zero: the ZeroRedundancyOptimizer was built with overlap_with_ddp=False; build it with "
            "ZeroRedundancyOptimizer(..., overlap_with_ddp=True), or keep it and call zero.step() "
            "after backward without this hook"
        )
    if len(zero.param_groups) != 1:
        raise ValueError(
            f"zero: has {len(zero.param_groups)} parameter groups; ZeRO overlap supports exactly one "
            "(torch's functional optimizers do too); pass a single list of parameters, or use a "
            "non-overlapped ZeroRedundancyOptimizer"
        )
    if getattr(zero, _ZERO_MARK, False) or zero._overlap_info.status != _OverlapStatus.UNINITIALIZED:
        raise RuntimeError(
            "zero: this ZeroRedundancyOptimizer already drives an overlap hook (or has trained "
            "with one); build one hook per optimizer, before the first backward"
        )
    group = zero.process_group
    if not _same_ranks(group, ddp.process_group):
        raise ValueError(
            "zero: its process_group differs from ddp's; build the ZeroRedundancyOptimizer with "
            "process_group=ddp.process_group"
        )
    ddp_params = [p for p in ddp.module.parameters() if p.requires_grad]
    ddp_set = set(ddp_params)
    zero_params = list(zero._all_params)
    stray = [i for i, p in enumerate(zero_params) if p.requires_grad and p not in ddp_set]
    if stray:
        raise ValueError(
            f"zero: parameters at indices {stray[:5]} are not trainable parameters of ddp.module; "
            "build the ZeroRedundancyOptimizer from ddp.parameters()"
        )
    if getattr(ddp, "_has_rebuilt_buckets", False) or any(p.grad is not None for p in ddp_params):
        raise RuntimeError(
            f"{name}: ddp has already run a backward pass (its parameters have gradients); "
            "build and register the ZeRO overlap hook before training starts, so no step is lost"
        )

    # Fix every parameter's owner now, for good: the step can then run from iteration 1.
    zero_set = set(zero_params)
    trainable = [p for p in ddp_params if p in zero_set]
    per_rank = _partition(_expected_buckets(ddp, trainable), zero.world_size, shard_buckets)
    zero._clear_cache()
    local_groups = zero._partition_parameters(per_rank)[zero.rank]
    if not reduce_scatter:
        zero.optim = _optimizer_class(zero)(local_groups, **zero._optim_defaults)
        zero._sync_param_groups(zero.optim.param_groups, zero.param_groups)
    zero._overlap_info.status = _OverlapStatus.INITIALIZED
    zero._overlap_info.shard_buckets = shard_buckets
    setattr(zero, _ZERO_MARK, True)

    def late_registration() -> None:
        if getattr(ddp, "_has_rebuilt_buckets", False):
            raise RuntimeError(
                f"{name}: the hook was registered after training started (DDP has already "
                "rebuilt its buckets); register it right after building it, before the first "
                "forward"
            )

    driver: _Driver | ShardedDriver
    if reduce_scatter:

        def first_call(state: Any) -> None:
            late_registration()
            if isinstance(state, dist.ProcessGroup) and not _same_ranks(state, group):
                raise ValueError(
                    "state: reduce_scatter=True communicates over the ZeroRedundancyOptimizer's "
                    "process group, but the hook was registered with another group; register it "
                    "with ddp.register_comm_hook(None, ...)"
                )

        # Element-wise sharding: equal slices of every bucket, whatever the parameter boundaries.
        cls = _optimizer_class(zero)
        driver = ShardedDriver(hook, ddp, zero, trainable, cls, interleaved, reduce_dtype, first_call)
    else:
        driver = _Driver(hook, zero, group, zero.rank, interleaved, late_registration)
    setattr(zero, _ZERO_MARK, driver)

    def hook_fn(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return driver(state, bucket)

    hook_fn.__name__ = hook_fn.__qualname__ = f"{name}({getattr(hook, '__name__', 'hook')})"
    setattr(hook_fn, _HOOK_MARK, True)
    return hook_fn


def hook_with_zero_step(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future],
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    reduce_scatter: bool = False,
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """Wrap ``hook`` so that ``zero`` steps once the last bucket's gradients are in flight.

    When DDP hands over its last bucket, every bucket is updated in order: this rank waits for
    the bucket's averaged gradient, steps the parameters it owns, and sends them to the other
    ranks asynchronously (one all-gather per balanced bucket, else a broadcast per owner); the
    next bucket's step overlaps that collective. Parameters are updated at every step, the first
    included, and equal those of a non-overlapped ZeRO run.

    Args:
        hook: the DDP communication hook to wrap, ``(state, bucket) -> Future[Tensor]`` giving
            the averaged bucket (dcomm's or torch's allreduce / fp16 / bf16 hooks).
        ddp: the ``DistributedDataParallel`` model the hook is registered on.
        zero: a ``ZeroRedundancyOptimizer`` over ``ddp.parameters()`` built with
            ``overlap_with_ddp=True`` and a single parameter group.
        shard_buckets: split each bucket's parameters across all ranks (True) or give each
            bucket to one rank (False); ignored with ``reduce_scatter=True``.
        reduce_scatter: shard every bucket element-wise into equal slices, one per rank, and
            reduce-scatter the gradient onto them instead of allreducing it: less traffic and
            balanced work, but ``param.grad`` is averaged only in this rank's slices. ``hook``
            must then be dcomm's or torch's ``allreduce_hook``, ``fp16_compress_hook`` or
            ``bf16_compress_hook``, whose arithmetic (divide by the world size, sum in the
            hook's dtype, cast back) is kept.

    Returns:
        The hook to pass to ``ddp.register_comm_hook(state, ...)``; ``state`` goes to ``hook``.

    Raises:
        ValueError: ``zero`` built without ``overlap_with_ddp=True``, with several parameter
            groups, over parameters outside ``ddp``, ``hook`` not a plain averaging hook, or
            ``reduce_scatter=True`` with a hook other than the six listed above.
        RuntimeError: training has already started, or ``zero`` already drives a hook.

    Example::

        >>> zero = ZeroRedundancyOptimizer(  # doctest: +SKIP
        ...     ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
        ... )
        >>> ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))  # doctest: +SKIP
        >>> ddp(inputs).sum().backward()  # doctest: +SKIP
    """
    return _build(hook, ddp, zero, shard_buckets, False, "hook_with_zero_step", reduce_scatter)


def hook_with_zero_step_interleaved(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future],
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    reduce_scatter: bool = False,
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """Wrap ``hook`` so that ``zero`` steps bucket by bucket while backward still runs.

    Each bucket is updated when DDP hands over the next one: its step and parameter broadcast
    are queued behind the next bucket's allreduce (on CUDA the step runs on a side stream), so
    the update overlaps the rest of the backward pass. Arguments, results and errors are those
    of :func:`hook_with_zero_step`; ``shard_buckets=True`` spreads every bucket's step over all
    ranks, which suits this hook.

    Example::

        >>> hook = hook_with_zero_step_interleaved(bf16_compress_hook, ddp, zero, shard_buckets=True)  # doctest: +SKIP
        >>> ddp.register_comm_hook(None, hook)  # doctest: +SKIP
    """
    return _build(hook, ddp, zero, shard_buckets, True, "hook_with_zero_step_interleaved", reduce_scatter)
