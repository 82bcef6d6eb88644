"""Register a dcomm hook on an FSDP model with the checks FSDP leaves to chance.

``FullyShardedDataParallel.register_comm_hook`` accepts any callable and fails later, or with a
bare ``AssertionError``, on misuse. :func:`register_comm_hook` checks first and raises a
``ValueError`` that names the argument, its value and the fix: a hybrid sharding strategy (FSDP
has no hooks for those), a hook that does not fit the strategy, a state without a process group
or over a group of another size (a ``TypeError`` for an argument of the wrong type).

Example::

    >>> from dcomm.core import LowPrecisionState
    >>> from dcomm.fsdp import bf16_compress_hook, register_comm_hook
    >>> register_comm_hook(model, LowPrecisionState(model.process_group), bf16_compress_hook)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from dcomm.fsdp._torch_private import hybrid_zero2_strategy
from dcomm.fsdp.hooks import (
    allreduce_hook,
    bf16_compress_hook,
    check_state,
    fp16_compress_hook,
    reduce_scatter_hook,
)

__all__ = ["register_comm_hook"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, hybrid_zero2_strategy())
_LOW_PRECISION = (fp16_compress_hook, bf16_compress_hook)


def register_comm_hook(module: FullyShardedDataParallel, state: Any, hook: Callable[..., None]) -> None:
    """Check ``module``, ``state`` and ``hook``, then ``module.register_comm_hook(state, hook)``.

    ``FullyShardedDataParallel.register_comm_hook`` takes anything and fails later, or with a bare
    ``AssertionError``; this raises at once with the argument, its value and the fix.

    Args:
        module: the root ``FullyShardedDataParallel`` instance.
        state: the hook's state, e.g. ``DefaultState(model.process_group)`` or
            ``LowPrecisionState(model.process_group, parameter_type=torch.float32)``.
        hook: a ``dcomm.fsdp`` hook that fits the sharding strategy (or any callable hook).

    Returns:
        None: the hook is registered.

    Raises:
        ValueError: a hybrid strategy (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``) in any FSDP unit,
            :func:`allreduce_hook` on a sharded strategy or :func:`reduce_scatter_hook` on
            ``NO_SHARD``, a state whose process group is None, a state whose group size differs
            from the module's.
        TypeError: a module that is not the root FSDP instance, a hook that is not callable, a
            state that is not a hook state (or, for the fp16/bf16 hooks, has no ``parameter_type``).

    Example::

        >>> model = FSDP(net, sharding_strategy=ShardingStrategy.NO_SHARD)  # doctest: +SKIP
        >>> register_comm_hook(model, DefaultState(dist.group.WORLD), allreduce_hook)  # doctest: +SKIP
    """
    if not isinstance(module, FullyShardedDataParallel):
        raise TypeError(
            f"module: expected the root FullyShardedDataParallel instance, got {type(module).__name__}; "
            "wrap the model with FSDP(...) first (for fully_shard modules use "
            "dcomm.fsdp.use_low_precision_reduction)"
        )
    if not callable(hook):
        raise TypeError(f"hook: expected a callable such as dcomm.fsdp.allreduce_hook, got {hook!r}")
    name = getattr(hook, "__name__", repr(hook))
    group = check_state(state, name, low_precision=hook in _LOW_PRECISION)
    strategies = {unit.sharding_strategy for unit in FullyShardedDataParallel.fsdp_modules(module)}
    for strategy in sorted(strategies, key=lambda s: s.value):
        if strategy in _HYBRID:
            raise ValueError(
                f"sharding_strategy: FSDP has no communication hooks for ShardingStrategy.{strategy.name}; "
                "use FULL_SHARD or SHARD_GRAD_OP with a dcomm hook, or keep the hybrid strategy and reduce "
                "in low precision with MixedPrecision(reduce_dtype=torch.bfloat16) instead of a hook"
            )
        if strategy is ShardingStrategy.NO_SHARD and hook is reduce_scatter_hook:
            raise ValueError(
                "hook: reduce_scatter_hook needs a sharded strategy, but the module uses "
                "ShardingStrategy.NO_SHARD; register dcomm.fsdp.allreduce_hook instead"
            )
        if strategy is not ShardingStrategy.NO_SHARD and hook is allreduce_hook:
            raise ValueError(
                f"hook: allreduce_hook serves NO_SHARD, but the module uses ShardingStrategy.{strategy.name}; "
                "register dcomm.fsdp.reduce_scatter_hook instead"
            )
    state_size = dist.get_world_size(group)
    module_size = dist.get_world_size(module.process_group)
    if state_size != module_size:
        raise ValueError(
            f"state: its process_group has {state_size} ranks but the module shards over {module_size}; "
            "build the state over model.process_group"
        )
    module.register_comm_hook(state, hook)
