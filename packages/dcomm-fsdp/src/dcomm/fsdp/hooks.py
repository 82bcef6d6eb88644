"""Gradient communication hooks for ``FullyShardedDataParallel.register_comm_hook``.

FSDP calls a hook once per flat parameter after backward. For ``NO_SHARD`` it calls
``hook(state, grad)`` and the hook averages ``grad`` in place over ``state.process_group``; for
``FULL_SHARD`` and ``SHARD_GRAD_OP`` it calls ``hook(state, grad, output)`` and the hook
reduce-scatters the padded flat ``grad`` into this rank's shard ``output``. Averaging is a ``SUM``
between the state's pre-division and post-division (:func:`dcomm.core.plan_average` with the
state's factors, by default those of :func:`dcomm.core.divide_factors`), so it works on every
backend.

The fp16/bf16 hooks communicate a low-precision copy and write the averaged result back in
``state.parameter_type``. Unlike torch's own low-precision hooks they never rely on FSDP
recognising them: FSDP keeps doing its own dtype casts around them, which is what makes their
gradients right for every sharding strategy and mixed-precision setting (see the README).

Example::

    >>> from dcomm.core import LowPrecisionState
    >>> from dcomm.fsdp import bf16_compress_hook
    >>> model = FSDP(net, sharding_strategy=ShardingStrategy.FULL_SHARD)  # doctest: +SKIP
    >>> model.register_comm_hook(LowPrecisionState(dist.group.WORLD), bf16_compress_hook)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import (
    AveragePlan,
    DefaultState,
    LowPrecisionState,
    average_sync,
    cast_for_communication,
    copy_back,
    keep_until_stream_done,
    plan_average,
)

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "reduce_scatter_hook"]


def check_state(state: Any, hook: str, *, low_precision: bool) -> dist.ProcessGroup:
    """Return ``state.process_group``; else a TypeError (not a state) or ValueError (no group) naming the fix."""
    wanted = "LowPrecisionState" if low_precision else "DefaultState"
    group = getattr(state, "process_group", None)
    if group is None:
        has_group = hasattr(state, "process_group")
        got = "a state whose process_group is None" if has_group else repr(state)
        raise (ValueError if has_group else TypeError)(
            f"state: {hook} needs a dcomm.core.{wanted} holding a process group, got {got}; "
            f"pass {wanted}(dist.group.WORLD) (or the group FSDP shards over) to register_comm_hook"
        )
    if low_precision and not isinstance(getattr(state, "parameter_type", None), torch.dtype):
        raise TypeError(
            f"state: {hook} casts the reduced gradient back to state.parameter_type, but "
            f"{type(state).__name__} has none; pass LowPrecisionState(group, parameter_type=torch.float32)"
        )
    return group


def _check_shard_sizes(hook: str, state: Any, grad: torch.Tensor, output: torch.Tensor) -> None:
    world = dist.get_world_size(state.process_group)
    if grad.numel() != output.numel() * world:
        raise ValueError(
            f"state: {hook} reduce-scatters over state.process_group ({world} ranks), but FSDP passed "
            f"a gradient of {grad.numel()} elements for a shard of {output.numel()}; build the state "
            "over the process group the FSDP module shards over (model.process_group)"
        )


def _plan(state: DefaultState, group: dist.ProcessGroup, grad: torch.Tensor) -> AveragePlan:
    """torch's FSDP hook arithmetic: ``SUM`` between the state's pre- and post-division (each when > 1)."""
    factors = (max(state.gradient_predivide_factor, 1.0), max(state.gradient_postdivide_factor, 1.0))
    return plan_average(group, grad.dtype, grad.device, factors=factors, nccl_average=False, nccl_premul=False)


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Average ``grad`` in place over ``state.process_group`` (FSDP ``NO_SHARD``).

    ``grad`` is divided by ``state.gradient_predivide_factor``, summed over the group and divided
    by ``state.gradient_postdivide_factor``: the same arithmetic as FSDP's built-in reduction, so
    the result is bit-identical to it and to torch's ``allreduce_hook``. Use it where you want
    FSDP's own arithmetic from a hook (to wrap or extend it); FSDP without a hook does the same.

    Args:
        state: a :class:`dcomm.core.DefaultState` over the group FSDP shards over.
        grad: the flat gradient FSDP passes; averaged in place.

    Returns:
        None: ``grad`` holds the average.

    Raises:
        TypeError: ``state`` is not a hook state (no ``process_group``).
        ValueError: ``state.process_group`` is None.

    Example::

        >>> model = FSDP(net, sharding_strategy=ShardingStrategy.NO_SHARD)  # doctest: +SKIP
        >>> model.register_comm_hook(DefaultState(dist.group.WORLD), allreduce_hook)  # doctest: +SKIP
    """
    group = check_state(state, "allreduce_hook", low_precision=False)
    average_sync(grad, group, _plan(state, group, grad))


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Reduce-scatter the averaged ``grad`` into this rank's shard ``output`` (sharded FSDP).

    ``grad`` is the padded, unsharded flat gradient (``world_size * output.numel()`` elements);
    it is pre-divided in place, summed and scattered into ``output``, which is then post-divided.
    Bit-identical to FSDP's built-in reduction and to torch's ``reduce_scatter_hook``.

    Args:
        state: a :class:`dcomm.core.DefaultState` over the group FSDP shards over.
        grad: the padded flat gradient FSDP passes (FSDP's scratch: divided in place).
        output: this rank's shard of the gradient, written with the average.

    Returns:
        None: ``output`` holds this rank's shard of the average.

    Raises:
        TypeError: ``state`` is not a hook state (no ``process_group``).
        ValueError: ``state.process_group`` is None, or ``grad`` is not ``output`` times the group
            size (a state over another group).

    Example::

        >>> model = FSDP(net, sharding_strategy=ShardingStrategy.FULL_SHARD)  # doctest: +SKIP
        >>> model.register_comm_hook(DefaultState(dist.group.WORLD), reduce_scatter_hook)  # doctest: +SKIP
    """
    group = check_state(state, "reduce_scatter_hook", low_precision=False)
    _check_shard_sizes("reduce_scatter_hook", state, grad, output)
    average_sync(grad, group, _plan(state, group, grad), output=output)


def _write_back(state: LowPrecisionState, target: torch.Tensor, low: torch.Tensor, post: float) -> None:
    """Store ``low / post`` in ``target`` as ``state.parameter_type``.

    In place (one fused kernel) when ``target`` already has that dtype; otherwise ``target`` is
    rebound to a new tensor of that dtype, exactly as FSDP itself rebinds gradients it casts.
    """
    if target.dtype == state.parameter_type:
        copy_back(target, low, post)
    else:
        result = torch.empty_like(target, dtype=state.parameter_type)
        copy_back(result, low, post)
        target.data = result


def _low_precision_hook(
    dtype: torch.dtype, name: str, state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None
) -> None:
    group = check_state(state, name, low_precision=True)
    op, pre, post = _plan(state, group, grad)
    if output is not None:
        _check_shard_sizes(name, state, grad, output)
    # A fresh low-precision buffer holding grad / pre (cast and divide in one kernel). The
    # collective below is synchronous with respect to the current stream, and the buffers are
    # tied to that stream, so the allocator cannot reuse them before the collective is done.
    low_grad = cast_for_communication(grad, dtype, pre)
    reduce_only = AveragePlan(op, 1.0, 1.0)  # the divisions are fused into the casts
    if output is None:
        average_sync(low_grad, group, reduce_only)
        _write_back(state, grad, low_grad, post)
        keep_until_stream_done(low_grad)
        return
    low_out = torch.empty_like(output, dtype=dtype)
    average_sync(low_grad, group, reduce_only, output=low_out)
    _write_back(state, output, low_out, post)
    keep_until_stream_done(low_grad)
    keep_until_stream_done(low_out)


def fp16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Average gradients over ``state.process_group`` in ``torch.float16``; any FSDP strategy.

    With ``output`` None (``NO_SHARD``) ``grad`` is all-reduced, otherwise reduce-scattered into
    ``output``. The fp16 copy is pre-divided while it is cast, summed, and post-divided while it
    is cast back to ``state.parameter_type`` (in place when the dtypes already agree). Halves the
    bytes on the wire; fp16 keeps 10 mantissa bits but overflows beyond 65504 (the pre-divide
    keeps sums of up to ``world`` such values in range), so prefer :func:`bf16_compress_hook`
    for gradients that can be large. Unlike torch's hook it never relies on FSDP recognising it:
    FSDP keeps its own dtype casts around it, so the gradients are right for every sharding
    strategy and mixed-precision setting.

    Args:
        state: a :class:`dcomm.core.LowPrecisionState` over the group FSDP shards over, whose
            ``parameter_type`` is the dtype the result is written back in.
        grad: the flat gradient FSDP passes.
        output: this rank's shard (sharded strategies); None for ``NO_SHARD``.

    Returns:
        None: ``grad`` (``NO_SHARD``) or ``output`` holds the average, in ``state.parameter_type``.

    Raises:
        TypeError: ``state`` is not a hook state (no ``process_group``), or has no ``parameter_type``.
        ValueError: ``state.process_group`` is None, or ``grad`` is not ``output`` times the group
            size.

    Example::

        >>> state = LowPrecisionState(dist.group.WORLD, parameter_type=torch.float32)  # doctest: +SKIP
        >>> model.register_comm_hook(state, fp16_compress_hook)  # doctest: +SKIP
    """
    _low_precision_hook(torch.float16, "fp16_compress_hook", state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Average gradients over ``state.process_group`` in ``torch.bfloat16``; any FSDP strategy.

    Like :func:`fp16_compress_hook` with bf16: the wider exponent range of bf16 makes overflow
    unlikely, at the cost of a coarser mantissa (about 1e-2 relative error).

    Args:
        state: a :class:`dcomm.core.LowPrecisionState`, as for :func:`fp16_compress_hook`.
        grad: the flat gradient FSDP passes.
        output: this rank's shard (sharded strategies); None for ``NO_SHARD``.

    Returns:
        None: ``grad`` (``NO_SHARD``) or ``output`` holds the average, in ``state.parameter_type``.

    Raises:
        TypeError, ValueError: as :func:`fp16_compress_hook`.

    Example::

        >>> state = LowPrecisionState(dist.group.WORLD, parameter_type=torch.float32)  # doctest: +SKIP
        >>> model.register_comm_hook(state, bf16_compress_hook)  # doctest: +SKIP
    """
    _low_precision_hook(torch.bfloat16, "bf16_compress_hook", state, grad, output)
