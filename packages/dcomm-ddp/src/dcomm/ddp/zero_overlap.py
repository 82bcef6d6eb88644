"""Run a ``ZeroRedundancyOptimizer`` step inside DDP's backward pass, from the very first step.

:func:`hook_with_zero_step` and :func:`hook_with_zero_step_interleaved` wrap a DDP communication
hook that averages gradients (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
dcomm's or torch's) so that a ``torch.distributed.optim.ZeroRedundancyOptimizer`` built with
``overlap_with_ddp=True`` updates its shard of the parameters as soon as their gradients are
averaged, then returns the updated parameters to every rank. The training loop calls neither
``zero.step()`` nor anything else: ``backward()`` does it all. Use it to hide ZeRO's optimizer
step and parameter broadcast behind backward; without ZeRO, plain DDP hooks are what you want.

What it does beyond torch's ``ddp_zero_hook``:

- **No lost update.** Every parameter gets its owner rank when the hook is built, so the step
  runs from iteration 1; torch's hooks skip the first 2 or 3 updates while DDP settles its
  buckets. After every step the parameters equal those of DDP followed by a non-overlapped
  ``ZeroRedundancyOptimizer``.
- **Checkpoints at any step**, in the format of a non-overlapped ZeRO (:func:`zero_state_dict`,
  :func:`load_zero_state_dict`).
- **Any backend** (gloo and NCCL), several parameter groups, ``find_unused_parameters=True``.
- Opt-in ``reduce_scatter=True``: element-wise shards, one reduce-scatter and one all-gather per
  bucket (2 units of traffic per step instead of 3), and ``gather_during_forward=True``: each
  module's next forward waits for its own updated parameters only.

:func:`hook_with_zero_step` steps once, over every parameter this rank owns, at the last bucket;
:func:`hook_with_zero_step_interleaved` steps each bucket when the next one arrives. Both give
the same parameters, bit for bit. How they work (owners, send groups, the C++ path, the checkpoint
format) is in ``docs/design/zero-overlap.md``.

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

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import dcomm.ddp._torch_private as private
from dcomm.ddp._zero import checkpoint, checks
from dcomm.ddp._zero.driver import Driver, Hook, Setup, logger
from dcomm.ddp._zero.layout import expected_buckets
from dcomm.ddp._zero.parameter_driver import ParameterDriver
from dcomm.ddp._zero.sharded_driver import ShardedDriver

__all__ = [
    "fallback_count",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "load_zero_state_dict",
    "wait_for_parameters",
    "zero_state_dict",
]


def _build(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool,
    reduce_scatter: bool,
    name: str,
    gather_during_forward: bool,
) -> Hook:
    checks.check_hook(hook)
    checks.check_flag("reduce_scatter", reduce_scatter)
    checks.check_flag("gather_during_forward", gather_during_forward)
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
    setup = Setup(hook, ddp, zero, buckets, interleaved, first_call, gather_during_forward)
    driver = ShardedDriver(setup, reduce_dtype) if reduce_scatter else ParameterDriver(setup, shard_buckets)
    info = private.overlap_info(zero)
    info.status = private.overlap_status().INITIALIZED  # type: ignore[attr-defined]
    info.shard_buckets = shard_buckets
    setattr(zero, checks.ZERO_MARK, driver)
    if reduce_scatter:
        # torch's own methods would map the slices' state onto whole parameters: wrong. These
        # convert; the same functions are public (zero_state_dict, load_zero_state_dict).
        zero.state_dict = functools.partial(zero_state_dict, zero)  # type: ignore[method-assign]
        zero.load_state_dict = functools.partial(load_zero_state_dict, zero)  # type: ignore[method-assign]
    if driver.rank == 0:
        logger.info(
            "%s: zero.optim is now a %s over this rank's share%s",
            name,
            type(zero.optim).__name__,
            "; zero.state_dict and zero.load_state_dict convert its slices to and from torch's "
            "per-parameter format (as dcomm.ddp.zero_state_dict and load_zero_state_dict)"
            if reduce_scatter
            else "",
        )

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


def _checked_zero(zero: object, caller: str) -> ZeroRedundancyOptimizer:
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(
            f"zero: {caller} expected a torch.distributed.optim.ZeroRedundancyOptimizer, got "
            f"{type(zero).__name__}; pass the optimizer given to hook_with_zero_step"
        )
    return zero


def zero_state_dict(zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """``zero``'s whole optimizer state in torch's per-parameter ZeRO format, on the rank it was consolidated to.

    The same format as ``ZeroRedundancyOptimizer.state_dict()`` of a non-overlapped ZeRO, so a
    checkpoint moves freely between the overlap hooks' layouts (``reduce_scatter`` or not) and
    non-overlapped ZeRO. With ``reduce_scatter=True`` each rank's local optimizer steps flat slices
    of the buckets, not whole parameters: this joins the slices that ``consolidate_state_dict``
    gathered and cuts them into parameters (values that are not element-wise, such as Adam's
    ``step``, come from rank 0). For any other ``zero`` it is ``zero.state_dict()``.

    Args:
        zero: the ``ZeroRedundancyOptimizer`` given to :func:`hook_with_zero_step` or
            :func:`hook_with_zero_step_interleaved` (or any other one).

    Returns:
        The state dict: ``{"state": {parameter index: ...}, "param_groups": [...]}``.

    Raises:
        TypeError: ``zero`` is not a ``ZeroRedundancyOptimizer``.
        RuntimeError: ``zero.consolidate_state_dict(to=...)`` was not called on every rank for this rank.

    Example::

        >>> zero.consolidate_state_dict(to=0)  # on every rank  # doctest: +SKIP
        >>> if dist.get_rank() == 0:  # doctest: +SKIP
        ...     torch.save({"model": ddp.module.state_dict(), "zero": zero_state_dict(zero)}, path)
    """
    driver = getattr(_checked_zero(zero, "zero_state_dict"), checks.ZERO_MARK, None)
    if isinstance(driver, ShardedDriver):
        return checkpoint.state_dict(zero, driver.layout)
    return ZeroRedundancyOptimizer.state_dict(zero)


def load_zero_state_dict(zero: ZeroRedundancyOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a checkpoint of :func:`zero_state_dict` (or of a non-overlapped ZeRO) into ``zero``; call it on every rank.

    Each rank keeps the state of what it steps: its parameters, or with ``reduce_scatter=True``
    its slices of the buckets, cut from the per-parameter entries. The hyperparameters of the
    saved parameter groups (a learning rate changed during training, say) are restored too.

    Args:
        zero: the ``ZeroRedundancyOptimizer`` given to the overlap hook (or any other one).
        state_dict: what :func:`zero_state_dict` or ``ZeroRedundancyOptimizer.state_dict()``
            returned on the rank it was consolidated to.

    Raises:
        TypeError: ``zero`` is not a ``ZeroRedundancyOptimizer``.
        ValueError: with ``reduce_scatter=True``, ``state_dict`` is not of one parameter group
            of this model's parameters, or gives state to only some parameters of a bucket.

    Example::

        >>> saved = torch.load(path)  # doctest: +SKIP
        >>> ddp.module.load_state_dict(saved["model"])  # doctest: +SKIP
        >>> load_zero_state_dict(zero, saved["zero"])  # doctest: +SKIP
    """
    driver = getattr(_checked_zero(zero, "load_zero_state_dict"), checks.ZERO_MARK, None)
    if isinstance(driver, ShardedDriver):
        checkpoint.load_state_dict(zero, driver.layout, state_dict)
    else:
        ZeroRedundancyOptimizer.load_state_dict(zero, state_dict)


def wait_for_parameters(hook: Callable[..., Any]) -> None:
    """Make every parameter whole now (a stream wait on CUDA) under ``gather_during_forward=True``.

    Needed only before reading parameters outside a forward of the module that owns them, with
    the state dict excepted (saving or loading it waits by itself); a no-op for a hook built
    without it.

    Args:
        hook: what :func:`hook_with_zero_step` or :func:`hook_with_zero_step_interleaved` returned.

    Returns:
        None: every parameter is whole (on CUDA: the current stream waits for the collectives).

    Raises:
        TypeError: ``hook`` was not built by either.

    Example::

        >>> wait_for_parameters(hook)  # then read ddp.module.weight  # doctest: +SKIP
    """
    _driver_of(hook).wait_deferred()


def fallback_count(hook: Callable[..., Any]) -> int:
    """Buckets that a ``reduce_scatter=True`` hook also had to allreduce after DDP settled its buckets.

    Such a bucket holds trainable parameters that the ``ZeroRedundancyOptimizer`` does not update:
    besides the reduce-scatter of its ZeRO parameters, the wrapped hook averages it (an
    allreduce), so that those parameters get averaged gradients. The first iterations, before
    DDP settles its buckets, are not counted. The first counted bucket also warns once. 0 when
    ZeRO owns every trainable parameter, and always 0 with ``reduce_scatter=False``.

    Args:
        hook: what :func:`hook_with_zero_step` or :func:`hook_with_zero_step_interleaved` returned.

    Returns:
        The number of such buckets so far (this rank's count; every rank counts alike).

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
    reduce_scatter: bool = False, gather_during_forward: bool = False,
) -> Hook:  # fmt: skip
    """Wrap ``hook`` so that ``zero`` steps once, at DDP's last bucket, inside backward.

    Every bucket's gradient is averaged as ``hook`` does, as DDP hands it over. At the last
    bucket this rank runs one ``optim.step()`` over every parameter it owns (on CUDA on a side
    stream, behind the averaging), then sends the updated parameters to the other ranks: one
    all-gather where the owners' pieces are of like size, else a broadcast per owner, all issued
    back to back. ``backward()`` returns with the parameters updated (on CUDA: with the current
    stream ordered after the collectives), from the first step on, equal to those of DDP followed
    by a non-overlapped ``ZeroRedundancyOptimizer``.

    Building the hook gives ``zero`` its local optimizer: ``zero.optim`` becomes a ``torch.optim``
    optimizer (torch's overlap uses a functional one) over this rank's share, so ``zero``'s
    checkpoints work from the start. With ``reduce_scatter=True`` that share is made of flat
    slices, and ``zero.state_dict`` / ``zero.load_state_dict`` of this instance are replaced by
    :func:`zero_state_dict` / :func:`load_zero_state_dict`, which convert them to torch's
    per-parameter format. Rank 0 logs both changes once (``INFO``, logger
    ``dcomm.ddp.zero_overlap``). On CUDA an Adam or AdamW left to torch's default implementation
    steps in torch's fused kernel (the same update up to float rounding; pass ``foreach=True`` to
    keep torch's choice).

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
        gather_during_forward: do not wait for the updated parameters at the end of backward:
            each module's forward waits (a stream wait on CUDA) for the collectives returning
            its own parameters, so the next forward's first layers run while the last layers'
            are still on their way. Keyword-only, opt-in: code that reads parameters outside a
            forward of the module that owns them (other than through ``state_dict()`` and
            ``load_state_dict()``, which wait) must call :func:`wait_for_parameters` first.

    Returns:
        The hook to pass to ``ddp.register_comm_hook(state, ...)``; ``state`` goes to ``hook``.

    Raises:
        ValueError: ``zero`` built without ``overlap_with_ddp=True`` or over parameters outside
            ``ddp``; ``hook`` not a plain averaging hook (also behind ``functools.partial``);
            ``reduce_scatter=True`` with several parameter groups, with a hook other than the six
            listed above, or with a DDP built with ``find_unused_parameters=True`` (a slice cannot
            skip a parameter that got no gradient). On the first backward: a ``state`` that
            averages over other ranks than ``zero.process_group`` (a subgroup, a
            ``PostLocalSGDState``).
        TypeError: ``hook``, ``ddp``, ``zero`` or a flag of the wrong type.
        RuntimeError: training has already started, or ``zero`` already drives a hook.

    Example::

        >>> zero = ZeroRedundancyOptimizer(  # doctest: +SKIP
        ...     ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
        ... )
        >>> ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))  # doctest: +SKIP
        >>> ddp(inputs).sum().backward()  # doctest: +SKIP
    """
    name = "hook_with_zero_step"
    return _build(hook, ddp, zero, shard_buckets, reduce_scatter, name, gather_during_forward)


def hook_with_zero_step_interleaved(
    hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False, *,
    reduce_scatter: bool = False, gather_during_forward: bool = False,
) -> Hook:  # fmt: skip
    """Wrap ``hook`` so that ``zero`` steps bucket by bucket while backward still runs.

    Each bucket is updated when DDP hands over the next one: its step and the collectives
    returning its parameters are queued behind the next bucket's averaging (on CUDA the step runs
    on a side stream), so the update overlaps the rest of the backward pass, at the cost of one
    ``optim.step()`` per bucket. It pays where backward leaves the GPU idle long enough to hide
    that work (few large buckets, a slow link); elsewhere :func:`hook_with_zero_step` is faster.
    The parameters are those of :func:`hook_with_zero_step`, bit for bit. Arguments, results and
    errors are those of :func:`hook_with_zero_step`; ``shard_buckets=True`` spreads every bucket's
    step over all ranks, which suits this hook.

    Args:
        hook: the DDP hook that averages the gradients, as for :func:`hook_with_zero_step`.
        ddp: the ``DistributedDataParallel`` model.
        zero: the ``ZeroRedundancyOptimizer`` built with ``overlap_with_ddp=True``.
        shard_buckets: split every bucket's step over all ranks.
        reduce_scatter: reduce-scatter each rank's slice instead of allreducing buckets.
        gather_during_forward: let each module's forward wait for its own parameters.

    Returns:
        The hook to pass to ``ddp.register_comm_hook(state, ...)``.

    Raises:
        ValueError, RuntimeError: as :func:`hook_with_zero_step`.

    Example::

        >>> hook = hook_with_zero_step_interleaved(bf16_compress_hook, ddp, zero, shard_buckets=True)  # doctest: +SKIP
        >>> ddp.register_comm_hook(None, hook)  # doctest: +SKIP
    """
    name = "hook_with_zero_step_interleaved"
    return _build(hook, ddp, zero, shard_buckets, reduce_scatter, name, gather_during_forward)
