"""FSDP (FullyShardedDataParallel) with each communication hook of dcomm and torch vs its default.

One FSDP unit per workload unit (each Linear of an MLP, each transformer block); the hooks run
with FULL_SHARD except ``allreduce_hook``, which needs NO_SHARD.

Example::

    >>> case = fsdp_case(ctx)  # doctest: +SKIP
    >>> case.pairs[0].label  # doctest: +SKIP
    'fsdp/reduce_scatter'
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tools.bench.ab import Case, Variant
from tools.bench.cases.common import Context, add_versions, sgd_variant
from tools.impls import resolve

__all__ = ["FSDP_HOOKS", "build_fsdp", "fsdp_case"]

FSDP_HOOKS = {
    # row name: (sharding strategy, hook name, low-precision state?)
    "reduce_scatter": ("FULL_SHARD", "fsdp.reduce_scatter_hook", False),
    "fp16": ("FULL_SHARD", "fsdp.fp16_compress_hook", True),
    "bf16": ("FULL_SHARD", "fsdp.bf16_compress_hook", True),
    "allreduce": ("NO_SHARD", "fsdp.allreduce_hook", False),
}


def build_fsdp(ctx: Context, strategy: str, hook: tuple[str, str, bool] | None) -> Variant:
    """FSDP with ``hook = (impl, hook name, low precision)``, or FSDP's default reduction."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FullyShardedDataParallel(
        ctx.model(),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy(set(ctx.workload.unit_types)),
        device_id=ctx.device,
    )
    if hook is not None:
        impl, hook_name, low_precision = hook
        group = dist.group.WORLD
        if low_precision:
            state = resolve(impl, "LowPrecisionState")(group, parameter_type=torch.float32)
        else:
            state = resolve(impl, "DefaultState")(group)
        model.register_comm_hook(state, resolve(impl, hook_name))
    return sgd_variant(ctx, model)


def fsdp_case(ctx: Context) -> Case:
    case = Case("fsdp", {}, [])
    for name, (strategy, hook_name, low_precision) in FSDP_HOOKS.items():
        default = f"default {strategy}"
        case.variants.setdefault(default, functools.partial(build_fsdp, ctx, strategy, None))

        def build(impl: str, strategy: str = strategy, hook: str = hook_name, low: bool = low_precision) -> Variant:
            return build_fsdp(ctx, strategy, (impl, hook, low))

        add_versions(case, f"fsdp/{name}", name, build, default)
    return case
