"""ZeRO (ZeroRedundancyOptimizer with Adam): the overlap hooks of dcomm and torch vs no overlap.

Variants: non-overlapped ZeRO (the reference), torch's and dcomm's ``hook_with_zero_step`` and
``hook_with_zero_step_interleaved``, and dcomm's ``reduce_scatter=True`` mode of each (one
reduce-scatter and one all-gather per bucket). A ``reduce_scatter`` variant reports
``fallback_count`` of its hook: buckets allreduced instead, after DDP settled its buckets.

Example::

    >>> case = zero_case(ctx)  # doctest: +SKIP
    >>> case.variants["dcomm step+rs"]().details()  # after the rounds  # doctest: +SKIP
    {'fallback buckets': 0}
"""

from __future__ import annotations

import torch

from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import LR, Context, add_versions, train_step
from tools.impls import resolve

__all__ = ["ZERO_HOOKS", "build_zero", "zero_case"]

ZERO_HOOKS = {"step": "hook_with_zero_step", "interleaved": "hook_with_zero_step_interleaved"}

WARMUP_STEPS = 3
"""torch's overlap hooks only start updating parameters after 2-3 steps."""


def build_zero(ctx: Context, overlap: tuple[str, str] | None, reduce_scatter: bool = False) -> Variant:
    """DDP + ZeroRedundancyOptimizer(Adam); ``overlap = (impl, hook row)`` steps inside backward."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = ctx.ddp(ctx.model())
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=overlap is not None, lr=LR
    )
    if overlap is None:
        return Variant(train_step(ctx, ddp, zero))
    impl, name = overlap
    wrapper = resolve(impl, ZERO_HOOKS[name])
    extra = {"reduce_scatter": True, "shard_buckets": True} if reduce_scatter else {}
    hook = wrapper(resolve(impl, "allreduce_hook"), ddp, zero, **extra)
    ddp.register_comm_hook(None, hook)
    if not reduce_scatter:
        return Variant(train_step(ctx, ddp, None))
    from dcomm.ddp import fallback_count

    return Variant(train_step(ctx, ddp, None), lambda: {"fallback buckets": fallback_count(hook)})


def zero_case(ctx: Context) -> Case:
    grad_mib = round(ctx.workload.parameters * 4 / 2**20, 1)
    variants = {"no overlap": lambda: build_zero(ctx, None)}
    case = Case("zero", variants, [], warmup_steps=WARMUP_STEPS, details={"grad MiB": grad_mib})
    for name in ZERO_HOOKS:
        add_versions(case, f"zero/{name}", name, lambda impl, name=name: build_zero(ctx, (impl, name)), "no overlap")
    for name in ZERO_HOOKS:
        case.variants[f"dcomm {name}+rs"] = lambda name=name: build_zero(ctx, ("dcomm", name), reduce_scatter=True)
        case.pairs.append(Pair(f"zero/{name}+rs", f"dcomm {name}+rs", f"torch {name}", "dcomm/torch"))
        case.pairs.append(Pair(f"zero/{name}+rs", f"dcomm {name}+rs", "no overlap", "dcomm/reference"))
    return case
