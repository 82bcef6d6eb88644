"""Every private torch member that dcomm-ddp reads, one named accessor each.

The ZeRO overlap hooks need internals of ``ZeroRedundancyOptimizer`` and of DDP's bucketing that
torch does not publish. Each is read here and nowhere else, so a grep finds them all, and a torch
release that renames one fails loudly with :class:`~dcomm.core.torch_private.TorchChanged` (a
``RuntimeError``) naming the member and the supported torch range, instead of silently switching
a check off. :func:`missing_members` lists what the running torch lacks; the unit tests assert it
is empty on every torch in the CI matrix. The many-tensor kernels (``torch._foreach_*``) are read
once for every package, in dcomm-core (:func:`dcomm.core.foreach_div_`).

Example::

    >>> import dcomm.ddp._torch_private as private
    >>> private.param_to_rank(zero)[param]  # doctest: +SKIP
    1
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.optim.utils as optim_utils
import torch.distributed.optim.zero_redundancy_optimizer as zero_module
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from dcomm.core.torch_private import private_member

_ZERO = "the ZeroRedundancyOptimizer internals that ZeRO overlap drives"
_DDP = "the DDP bucketing that ZeRO overlap predicts"
_HOOKS = "the registration of DDP comm hooks in C++ (dcomm.ddp.register_comm_hook)"
_ENGINE = "the autograd engine's end-of-backward callbacks that ZeRO overlap waits from"


def _read(owner: object, name: str, what: str) -> Any:
    """``owner.<name>``, or :class:`~dcomm.core.torch_private.TorchChanged` naming it and the supported torch."""
    return private_member(owner, name, distribution="dcomm-ddp", what=what)


# -- ZeroRedundancyOptimizer ---------------------------------------------------------------------


def overlap_with_ddp(zero: ZeroRedundancyOptimizer) -> bool:
    return bool(_read(zero, "_overlap_with_ddp", _ZERO))


def overlap_info(zero: ZeroRedundancyOptimizer) -> Any:
    """``zero._overlap_info``: its ``status`` and ``shard_buckets`` are read and set."""
    info = _read(zero, "_overlap_info", _ZERO)
    _read(info, "status", _ZERO)
    return info


def overlap_status() -> type[enum.Enum]:
    """The ``_OverlapStatus`` enum (``UNINITIALIZED``, ``INITIALIZED``, ...)."""
    return _read(zero_module, "_OverlapStatus", _ZERO)


def all_params(zero: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    return list(_read(zero, "_all_params", _ZERO))


def param_to_rank(zero: ZeroRedundancyOptimizer) -> dict[torch.Tensor, int]:
    return _read(zero, "_param_to_rank", _ZERO)


def param_to_index(zero: ZeroRedundancyOptimizer) -> dict[torch.Tensor, int]:
    return _read(zero, "_param_to_index", _ZERO)


def optim_defaults(zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    return _read(zero, "_optim_defaults", _ZERO)


def optim_constructor(zero: ZeroRedundancyOptimizer) -> Any:
    return _read(zero, "_optim_constructor", _ZERO)


def all_state_dicts(zero: ZeroRedundancyOptimizer) -> list[dict[str, Any]]:
    """The per-rank state dicts that ``consolidate_state_dict()`` gathered."""
    return _read(zero, "_all_state_dicts", _ZERO)


def clear_cache(zero: ZeroRedundancyOptimizer) -> None:
    _read(zero, "_clear_cache", _ZERO)()


def partition_parameters(zero: ZeroRedundancyOptimizer, per_rank: list[list[torch.Tensor]]) -> list[Any]:
    """Fix ``zero``'s owner of every parameter: ``per_rank[r]`` goes to rank ``r``.

    Returns every rank's parameter groups: one per group of ``zero`` (hyperparameters copied,
    ``params`` the rank's share of the group, possibly empty), as a non-overlapped ZeRO partitions
    several groups. torch's own partition by hand takes a single group only.
    """
    if len(zero.param_groups) == 1:
        return _read(zero, "_partition_parameters", _ZERO)(per_rank)
    cache = _read(zero, "_partition_parameters_cache", _ZERO)
    if cache:
        raise RuntimeError("zero: its parameters were partitioned already; build the hook before training")
    zero._partition_parameters_cache = [[] for _ in per_rank]  # type: ignore[attr-defined]
    partition_group = _read(zero, "_partition_param_group", _ZERO)
    for group in zero.param_groups:
        members = {id(p) for p in group["params"]}
        partition_group(group, [[p for p in owned if id(p) in members] for owned in per_rank])
    return zero._partition_parameters_cache  # type: ignore[attr-defined]


def sync_param_groups(zero: ZeroRedundancyOptimizer, src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    """Copy the hyperparameters (not the parameters) of ``src``'s groups into ``dst``'s."""
    _read(zero, "_sync_param_groups", _ZERO)(src, dst)


def check_overlap_initialized(zero: ZeroRedundancyOptimizer) -> None:
    _read(zero, "_check_overlap_initialized", _ZERO)()


def functional_optimizers() -> dict[type[torch.optim.Optimizer], Any]:
    """``torch.optim`` class -> the functional optimizer ZeRO overlap builds from it."""
    return _read(optim_utils, "functional_optim_map", _ZERO)


def coalescing_manager() -> Callable[..., Any] | None:
    """``torch.distributed._coalescing_manager``, or None where this torch lacks it (launch one by one)."""
    return getattr(dist, "_coalescing_manager", None)


# -- DistributedDataParallel ---------------------------------------------------------------------


def has_rebuilt_buckets(ddp: DistributedDataParallel) -> bool:
    """Whether DDP has replaced its first-iteration buckets by the settled ones."""
    return bool(_read(ddp, "_has_rebuilt_buckets", _DDP))


def bucket_caps(ddp: DistributedDataParallel) -> list[int]:
    """The byte caps DDP rebuilds its buckets with: ``[first, rest]``, or ``[cap]`` when equal."""
    cap = int(_read(ddp, "bucket_bytes_cap", _DDP))
    default = _read(ddp, "bucket_bytes_cap_default", _DDP)
    first = int(_read(dist, "_DEFAULT_FIRST_BUCKET_BYTES", _DDP)) if default else cap
    return [first, cap] if first < cap else [cap]


def bucket_assignment(tensors: list[torch.Tensor], caps: list[int]) -> list[list[int]]:
    """DDP's own grouping of ``tensors`` (in gradient-ready order) into buckets of at most ``caps``."""
    assign: Callable[..., Any] = _read(dist, "_compute_bucket_assignment_by_size", _DDP)
    indices, _ = assign(tensors, caps, [False] * len(tensors))
    return [list(bucket) for bucket in indices]


# -- the autograd engine -------------------------------------------------------------------------


def autograd_engine() -> Any:
    """torch's autograd engine, whose ``queue_callback(fn)`` runs ``fn`` when the current backward ends."""
    return _read(torch.autograd.Variable, "_execution_engine", _ENGINE)


# -- comm hook registration (dcomm.ddp.native_hooks) ----------------------------------------------


def reducer(ddp: DistributedDataParallel) -> Any:
    """DDP's C++ reducer, on which :func:`dcomm.ddp.register_comm_hook` puts a C++ hook."""
    return _read(ddp, "reducer", _HOOKS)


def check_comm_hook(ddp: DistributedDataParallel, hook: Callable[..., Any]) -> None:
    """DDP's own checks of a hook (callable, annotations), as ``register_comm_hook`` runs them."""
    _read(ddp, "_check_comm_hook", _HOOKS)(hook)


def record_comm_hook(ddp: DistributedDataParallel, state: object, hook: Callable[..., Any]) -> None:
    """What ``register_comm_hook`` records besides the reducer's hook: the logged name and ``_comm_hooks``."""
    _read(_read(ddp, "logger", _HOOKS), "_set_comm_hook_name", _HOOKS)(getattr(hook, "__qualname__", repr(hook)))
    _read(ddp, "_comm_hooks", _HOOKS).append((hook, state))


def missing_members(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer) -> list[str]:
    """The members read above that this torch lacks (``ddp`` and ``zero``: any live instances)."""
    checks: list[Callable[[], object]] = [
        lambda: overlap_with_ddp(zero),
        lambda: overlap_info(zero),
        overlap_status,
        lambda: all_params(zero),
        lambda: param_to_rank(zero),
        lambda: param_to_index(zero),
        lambda: optim_defaults(zero),
        lambda: optim_constructor(zero),
        lambda: all_state_dicts(zero),
        lambda: _read(zero, "_clear_cache", _ZERO),
        lambda: _read(zero, "_partition_parameters", _ZERO),
        lambda: _read(zero, "_partition_parameters_cache", _ZERO),
        lambda: _read(zero, "_partition_param_group", _ZERO),
        lambda: _read(zero, "_sync_param_groups", _ZERO),
        lambda: _read(zero, "_check_overlap_initialized", _ZERO),
        functional_optimizers,
        lambda: has_rebuilt_buckets(ddp),
        lambda: bucket_caps(ddp),
        lambda: _read(dist, "_compute_bucket_assignment_by_size", _DDP),
        lambda: reducer(ddp),
        lambda: _read(ddp, "_check_comm_hook", _HOOKS),
        lambda: _read(_read(ddp, "logger", _HOOKS), "_set_comm_hook_name", _HOOKS),
        lambda: _read(ddp, "_comm_hooks", _HOOKS),
        autograd_engine,
    ]
    missing = []
    for check in checks:
        try:
            check()
        except RuntimeError as exc:
            missing.append(str(exc))
    return missing
