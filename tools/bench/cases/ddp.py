"""DDP with each communication hook, dcomm's and torch's, against DDP's built-in allreduce.

Example::

    >>> case = ddp_case(ctx)  # doctest: +SKIP
    >>> sorted(case.variants)[:3]  # doctest: +SKIP
    ['builtin', 'dcomm allreduce', 'dcomm bf16']
"""

from __future__ import annotations

from tools.bench.ab import Case, Variant
from tools.bench.cases.common import Context, add_versions, sgd_variant
from tools.impls import resolve

__all__ = ["DDP_HOOKS", "build_ddp", "ddp_case"]

DDP_HOOKS = {"allreduce": "allreduce_hook", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def build_ddp(ctx: Context, hook: tuple[str, str] | None) -> Variant:
    """A DDP training step (SGD) with ``hook = (impl, row name)``, or DDP's built-in allreduce."""
    ddp = ctx.ddp(ctx.model())
    if hook is not None:
        impl, name = hook
        ddp.register_comm_hook(None, resolve(impl, DDP_HOOKS[name]))
    return sgd_variant(ctx, ddp)


def ddp_case(ctx: Context) -> Case:
    case = Case("ddp", {"builtin": lambda: build_ddp(ctx, None)}, [])
    for name in DDP_HOOKS:
        add_versions(case, f"ddp/{name}", name, lambda impl, name=name: build_ddp(ctx, (impl, name)), "builtin")
    return case
