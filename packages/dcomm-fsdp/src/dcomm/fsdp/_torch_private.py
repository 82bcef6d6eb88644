"""Every private torch member dcomm-fsdp reads, and the accessors that read them.

FSDP2 has no public setter for a module's mixed-precision policy after ``fully_shard``, so
:func:`dcomm.fsdp.use_low_precision_reduction` reaches its parameter groups through these; FSDP1
names its second hybrid strategy privately.

Example::

    >>> groups = fsdp_param_groups(module)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, ShardingStrategy

from dcomm.core.torch_private import PrivateMember, TorchChanged, private_member, supported_torch

_DISTRIBUTION = "dcomm-fsdp"


def _param_group_class() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return FSDPParamGroup


def _collectives_module() -> Any:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


_GET_STATE = PrivateMember(lambda: FSDPModule, "_get_fsdp_state", "how a fully_shard module reaches its FSDP state")
_INIT_MP_DTYPES = PrivateMember(
    _param_group_class, "_init_mp_dtypes", "how FSDP2 derives a parameter group's dtypes from its mp_policy"
)
_HYBRID_ZERO2 = PrivateMember(lambda: ShardingStrategy, "_HYBRID_SHARD_ZERO2", "FSDP's hybrid ZeRO-2 strategy")
_DEFAULT_REDUCE_SCATTER = PrivateMember(
    _collectives_module, "DefaultReduceScatter", "the reduce-scatter FSDP2 runs when none is set"
)
PRIVATE_MEMBERS = [_GET_STATE, _INIT_MP_DTYPES, _HYBRID_ZERO2, _DEFAULT_REDUCE_SCATTER]
"""Members on classes and modules; the per-instance ones (a state's parameter groups, a group's
``mp_policy``, reduce-scatter settings and mesh) are checked on a real ``fully_shard`` module by the
package's test."""


def _read(owner: Any, member: PrivateMember) -> Any:
    return private_member(owner, member.name, distribution=_DISTRIBUTION, what=member.what)


def hybrid_zero2_strategy() -> ShardingStrategy:
    """``ShardingStrategy._HYBRID_SHARD_ZERO2``."""
    return _read(ShardingStrategy, _HYBRID_ZERO2)


def fsdp_param_groups(module: Any) -> list[Any]:
    """The FSDP2 parameter groups of the ``fully_shard`` module ``module`` (none before it has parameters).

    torch keeps one as ``FSDPState._fsdp_param_group`` (up to 2.x) or a list as
    ``_fsdp_param_groups`` (newer releases); either is accepted.
    """
    state = _read(module, _GET_STATE)()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise TorchChanged(
        f"torch {torch.__version__} changed where FSDP2 keeps a module's parameter groups: "
        f"{type(state).__name__} has neither _fsdp_param_groups nor _fsdp_param_group; "
        f"{_DISTRIBUTION} supports {supported_torch(_DISTRIBUTION)}"
    )


def mp_policy_holders(group: Any) -> list[Any]:
    """What holds a parameter group's mixed-precision policy.

    torch 2.11-2.14 keep it on the group (``FSDPParamGroup.mp_policy``), torch 2.15 on each of
    its parameters (``FSDPParam.mp_policy``).
    """
    if "mp_policy" in dir(group):
        return [group]
    params = list(vars(group).get("fsdp_params", ()))
    if params and all("mp_policy" in dir(param) for param in params):
        return params
    raise TorchChanged(
        f"torch {torch.__version__} changed where FSDP2 keeps the mixed-precision policy: "
        f"{type(group).__name__} has no mp_policy and its fsdp_params have none either; "
        f"{_DISTRIBUTION} supports {supported_torch(_DISTRIBUTION)}"
    )


def mp_policy(holder: Any) -> Any:
    """The ``mp_policy`` (a frozen ``MixedPrecisionPolicy``) of a group or parameter that holds one."""
    return private_member(holder, "mp_policy", distribution=_DISTRIBUTION, what="FSDP2's mp_policy")


def set_mp_policy(holder: Any, policy: Any) -> None:
    """Give a group or parameter (see :func:`mp_policy_holders`) ``policy``."""
    mp_policy(holder)  # raises where torch no longer keeps it
    holder.mp_policy = policy


def refresh_mp_dtypes(group: Any) -> None:
    """Recompute a parameter group's dtypes if FSDP2 already derived them from the old policy."""
    if "_reduce_dtype" in vars(group):  # lazily initialised already
        _read(group, _INIT_MP_DTYPES)()


def reduces_as_fsdp_default(group: Any) -> bool:
    """Whether a parameter group reduces as ``fully_shard`` left it: torch's own reduce-scatter, no
    gradient divide factor, no forced ``SUM`` (False where torch keeps these elsewhere).

    Example::

        >>> all(reduces_as_fsdp_default(g) for g in fsdp_param_groups(module))  # doctest: +SKIP
        True
    """
    try:
        default = _read(_collectives_module(), _DEFAULT_REDUCE_SCATTER)
    except (ImportError, TorchChanged):
        return False
    state = vars(group)
    return (
        type(state.get("_reduce_scatter_comm")) is default
        and "gradient_divide_factor" in state
        and state["gradient_divide_factor"] is None
        and state.get("force_sum_reduction_for_comms") is False
    )


def shard_group(group: Any) -> Any:
    """The process group a parameter group reduce-scatters over (None where torch keeps it elsewhere).

    Example::

        >>> shard_group(fsdp_param_groups(module)[0]).size()  # doctest: +SKIP
        4
    """
    mesh_info = vars(group).get("mesh_info")
    return getattr(mesh_info, "shard_process_group", None)
