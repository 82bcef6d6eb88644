"""Parameter averaging of the workload's parameters: ``average_parameters`` vs a raw allreduce.

Every variant averages the same bytes several times per step (back to back, the throughput of
a periodic averager: 10 calls below 64 MiB, else 5, so that the first call's host time, which a
training step's queued kernels would hide, is a small part of the step): torch's and dcomm's
``average_parameters`` over separate tensors of the workload's shapes, dcomm's over the same
tensors carved out of one buffer, and one flat allreduce of the same number of elements (the
reference); ``dcomm eager`` is dcomm's call with its CUDA graphs switched off
(``DCOMM_CUDA_GRAPHS=0``; on by default). On CUDA, ``dcomm`` reports the memory that CUDA graphs
captured since the variant was built hold (``graph MiB held``: what this workload's averages
added to the graphs' shared pool), which the peak extra memory of a timed step does not show.
``dcomm flattened`` and ``dcomm eager`` average over process groups of their own: the ranks agree
on which parameters to join per group and parameter sizes, and a second list of the same sizes
in one group would be measured on the first list's joins.

Example::

    >>> case = averaging_case(ctx)  # doctest: +SKIP
    >>> [pair.kind for pair in case.pairs][:2]  # doctest: +SKIP
    ['dcomm/torch', 'dcomm/reference']
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from dcomm.core.captured_average import SWITCH
from dcomm.core.environment import variable_set
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


def graph_reserved_mib(device: torch.device) -> float:
    """Device memory that dcomm's averaging graphs on ``device`` hold (reserved while they live)."""
    from dcomm.averaging import _recipes as recipes

    kept = recipes._GRAPHS.get(device)
    return round(kept[0].reserved_bytes / 2**20, 1) if kept is not None else 0.0


def build_average_parameters(
    ctx: Context, impl: str, calls: int, flattened: bool = False, eager: bool = False
) -> Variant:
    """``impl``'s average_parameters, ``calls`` times per step; ``eager``: dcomm's CUDA graphs off."""
    average_parameters = resolve(impl, "average_parameters")
    params = averaged_tensors(ctx, flattened)
    # dcomm's ranks agree once per group and call signature (sizes, dtypes) which parameters
    # lying back to back to join; a second list of the same shapes in that group follows the
    # first one's joins, averaging those its own memory breaks through buffers. A user averages
    # one model: each of dcomm's other variants gets a group of its own, as its only list.
    group = dist.new_group(list(range(ctx.bench.world))) if flattened or eager else dist.group.WORLD

    def step() -> None:
        # Only the switch is set: unittest.mock.patch.dict(os.environ, ...) rewrote the whole
        # environment per step, up to a millisecond on the GPU hosts, more than some averages.
        with variable_set(SWITCH, "0") if eager else contextlib.nullcontext():
            for _ in range(calls):
                average_parameters(iter(params), group)

    if impl == "dcomm" and ctx.device.type == "cuda":
        from dcomm.averaging import _native_key

        _native_key.BUILD.wait(timeout_s=600)  # a long run reads its call keys in C++: time that, not the build
    if impl != "dcomm" or eager or flattened or ctx.device.type != "cuda":
        return Variant(step)
    held_before = graph_reserved_mib(ctx.device)  # earlier cases' graphs share the pool
    return Variant(step, details=lambda: {"graph MiB held": round(graph_reserved_mib(ctx.device) - held_before, 1)})


def averaging_case(ctx: Context) -> Case:
    shapes = parameter_shapes(ctx)
    nbytes = sum(s.numel() for s in shapes) * 4
    calls = calls_per_step(nbytes)
    variants = {
        "raw allreduce": lambda: build_raw_allreduce(ctx, calls),
        "torch": lambda: build_average_parameters(ctx, "torch", calls),
        "dcomm": lambda: build_average_parameters(ctx, "dcomm", calls),
        "dcomm flattened": lambda: build_average_parameters(ctx, "dcomm", calls, flattened=True),
        "dcomm eager": lambda: build_average_parameters(ctx, "dcomm", calls, eager=True),
    }
    pairs = [
        Pair("averaging", "dcomm", "torch", "dcomm/torch"),
        Pair("averaging", "dcomm", "raw allreduce", "dcomm/reference"),
        Pair("averaging", "torch", "raw allreduce", "torch/reference"),
        Pair("averaging/flattened", "dcomm flattened", "raw allreduce", "dcomm/reference"),
        Pair("averaging/eager", "dcomm eager", "torch", "dcomm/torch"),
        Pair("averaging/eager", "dcomm eager", "raw allreduce", "dcomm/reference"),
    ]
    details = {"MiB": round(nbytes / 2**20, 1), "tensors": len(shapes), "calls per step": calls}
    return Case("averaging", variants, pairs, details=details)
