"""FSDP2 ``fully_shard`` reducing gradients in low precision: dcomm vs torch's ``reduce_dtype``.

torch's variant uses ``MixedPrecisionPolicy(reduce_dtype=...)``; dcomm's uses
``use_low_precision_reduction`` on modules sharded with ``low_precision_mp_policy``. Each
workload unit (Linear or transformer block) is sharded, then the root; the reference reduces in
fp32.

Example::

    >>> case = fully_shard_case(ctx)  # doctest: +SKIP
    >>> sorted(case.variants)  # doctest: +SKIP
    ['dcomm bf16', 'dcomm fp16', 'default fp32', 'torch bf16', 'torch fp16']
"""

from __future__ import annotations

import torch

from tools.bench.ab import Case, Variant
from tools.bench.cases.common import Context, add_versions, sgd_variant

__all__ = ["LOW_PRECISION", "build_fully_shard", "fully_shard_case"]

LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build_fully_shard(ctx: Context, reduction: tuple[str, str] | None) -> Variant:
    """``fully_shard`` per unit and at the root, reducing in fp32 or as ``reduction = (impl, dtype)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    impl, dtype = (reduction[0], LOW_PRECISION[reduction[1]]) if reduction else ("", None)
    policy = MixedPrecisionPolicy(reduce_dtype=dtype) if impl == "torch" else MixedPrecisionPolicy()
    if impl == "dcomm":
        from dcomm.fsdp import low_precision_mp_policy, use_low_precision_reduction

        policy = low_precision_mp_policy(dtype)
    model = ctx.model()
    for module in list(model.modules()):
        if isinstance(module, ctx.workload.unit_types):
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if impl == "dcomm":
        use_low_precision_reduction(model, dtype)
    return sgd_variant(ctx, model)


def fully_shard_case(ctx: Context) -> Case:
    variants = {"default fp32": lambda: build_fully_shard(ctx, None)}
    case = Case("fully_shard", variants, [], details={"torch": "MixedPrecisionPolicy(reduce_dtype)"})
    for name in LOW_PRECISION:
        build = lambda impl, name=name: build_fully_shard(ctx, (impl, name))  # noqa: E731
        add_versions(case, f"fully_shard/{name}", name, build, "default fp32")
    return case
