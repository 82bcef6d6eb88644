"""DDP with each communication hook, dcomm's and torch's, against DDP's built-in allreduce.

``python floor`` is a reference for what DDP's call of *any* Python hook costs: the least a hook
can do (one allreduce of the bucket with the averaging arithmetic, waited for at the last
bucket, a completed future). dcomm's ``allreduce_hook`` is compared with it, so the share of its
distance to the built-in that belongs to DDP's Python hook mechanism is visible. dcomm's hooks are
registered with ``dcomm.ddp.register_comm_hook(..., native=True)``: in C++ on the reducer for the
fp16 and bf16 hooks (``allreduce_hook`` has no C++ twin); each ``dcomm <hook> python`` variant
registers the same hook with ``native=False``, so the rows ``ddp/<hook> C++ vs python`` show what
the C++ path saves.

Example::

    >>> case = ddp_case(ctx)  # doctest: +SKIP
    >>> sorted(case.variants)[:3]  # doctest: +SKIP
    ['builtin', 'dcomm allreduce', 'dcomm bf16']
"""

# No ``from __future__ import annotations``: DDP checks a hook's annotations against the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not strings.

from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import allreduce_options, completed_future, plan_average
from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import Context, add_versions, sgd_variant
from tools.impls import resolve

__all__ = [
    "DDP_HOOKS",
    "NATIVE_HOOKS",
    "FloorState",
    "build_ddp",
    "build_python_floor",
    "ddp_case",
    "python_floor_hook",
    "register_hook",
]

DDP_HOOKS = {"allreduce": "allreduce_hook", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}
NATIVE_HOOKS = ("fp16", "bf16")
"""The rows of DDP_HOOKS whose dcomm hook has a C++ twin."""


def register_hook(ddp: Any, state: object, hook: Any, impl: str, python: bool = False) -> None:
    """Register ``hook`` from ``impl``: dcomm's in C++ on the reducer (``python``: as a Python hook), torch's as is."""
    if impl == "dcomm":
        from dcomm.ddp import register_comm_hook

        register_comm_hook(ddp, state, hook, native=not python)
    else:
        ddp.register_comm_hook(state, hook)


def build_ddp(ctx: Context, hook: tuple[str, str] | None, python: bool = False, views: bool = False) -> Variant:
    """A DDP training step (SGD) with ``hook = (impl, row name)``, or DDP's built-in allreduce.

    ``python``: register dcomm's hook as a Python hook rather than C++ on the reducer. ``views``:
    DDP with ``gradient_as_bucket_view=True`` (dcomm's C++ compress hooks cast on a side stream there).
    """
    ddp = ctx.ddp(ctx.model(), gradient_as_bucket_view=views)
    if hook is not None:
        impl, name = hook
        register_hook(ddp, None, resolve(impl, DDP_HOOKS[name]), impl, python)
    return sgd_variant(ctx, ddp)


class FloorState:
    """The python floor hook's works in flight and its launch settings per bucket dtype and device."""

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.launch: dict[tuple[torch.dtype, torch.device], tuple[Any, float]] = {}


def python_floor_hook(state: FloorState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one allreduce (divide first, as DDP does), waited for at the last bucket."""
    buffer = bucket.buffer()
    key = (buffer.dtype, buffer.device)
    if key not in state.launch:
        plan = plan_average(None, buffer.dtype, buffer.device, arithmetic="predivide", nccl_average=False)
        state.launch[key] = (allreduce_options(plan.op), plan.pre)
    options, pre = state.launch[key]
    if pre != 1.0:
        buffer.div_(pre)
    state.pending.append(dist.group.WORLD.allreduce([buffer], options))
    if bucket.is_last():
        for work in state.pending:
            work.wait()
        state.pending.clear()
    return completed_future(buffer)


def build_python_floor(ctx: Context) -> Variant:
    ddp = ctx.ddp(ctx.model())
    ddp.register_comm_hook(FloorState(), python_floor_hook)
    return sgd_variant(ctx, ddp)


def ddp_case(ctx: Context) -> Case:
    variants = {"builtin": lambda: build_ddp(ctx, None), "python floor": lambda: build_python_floor(ctx)}
    case = Case("ddp", variants, [Pair("ddp/python floor", "python floor", "builtin", "torch/reference")])
    for name in DDP_HOOKS:
        add_versions(case, f"ddp/{name}", name, lambda impl, name=name: build_ddp(ctx, (impl, name)), "builtin")
    case.pairs.append(Pair("ddp/allreduce vs python floor", "dcomm allreduce", "python floor", "dcomm/reference"))
    # gradient_as_bucket_view=True, where dcomm's compress hooks cast on a side stream (fp16; bf16 alike).
    case.variants["builtin views"] = lambda: build_ddp(ctx, None, views=True)
    views = lambda impl: build_ddp(ctx, (impl, "fp16"), views=True)  # noqa: E731
    add_versions(case, "ddp/fp16 grad views", "fp16 views", views, "builtin views")
    for name in NATIVE_HOOKS:
        python = f"dcomm {name} python"
        case.variants[python] = lambda name=name: build_ddp(ctx, ("dcomm", name), python=True)
        case.pairs.append(Pair(f"ddp/{name} C++ vs python", f"dcomm {name}", python, "dcomm/reference"))
        case.pairs.append(Pair(f"ddp/{name} python", python, f"torch {name}", "dcomm/torch"))
    return case
