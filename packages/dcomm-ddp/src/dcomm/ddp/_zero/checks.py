"""The argument checks of the ZeRO overlap hooks, one named function each.

Everything that can be checked when the hook is built raises then; what DDP only reveals on the
first call (the ``state`` it was registered with, a registration after training started) is
checked by :func:`first_call_checks`. Each error names the argument, the value and the fix.

Example::

    >>> check_hook(allreduce_hook)  # doctest: +SKIP
    >>> check_zero(zero, reduce_scatter=False)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import dcomm.ddp._torch_private as private
import dcomm.ddp.default_hooks as dcomm_hooks
from dcomm.core import resolve_group
from dcomm.core.validation import boolean

# Marks the hooks built here (the value is the hook's driver), and the optimizer a hook drives.
HOOK_MARK = "_dcomm_zero_overlap"
ZERO_MARK = "_dcomm_zero_overlap_driver"
# Wrapped hooks that cannot feed a ZeRO step: they leave gradients different on every rank.
_REJECTED_HOOKS = ("post_localSGD_hook", "hook_with_zero_step", "hook_with_zero_step_interleaved")
# The plain averaging hooks reduce_scatter=True can replace, and their communication dtype.
_AVERAGING_HOOKS: list[tuple[object, torch.dtype | None]] = [
    (hook, dtype)
    for module in (dcomm_hooks, torch_hooks)
    for hook, dtype in (
        (module.allreduce_hook, None),
        (module.fp16_compress_hook, torch.float16),
        (module.bf16_compress_hook, torch.bfloat16),
    )
]


def _name(hook: object) -> str:
    return getattr(hook, "__name__", type(hook).__name__)


def _described(hook: Any) -> tuple[object, str]:
    """The function behind ``functools.partial`` / ``functools.wraps`` layers, and how to name it."""
    inner, name = hook, _name(hook)
    while True:
        if isinstance(inner, functools.partial):
            inner = inner.func
            name = f"functools.partial({_name(inner)})"
        elif inspect.unwrap(inner) is not inner:  # functools.wraps layers
            inner = inspect.unwrap(inner)
        else:
            return inner, name


def check_hook(hook: object) -> None:
    if not callable(hook):
        raise TypeError(
            f"hook: expected a DDP communication hook (state, bucket) -> Future, got {hook!r}; "
            "pass e.g. dcomm.ddp.allreduce_hook"
        )
    inner, name = _described(hook)
    if getattr(hook, HOOK_MARK, False) or getattr(inner, HOOK_MARK, False) or _name(inner) in _REJECTED_HOOKS:
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


def check_flag(name: str, value: object) -> None:
    boolean(name, value, f"pass {name}=True or {name}=False")


def averaging_dtype(hook: object) -> torch.dtype | None:
    """The communication dtype of a plain averaging hook (None: the bucket's own dtype).

    Recognised by identity: dcomm's and torch's ``allreduce_hook``, ``fp16_compress_hook`` and
    ``bf16_compress_hook``; anything else raises, since ``reduce_scatter=True`` replaces the
    hook's communication by its own and must know what that communication is.
    """
    for candidate, dtype in _AVERAGING_HOOKS:
        if hook is candidate:
            return dtype
    raise ValueError(
        f"reduce_scatter: True needs hook to be one of the plain averaging hooks (dcomm's or "
        f"torch's allreduce_hook, fp16_compress_hook, bf16_compress_hook), got {_described(hook)[1]}; "
        "pass one of those, or reduce_scatter=False to wrap any averaging hook"
    )


def check_ddp(ddp: object) -> None:
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"ddp: expected a DistributedDataParallel, got {type(ddp).__name__}; pass the wrapped model")


def check_zero(zero: object, reduce_scatter: bool) -> None:
    """A ``ZeroRedundancyOptimizer`` built for overlap (one group with ``reduce_scatter``), not driving a hook yet."""
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(
            f"zero: expected a ZeroRedundancyOptimizer, got {type(zero).__name__}; build one with overlap_with_ddp=True"
        )
    if not private.overlap_with_ddp(zero):
        raise ValueError(
            "zero: the ZeroRedundancyOptimizer was built with overlap_with_ddp=False; build it with "
            "ZeroRedundancyOptimizer(..., overlap_with_ddp=True), or keep it and call zero.step() "
            "after backward without this hook"
        )
    if reduce_scatter and len(zero.param_groups) != 1:
        raise ValueError(
            f"zero: has {len(zero.param_groups)} parameter groups; reduce_scatter=True steps flat slices "
            "that span parameters, so it takes exactly one; pass reduce_scatter=False (whole parameters "
            "per owner, any number of groups) or a single list of parameters"
        )
    uninitialized = private.overlap_status().UNINITIALIZED  # type: ignore[attr-defined]
    if getattr(zero, ZERO_MARK, False) or private.overlap_info(zero).status != uninitialized:
        raise RuntimeError(
            "zero: this ZeroRedundancyOptimizer already drives an overlap hook (or has trained "
            "with one); build one hook per optimizer, before the first backward"
        )


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def check_unused(ddp: DistributedDataParallel, reduce_scatter: bool) -> None:
    """``reduce_scatter=True`` cannot skip one parameter of a slice, as a step without its gradient needs."""
    if reduce_scatter and getattr(ddp, "find_unused_parameters", False):
        raise ValueError(
            "reduce_scatter: True steps element-wise slices that span several parameters, so it cannot "
            "skip a parameter that got no gradient on any rank as plain ZeRO does, but ddp was built with "
            "find_unused_parameters=True; pass reduce_scatter=False, or build DDP with "
            "find_unused_parameters=False"
        )


def check_same_group(zero: ZeroRedundancyOptimizer, ddp: DistributedDataParallel) -> None:
    if _ranks(zero.process_group) != _ranks(ddp.process_group):
        raise ValueError(
            "zero: its process_group differs from ddp's; build the ZeroRedundancyOptimizer with "
            "process_group=ddp.process_group"
        )


def trainable_params(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    """ddp's trainable parameters that ``zero`` updates, in ddp's order; ``zero`` has no others."""
    ddp_params = [p for p in ddp.module.parameters() if p.requires_grad]
    ddp_set = set(ddp_params)
    zero_params = private.all_params(zero)
    stray = [i for i, p in enumerate(zero_params) if p.requires_grad and p not in ddp_set]
    if stray:
        raise ValueError(
            f"zero: parameters at indices {stray[:5]} are not trainable parameters of ddp.module; "
            "build the ZeroRedundancyOptimizer from ddp.parameters()"
        )
    zero_set = set(zero_params)
    return [p for p in ddp_params if p in zero_set]


def check_not_trained(ddp: DistributedDataParallel, name: str) -> None:
    if private.has_rebuilt_buckets(ddp) or any(p.grad is not None for p in ddp.module.parameters() if p.requires_grad):
        raise RuntimeError(
            f"{name}: ddp has already run a backward pass (its parameters have gradients); "
            "build and register the ZeRO overlap hook before training starts, so no step is lost"
        )


def check_state(state: object, zero: ZeroRedundancyOptimizer) -> None:
    """The state DDP passes averages over exactly ``zero``'s group (None means WORLD)."""
    if hasattr(state, "start_localSGD_iter"):
        raise ValueError(
            f"state: a {type(state).__name__} averages within subgroups after start_localSGD_iter, but "
            "the ZeRO step needs the gradient averaged over zero.process_group at every step; register "
            "the hook with ddp.register_comm_hook(None, ...) around allreduce_hook or a compress hook"
        )
    if state is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"state: a process group this rank is not in, but zero.process_group holds ranks "
            f"{_ranks(zero.process_group)}; register the hook with zero.process_group (or None when "
            "that is WORLD) as its state, so every gradient is averaged over ZeRO's group"
        )
    if state is None or isinstance(state, dist.ProcessGroup):
        group = state
    elif hasattr(state, "process_group"):  # DefaultState, LowPrecisionState, torch's, PowerSGDState
        group = state.process_group
    else:
        return  # a user hook's state that names no group: nothing to compare
    theirs, ours = _ranks(resolve_group(group)), _ranks(zero.process_group)
    if theirs != ours:
        raise ValueError(
            f"state: the wrapped hook averages over ranks {theirs} (None means WORLD), but "
            f"zero.process_group holds ranks {ours}; register the hook with zero.process_group (or "
            "None when that is WORLD) as its state, so every gradient is averaged over ZeRO's group"
        )


def first_call_checks(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, name: str) -> Callable[[Any], None]:
    """What can only be checked when DDP first calls the hook with its ``state``.

    ``ddp`` is held weakly: the hook that keeps these checks is itself held by DDP's reducer.
    """
    ddp_ref = weakref.ref(ddp)

    def checks(state: Any) -> None:
        ddp = ddp_ref()
        if ddp is not None and private.has_rebuilt_buckets(ddp):
            raise RuntimeError(
                f"{name}: the hook was registered after training started (DDP has already "
                "rebuilt its buckets); register it right after building it, before the first "
                "forward"
            )
        check_state(state, zero)

    return checks
