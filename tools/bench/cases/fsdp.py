"""FSDP (FullyShardedDataParallel) with each communication hook of dcomm and torch vs its default.

One FSDP unit per workload unit (each Linear of an MLP, each transformer block); the hooks run
with FULL_SHARD except ``allreduce_hook``, which needs NO_SHARD.

Example::

    >>> case = fsdp_case(ctx)  # doctest: +SKIP
    >>> case.pairs[0].label  # doctest: +SKIP
    'fsdp/reduce_scatter'
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import Context, impl_pairs, sgd_variant
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
    variants = {}
    pairs: list[Pair] = []
    for name, (strategy, hook_name, low_precision) in FSDP_HOOKS.items():
        default = f"default {strategy}"
        if default not in variants:
            variants[default] = lambda strategy=strategy: build_fsdp(ctx, strategy, None)
        for impl in ("torch", "dcomm"):
            hook = (impl, hook_name, low_precision)
            variants[f"{impl} {name}"] = lambda strategy=strategy, hook=hook: build_fsdp(ctx, strategy, hook)
        pairs += impl_pairs(f"fsdp/{name}", f"dcomm {name}", f"torch {name}", default)
    return Case("fsdp", variants, pairs)
