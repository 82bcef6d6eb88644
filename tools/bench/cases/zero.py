"""ZeRO (ZeroRedundancyOptimizer with Adam): the overlap hooks of dcomm and torch vs no overlap.

Variants: non-overlapped ZeRO (the reference), ``no step`` (the same DDP forward and backward with
no optimizer at all: no overlap of the step and its parameter collectives can beat it, so
``zero/bound`` is the floor of every ratio to the reference), torch's and dcomm's ``hook_with_zero_step`` and
``hook_with_zero_step_interleaved``, and dcomm's ``reduce_scatter=True`` mode of each (one
reduce-scatter and one all-gather per bucket), and each also with ``gather_during_forward=True``
(``+gf``: the next forward waits for each module's parameters). A ``reduce_scatter`` variant reports
``fallback_count`` of its hook: buckets allreduced instead, after DDP settled its buckets. The
``... fused-adam`` variants use Adam with ``fused=True`` on both sides (rows ``zero/step
fused-adam`` against ``no overlap fused-adam``); ``dcomm step foreach-adam`` (and ``+rs``) choose
``foreach=True``, which keeps dcomm's local step off the fused kernel it uses by default on CUDA
(rows ``zero/step fused local step``: the default against it). dcomm's hooks are registered with
``dcomm.ddp.register_comm_hook(..., native=True)``; ``dcomm step python`` is ``dcomm step`` kept a
Python hook (``native=False``): the row ``zero/step C++ vs python`` shows what averaging the
buckets in C++ on DDP's reducer saves; ``dcomm step+rs python`` and its row the same for the
reduce-scatters of ``reduce_scatter=True``.

Example::

    >>> case = zero_case(ctx)  # doctest: +SKIP
    >>> case.variants["dcomm step+rs"]().details()  # after the rounds  # doctest: +SKIP
    {'fallback buckets': 0}
"""

from __future__ import annotations

import functools
import itertools

import torch

from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import LR, Context, add_versions, train_step
from tools.bench.cases.ddp import register_hook
from tools.impls import resolve

__all__ = ["ZERO_HOOKS", "build_zero", "zero_case"]

ZERO_HOOKS = {"step": "hook_with_zero_step", "interleaved": "hook_with_zero_step_interleaved"}

WARMUP_STEPS = 20
"""torch's overlap hooks only start updating parameters after 2-3 steps, and DDP settles its
buckets after the first; every variant is timed in its steady state."""


def build_zero(
    ctx: Context,
    overlap: tuple[str, str] | None,
    reduce_scatter: bool = False,
    gather_during_forward: bool = False,
    python: bool = False,
    fused_adam: bool = False,
    foreach_adam: bool = False,
) -> Variant:
    """DDP + ZeroRedundancyOptimizer(Adam); ``overlap = (impl, hook row)`` steps inside backward.

    ``gather_during_forward`` (dcomm) lets the next forward wait for each module's parameters.
    ``python`` (dcomm): register the hook as a Python hook only. ``fused_adam``: Adam with
    ``fused=True`` (one kernel per step on CUDA) instead of torch's default foreach Adam;
    ``foreach_adam``: Adam with ``foreach=True`` chosen, which keeps dcomm's local step on torch's
    foreach kernels (left unset, it runs the fused one on CUDA).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = ctx.ddp(ctx.model())
    adam: dict[str, object] = {"fused": True} if fused_adam else {"foreach": True} if foreach_adam else {}
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=overlap is not None, lr=LR, **adam
    )
    if overlap is None:
        return Variant(train_step(ctx, ddp, zero))
    impl, name = overlap
    wrapper = resolve(impl, ZERO_HOOKS[name])
    extra: dict[str, object] = {"reduce_scatter": True, "shard_buckets": True} if reduce_scatter else {}
    if gather_during_forward:
        extra["gather_during_forward"] = True
    hook = wrapper(resolve(impl, "allreduce_hook"), ddp, zero, **extra)
    register_hook(ddp, None, hook, impl, python)
    if impl != "dcomm" or not reduce_scatter:
        return Variant(train_step(ctx, ddp, None))
    from dcomm.ddp import fallback_count

    def details() -> dict[str, object]:
        return {"fallback buckets": fallback_count(hook)}

    return Variant(train_step(ctx, ddp, None), details)


def zero_case(ctx: Context) -> Case:
    grad_mib = round(ctx.workload.parameters * 4 / 2**20, 1)
    variants = {
        "no overlap": lambda: build_zero(ctx, None),
        "no step": lambda: Variant(train_step(ctx, ctx.ddp(ctx.model()), None)),
    }
    bound = Pair("zero/bound", "no step", "no overlap", "torch/reference")
    case = Case("zero", variants, [bound], warmup_steps=WARMUP_STEPS, details={"grad MiB": grad_mib})
    for name in ZERO_HOOKS:
        add_versions(case, f"zero/{name}", name, lambda impl, name=name: build_zero(ctx, (impl, name)), "no overlap")
    for name in ZERO_HOOKS:
        case.variants[f"dcomm {name}+rs"] = lambda name=name: build_zero(ctx, ("dcomm", name), reduce_scatter=True)
        case.pairs.append(Pair(f"zero/{name}+rs", f"dcomm {name}+rs", f"torch {name}", "dcomm/torch"))
        case.pairs.append(Pair(f"zero/{name}+rs", f"dcomm {name}+rs", "no overlap", "dcomm/reference"))
    for name, rs in itertools.product(ZERO_HOOKS, (False, True)):
        variant = f"dcomm {name}{'+rs' if rs else ''}+gf"
        case.variants[variant] = lambda name=name, rs=rs: build_zero(ctx, ("dcomm", name), rs, True)
        label = f"zero/{name}{'+rs' if rs else ''}+gather_during_forward"
        case.pairs.append(Pair(label, variant, "no overlap", "dcomm/reference"))
    # Adam with fused=True on both sides: what the step costs when it is one kernel.
    case.variants["no overlap fused-adam"] = lambda: build_zero(ctx, None, fused_adam=True)
    # dcomm's local step on torch's foreach kernels (foreach=True chosen): what its fused default saves.
    for rs in (False, True):
        name = f"step{'+rs' if rs else ''}"
        variant = f"dcomm {name} foreach-adam"
        case.variants[variant] = functools.partial(build_zero, ctx, ("dcomm", "step"), rs, foreach_adam=True)
        pair = Pair(f"zero/{name} fused local step", f"dcomm {name}", variant, "dcomm/reference")
        case.pairs.append(pair)
    # And each step path kept a Python hook (native=False).
    for rs in (False, True):
        name = f"step{'+rs' if rs else ''}"
        fused = functools.partial(build_zero, ctx, ("dcomm", "step"), rs, fused_adam=True)
        case.variants[f"dcomm {name} fused-adam"] = fused
        pair = Pair(f"zero/{name} fused-adam", f"dcomm {name} fused-adam", "no overlap fused-adam", "dcomm/reference")
        case.pairs.append(pair)
        case.variants[f"dcomm {name} python"] = functools.partial(build_zero, ctx, ("dcomm", "step"), rs, python=True)
        pair = Pair(f"zero/{name} C++ vs python", f"dcomm {name}", f"dcomm {name} python", "dcomm/reference")
        case.pairs.append(pair)
    return case
