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

``shard_buckets=False`` gives each (expected) DDP bucket to one rank; ``shard_buckets=True`` splits
every bucket into contiguous, nearly equal pieces, one per rank, which balances the per-bucket work
of the interleaved hook. Either way the largest buckets (or pieces) are placed first, each on the
least-loaded rank, so every rank steps about as many elements. Ownership is computed from DDP's
bucket size cap (``bucket_cap_mb``), since DDP only fixes its real layout after the first iteration;
the result is the same either way. When a bucket's owned pieces are nearly equal (``(world - 1) *
largest piece <= bucket``, the usual case with ``shard_buckets=True``) the pieces are padded to one
size and a single ``all_gather_into_tensor`` returns the updated parameters; otherwise each owner
broadcasts its piece (one broadcast per bucket with ``shard_buckets=False``). Once DDP has settled
its buckets, the pieces that owners broadcast (and, with ``hook_with_zero_step``, those of padded
buckets) are laid out in groups, so that the fused step path returns each group with one all-gather
instead of a broadcast per piece: the same bytes, over every link in both directions at once.
Without ``gather_during_forward``, where the owners' shares differ by at most 10%, one group holds
every piece, each owner's back to back; otherwise groups hold one piece per owner, of like sizes.
Pieces, not buckets: under autocast DDP's settled buckets pair each bias with the next layer's
weight, two owners in one bucket.

``reduce_scatter=True`` (keyword-only, opt-in, for dcomm's or torch's ``allreduce_hook`` /
``fp16_compress_hook`` / ``bf16_compress_hook`` only) replaces the wrapped hook's allreduce and
shards **element-wise**: every bucket is packed into one flat buffer cut into ``world`` equal
slices (fewer than ``world`` elements of padding), whatever the parameter boundaries, and rank
``r``'s local optimizer steps slice ``r`` of every bucket. Per bucket: one reduce-scatter of
``bucket / world`` (in the hook's dtype), the step, one all-gather of the updated slices: 2 units
of traffic per step instead of 3, and equal work on every rank even when a bucket holds a single
large weight (``shard_buckets`` is then ignored). On CUDA each bucket's step is queued on a side
stream as soon as its reduce-scatter is issued (a stream wait, the CPU never blocks on NCCL), so
it runs while backward computes the next buckets; ``hook_with_zero_step`` issues the all-gathers
after the last bucket, ``hook_with_zero_step_interleaved`` each one behind the next bucket's
reduce-scatter. After backward ``param.grad`` holds this rank's **local** gradient (the averaged
slices go straight to the optimizer), so gradients accumulated over several backward passes
without ``zero_grad`` give plain ZeRO's result. DDP's real buckets (settled in the order
gradients became ready) need not be the planned ones: each is cut into pieces per planned bucket,
and a planned bucket is reduce-scattered once all its parameters arrived, so no bucket is
allreduced for ZeRO's sake. Only a bucket that also holds parameters the
``ZeroRedundancyOptimizer`` does not update is, besides, averaged by the wrapped hook; after DDP
settled, that warns once and :func:`fallback_count` counts such buckets. Without such a bucket, on
the fused path, DDP's reducer fills the shards and starts their reduce-scatters in C++ once DDP
settled (:mod:`dcomm.ddp.native_hooks`), with one Python call per backward pass. With
``gather_during_forward=True`` (either layout) the collectives returning the updated parameters
are not waited for at the end of backward: each module's next forward waits for its own
parameters' (saving or loading the state dict waits for all of them; :func:`wait_for_parameters`
does so on demand). The parameters equal those of non-overlapped ZeRO with the same Adam kernel up
to summation order (float32: within rtol 1e-5 / atol 1e-6 after several Adam steps; bit-identical on
2 gloo ranks).
``zero.state_dict()`` stays torch's per-parameter format (slices are joined on consolidation and
cut again on load), so checkpoints move between every layout and non-overlapped ZeRO.

Where ``zero``'s Adam or AdamW leaves ``foreach`` and ``fused`` unset, the local step on CUDA runs
torch's fused kernel (the same update up to rounding, one pass instead of a dozen; its param groups
keep ``fused=None``): see :mod:`dcomm.ddp._zero.fused_step`.

``step_mode`` (keyword-only) says when the local optimizer runs. ``"per_bucket"`` steps each
bucket's parameters as described above, overlapping the update with the rest of backward: it pays
when backward leaves the GPU idle long enough to hide the per-bucket work, e.g. few large buckets or
a slow link. ``"fused"`` keeps the per-bucket gradient collectives but runs ONE ``optim.step()``
(torch's foreach kernels on CUDA) over all of this rank's parameters at the last bucket, then issues
every parameter collective back to back (all-gathers coalesced into one NCCL group where torch
allows): it pays for models of many small tensors whose backward is bound by the host, where a step
per bucket costs more host time than the overlap saves. ``"auto"`` (the default) runs the per-bucket
path until DDP has settled its buckets, then runs 16 iterations in blocks of 4 (per-bucket, fused,
fused, per-bucket) and times 2 of each block, start of backward to start of backward (the first of
each block dropped; CUDA events, or the wall clock off CUDA), takes the slower rank's median per
path (an all-reduce, so every rank chooses the same), keeps the faster path for good (the per-bucket
one only where it is at least 2% faster) and logs the choice and both times once, on rank 0, at
``INFO`` level of the ``dcomm.ddp.zero_overlap`` logger; :func:`step_mode_of` returns it. For
``hook_with_zero_step`` with ``reduce_scatter=False`` ``"auto"`` is ``"fused"`` from the start
(logged the same way). Its ``"per_bucket"`` path, on CUDA, queues each bucket's step on the side
stream behind that bucket's allreduce (the host never waits), so the update overlaps the rest of
backward and the remaining allreduces, and sends every parameter at the last bucket as the fused
path does (off CUDA it is the fused path); on 4x H200 it was still 1.03-1.31x the fused path's step,
hence not chosen by ``"auto"``. Every path gives the same parameters, so the choice is not
checkpointed: a restarted run calibrates again.

With ``find_unused_parameters=True`` a parameter that no rank used in a step (or that was frozen)
is stepped with its untouched ``.grad``, skipped when None, as a non-overlapped ZeRO does; the
hooks learn which parameters were used with one small MAX allreduce per bucket, which a rank
reads (a host sync on CUDA) only when it computed no gradient for one of the bucket's
parameters itself. ``reduce_scatter=True`` refuses such a DDP: its slices span parameters.

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

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import dcomm.ddp._torch_private as private
from dcomm.ddp._zero import checks
from dcomm.ddp._zero.driver import Driver, Hook, Setup
from dcomm.ddp._zero.layout import expected_buckets
from dcomm.ddp._zero.parameter_driver import ParameterDriver
from dcomm.ddp._zero.sharded_driver import ShardedDriver
from dcomm.ddp._zero.step_mode import StepMode, check_step_mode

__all__ = [
    "fallback_count",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "step_mode_of",
    "wait_for_parameters",
]


def _build(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool,
    reduce_scatter: bool,
    step_mode: str,
    name: str,
    gather_during_forward: bool = False,
) -> Hook:
    checks.check_hook(hook)
    checks.check_flag("reduce_scatter", reduce_scatter)
    checks.check_flag("gather_during_forward", gather_during_forward)
    check_step_mode(step_mode)
    reduce_dtype = checks.averaging_dtype(hook) if reduce_scatter else None
    checks.check_ddp(ddp)
    checks.check_zero(zero, reduce_scatter)
    checks.check_same_group(zero, ddp)
    checks.check_unused(ddp, reduce_scatter)
    params = checks.trainable_params(ddp, zero)
    checks.check_not_trained(ddp, name)

    interleaved = name == "hook_with_zero_step_interleaved"
    first_call = checks.first_call_checks(ddp, zero, name)
    buckets = expected_buckets(ddp, params)
    setup = Setup(hook, ddp, zero, buckets, interleaved, first_call, step_mode, gather_during_forward)
    driver = ShardedDriver(setup, reduce_dtype) if reduce_scatter else ParameterDriver(setup, shard_buckets)
    info = private.overlap_info(zero)
    info.status = private.overlap_status().INITIALIZED  # type: ignore[attr-defined]
    info.shard_buckets = shard_buckets
    setattr(zero, checks.ZERO_MARK, driver)

    def hook_fn(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return driver(state, bucket)

    hook_fn.__name__ = hook_fn.__qualname__ = f"{name}({getattr(hook, '__name__', 'hook')})"
    setattr(hook_fn, checks.HOOK_MARK, driver)
    return hook_fn


def _driver_of(hook: Callable[..., Any]) -> Driver:
    driver = getattr(hook, checks.HOOK_MARK, None)
    if not isinstance(driver, Driver):
        raise TypeError(
            f"hook: expected a hook returned by hook_with_zero_step or hook_with_zero_step_interleaved, "
            f"got {hook!r}; pass the hook they returned"
        )
    return driver


def wait_for_parameters(hook: Callable[..., Any]) -> None:
    """Make every parameter whole now (a stream wait on CUDA) under ``gather_during_forward=True``.

    Needed only before reading parameters outside a forward of the module that owns them, with
    the state dict excepted (saving or loading it waits by itself); a no-op for a hook built
    without it.

    Args:
        hook: what :func:`hook_with_zero_step` or :func:`hook_with_zero_step_interleaved` returned.

    Raises:
        TypeError: ``hook`` was not built by either.

    Example::

        >>> wait_for_parameters(hook)  # then read ddp.module.weight  # doctest: +SKIP
    """
    _driver_of(hook).wait_deferred()


def step_mode_of(hook: Callable[..., Any]) -> str | None:
    """The step path ``hook`` uses: ``"per_bucket"`` or ``"fused"``; None while ``"auto"`` calibrates.

    A hook built with ``step_mode="per_bucket"`` or ``"fused"`` always returns that. With
    ``step_mode="auto"`` it is None until the calibration after DDP settled its buckets has
    chosen, then the chosen path, the same on every rank.

    Args:
        hook: what :func:`hook_with_zero_step` or :func:`hook_with_zero_step_interleaved` returned.

    Raises:
        TypeError: ``hook`` was not built by either.

    Example::

        >>> hook = hook_with_zero_step(allreduce_hook, ddp, zero)  # doctest: +SKIP
        >>> ddp.register_comm_hook(None, hook)  # doctest: +SKIP
        >>> step_mode_of(hook)  # after about 10 steps  # doctest: +SKIP
        'fused'
    """
    driver = _driver_of(hook)
    return None if driver.calibration is not None else driver.mode


def fallback_count(hook: Callable[..., Any]) -> int:
    """Buckets that a ``reduce_scatter=True`` hook also had to allreduce after DDP settled its buckets.

    Such a bucket holds trainable parameters that the ``ZeroRedundancyOptimizer`` does not update:
    besides the reduce-scatter of its ZeRO parameters, the wrapped hook averages it (an
    allreduce), so that those parameters get averaged gradients. The first iterations, before
    DDP settles its buckets, are not counted. The first counted bucket also warns once. 0 when
    ZeRO owns every trainable parameter, and always 0 with ``reduce_scatter=False``.

    Args:
        hook: what :func:`hook_with_zero_step` or :func:`hook_with_zero_step_interleaved` returned.

    Raises:
        TypeError: ``hook`` was not built by either.

    Example::

        >>> hook = hook_with_zero_step(allreduce_hook, ddp, zero, reduce_scatter=True)  # doctest: +SKIP
        >>> ddp.register_comm_hook(None, hook)  # doctest: +SKIP
        >>> fallback_count(hook)  # after a few steps; 0 when every bucket was reduce-scattered  # doctest: +SKIP
        0
    """
    return _driver_of(hook).fallbacks


def hook_with_zero_step(
    hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False, *,
    reduce_scatter: bool = False, step_mode: StepMode = "auto", gather_during_forward: bool = False,
) -> Hook:  # fmt: skip
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
            ``overlap_with_ddp=True``; any number of parameter groups with ``reduce_scatter=False``,
            one with ``reduce_scatter=True``.
        shard_buckets: split each bucket's parameters across all ranks (True) or give each
            bucket to one rank (False); ignored with ``reduce_scatter=True``.
        reduce_scatter: shard every bucket element-wise into equal slices, one per rank, and
            reduce-scatter the gradient onto them instead of allreducing it: less traffic and
            balanced work, but ``param.grad`` keeps the local gradient. Keyword-only. ``hook``
            must then be dcomm's or torch's ``allreduce_hook``, ``fp16_compress_hook`` or
            ``bf16_compress_hook``, whose arithmetic (divide by the world size, sum in the
            hook's dtype, cast back) is kept.
        step_mode: ``"per_bucket"`` (step each bucket as its gradient arrives), ``"fused"`` (one
            step over every parameter at the last bucket) or ``"auto"`` (time both once DDP has
            settled its buckets, keep the faster); keyword-only. See the module documentation.
        gather_during_forward: do not wait for the updated parameters at the end of backward:
            each module's forward waits (a stream wait on CUDA) for the collectives returning
            its own parameters, so the next forward's first layers run while the last layers'
            are still on their way. Keyword-only, opt-in: code that reads parameters outside a
            forward of the module that owns them (other than through ``state_dict()`` and
            ``load_state_dict()``, which wait) must call :func:`wait_for_parameters` first.

    Returns:
        The hook to pass to ``ddp.register_comm_hook(state, ...)``; ``state`` goes to ``hook``.

    Raises:
        ValueError: ``zero`` built without ``overlap_with_ddp=True``, with several parameter
            groups, over parameters outside ``ddp``, ``hook`` not a plain averaging hook (also
            behind ``functools.partial``), or ``reduce_scatter=True`` with a hook other than the
            six listed above, ``reduce_scatter=True`` with a DDP built with
            ``find_unused_parameters=True`` (a slice cannot skip a parameter that got no
            gradient), ``step_mode`` not one of the three above. On the first backward:
            a ``state`` that averages over other ranks than ``zero.process_group`` (a subgroup,
            a ``PostLocalSGDState``).
        RuntimeError: training has already started, or ``zero`` already drives a hook.

    Example::

        >>> zero = ZeroRedundancyOptimizer(  # doctest: +SKIP
        ...     ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
        ... )
        >>> ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))  # doctest: +SKIP
        >>> ddp(inputs).sum().backward()  # doctest: +SKIP
    """
    name = "hook_with_zero_step"
    return _build(hook, ddp, zero, shard_buckets, reduce_scatter, step_mode, name, gather_during_forward)


def hook_with_zero_step_interleaved(
    hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False, *,
    reduce_scatter: bool = False, step_mode: StepMode = "auto", gather_during_forward: bool = False,
) -> Hook:  # fmt: skip
    """Wrap ``hook`` so that ``zero`` steps bucket by bucket while backward still runs.

    Each bucket is updated when DDP hands over the next one: its step and parameter broadcast
    are queued behind the next bucket's allreduce (on CUDA the step runs on a side stream), so
    the update overlaps the rest of the backward pass. Arguments, results and errors are those
    of :func:`hook_with_zero_step`; ``shard_buckets=True`` spreads every bucket's step over all
    ranks, which suits this hook. On the ``"fused"`` step path both hooks behave the same.

    Example::

        >>> hook = hook_with_zero_step_interleaved(bf16_compress_hook, ddp, zero, shard_buckets=True)  # doctest: +SKIP
        >>> ddp.register_comm_hook(None, hook)  # doctest: +SKIP
    """
    name = "hook_with_zero_step_interleaved"
    return _build(hook, ddp, zero, shard_buckets, reduce_scatter, step_mode, name, gather_during_forward)
