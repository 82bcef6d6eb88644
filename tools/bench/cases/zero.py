"""ZeRO (ZeroRedundancyOptimizer with Adam): the overlap hooks of dcomm and torch vs no overlap.

Variants: non-overlapped ZeRO (the reference), torch's and dcomm's ``hook_with_zero_step`` and
``hook_with_zero_step_interleaved``, and dcomm's ``reduce_scatter=True`` mode of each (one
reduce-scatter and one all-gather per bucket). A ``reduce_scatter`` variant reports how many
buckets took that path in its last step (the rest fell back to an allreduce).

Example::

    >>> case = zero_case(ctx)  # doctest: +SKIP
    >>> case.variants["dcomm step+rs"]().details()  # doctest: +SKIP
    {'rs buckets': '4/4'}
"""

from __future__ import annotations

from typing import Any

import torch

from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import LR, Context, add_versions, train_step
from tools.impls import resolve

__all__ = ["ZERO_HOOKS", "build_zero", "zero_case"]

ZERO_HOOKS = {"step": "hook_with_zero_step", "interleaved": "hook_with_zero_step_interleaved"}

WARMUP_STEPS = 3
"""torch's overlap hooks only start updating parameters after 2-3 steps."""


def _driver_details(zero: Any) -> dict[str, Any]:
    """Buckets reduce-scattered element-wise in the last step, out of all buckets."""
    driver = getattr(zero, "_dcomm_zero_overlap_driver", None)
    if driver is None or not hasattr(driver, "fast_buckets"):
        return {}
    fast, slow = driver.fast_buckets, driver.fallback_buckets
    return {"rs buckets": f"{fast}/{fast + slow}"}


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
    ddp.register_comm_hook(None, wrapper(resolve(impl, "allreduce_hook"), ddp, zero, **extra))
    details = (lambda: _driver_details(zero)) if reduce_scatter else dict
    return Variant(train_step(ctx, ddp, None), details)


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
