"""Parameter averaging of the workload's parameters: ``average_parameters`` vs a raw allreduce.

Every variant averages the same bytes several times per step (back to back, the throughput of
a periodic averager: 10 calls below 64 MiB, else 5, so that the first call's host time, which a
training step's queued kernels would hide, is a small part of the step): torch's and dcomm's
``average_parameters`` over separate tensors of the workload's shapes, dcomm's over the same
tensors carved out of one buffer (as ``flatten_parameters`` lays them out), and one flat
allreduce of the same number of elements (the reference).

Example::

    >>> case = averaging_case(ctx)  # doctest: +SKIP
    >>> [pair.kind for pair in case.pairs][:2]  # doctest: +SKIP
    ['dcomm/torch', 'dcomm/reference']
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import Context
from tools.impls import resolve

__all__ = ["averaging_case", "calls_per_step"]


def calls_per_step(nbytes: int) -> int:
    """Back-to-back averaging calls per timed step: enough to hide one call's start, fewer on big models."""
    return 10 if nbytes < 64 * 2**20 else 5


def parameter_shapes(ctx: Context) -> list[torch.Size]:
    """The shapes of the workload's parameters (built on the meta device: no memory)."""
    return [p.shape for p in ctx.workload.build(torch.device("meta")).parameters()]


def averaged_tensors(ctx: Context, flattened: bool) -> list[nn.Parameter]:
    """This rank's parameters (filled with its rank): separate tensors or views of one buffer."""
    shapes = parameter_shapes(ctx)
    value = float(ctx.bench.rank)
    if not flattened:
        return [nn.Parameter(torch.full(shape, value, device=ctx.device), requires_grad=False) for shape in shapes]
    flat = torch.full((sum(shape.numel() for shape in shapes),), value, device=ctx.device)
    pieces = flat.split([shape.numel() for shape in shapes])
    return [nn.Parameter(piece.view(shape), requires_grad=False) for piece, shape in zip(pieces, shapes, strict=True)]


def build_raw_allreduce(ctx: Context, calls: int) -> Variant:
    flat = torch.ones(sum(shape.numel() for shape in parameter_shapes(ctx)), device=ctx.device)

    def step() -> None:
        for _ in range(calls):
            dist.all_reduce(flat)

    return Variant(step)


def build_average_parameters(ctx: Context, impl: str, calls: int, flattened: bool = False) -> Variant:
    """``impl``'s average_parameters, ``calls`` times per step."""
    average_parameters = resolve(impl, "average_parameters")
    params = averaged_tensors(ctx, flattened)

    def step() -> None:
        for _ in range(calls):
            average_parameters(iter(params), dist.group.WORLD)

    return Variant(step)


def averaging_case(ctx: Context) -> Case:
    shapes = parameter_shapes(ctx)
    nbytes = sum(s.numel() for s in shapes) * 4
    calls = calls_per_step(nbytes)
    variants = {
        "raw allreduce": lambda: build_raw_allreduce(ctx, calls),
        "torch": lambda: build_average_parameters(ctx, "torch", calls),
        "dcomm": lambda: build_average_parameters(ctx, "dcomm", calls),
        "dcomm flattened": lambda: build_average_parameters(ctx, "dcomm", calls, flattened=True),
    }
    pairs = [
        Pair("averaging", "dcomm", "torch", "dcomm/torch"),
        Pair("averaging", "dcomm", "raw allreduce", "dcomm/reference"),
        Pair("averaging", "torch", "raw allreduce", "torch/reference"),
        Pair("averaging/flattened", "dcomm flattened", "raw allreduce", "dcomm/reference"),
    ]
    details = {"MiB": round(nbytes / 2**20, 1), "tensors": len(shapes), "calls per step": calls}
    return Case("averaging", variants, pairs, details=details)
