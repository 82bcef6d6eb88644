"""Post-local SGD with periodic and hierarchical model averaging, dcomm's and torch's.

Each round times 4 steps, one full period of every averager; the references are DDP's built-in
allreduce every step. After ``START_LOCAL_SGD_ITER`` warm-up steps the hook stops communicating
gradients (pure local SGD) and the averagers take over. A hierarchical averager creates process
groups that nothing frees, so each process builds one per implementation and reuses it in every
variant built after (every workload and precision), its step counter reset.

Example::

    >>> case = post_local_sgd_case(ctx)  # doctest: +SKIP
    >>> case.steps_per_round  # doctest: +SKIP
    4
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

from tools.bench.ab import Case, Variant
from tools.bench.cases.common import LR, Context, add_versions, train_step
from tools.bench.cases.ddp import build_ddp
from tools.impls import resolve

__all__ = ["PERIOD", "START_LOCAL_SGD_ITER", "hierarchical_averager", "hierarchy", "post_local_sgd_case"]

START_LOCAL_SGD_ITER = 2
"""Global allreduce steps before local SGD starts (= the averagers' warm-up)."""

PERIOD = 4
"""The longest averaging period; one round holds one full period."""


def hierarchy(world: int) -> collections.OrderedDict[int, int]:
    """Every 2 steps average within halves of the world, every 4 steps over all of it."""
    levels: collections.OrderedDict[int, int] = collections.OrderedDict()
    if world >= 4 and world % 2 == 0:
        levels[2] = world // 2
    levels[PERIOD] = world
    return levels


_HIERARCHICAL_AVERAGERS: dict[tuple[str, tuple[tuple[int, int], ...]], Any] = {}


def hierarchical_averager(impl: str, world: int) -> Any:
    """``impl``'s averager over :func:`hierarchy`, built (with its subgroups) once per process.

    Every rank builds the same variants in the same order, so every rank creates the groups at the
    same call. The averager holds no parameters, only its groups and its step, which restarts at 0.

    Example::

        >>> hierarchical_averager("dcomm", 4).step  # doctest: +SKIP
        0
    """
    levels = hierarchy(world)
    key = (impl, tuple(levels.items()))
    if key not in _HIERARCHICAL_AVERAGERS:
        _HIERARCHICAL_AVERAGERS[key] = resolve(impl, "HierarchicalModelAverager")(
            period_group_size_dict=levels, warmup_steps=START_LOCAL_SGD_ITER
        )
    averager = _HIERARCHICAL_AVERAGERS[key]
    averager.step = 0
    return averager


def build_post_local_sgd(ctx: Context, impl: str, averaging: str) -> Variant:
    """DDP + the post-local SGD hook (no gradient allreduce after the switch) + an averaging optimizer."""
    ddp = ctx.ddp(ctx.model())
    state = resolve(impl, "PostLocalSGDState")(
        process_group=None, subgroup=None, start_localSGD_iter=START_LOCAL_SGD_ITER, post_local_gradient_allreduce=False
    )
    ddp.register_comm_hook(state, resolve(impl, "post_localSGD_hook"))
    if averaging == "periodic":
        averager = resolve(impl, "PeriodicModelAverager")(period=PERIOD, warmup_steps=START_LOCAL_SGD_ITER)
    else:
        averager = hierarchical_averager(impl, ctx.world)
    sgd = torch.optim.SGD(ddp.parameters(), lr=LR)
    optimizer = resolve(impl, "PostLocalSGDOptimizer")(optim=sgd, averager=averager)
    return Variant(train_step(ctx, ddp, optimizer))


def post_local_sgd_case(ctx: Context) -> Case:
    levels = ", ".join(f"{period}:{size}" for period, size in hierarchy(ctx.world).items())
    variants = {"ddp builtin": lambda: build_ddp(ctx, None)}
    case = Case("post-local-sgd", variants, [], steps_per_round=PERIOD, warmup_steps=PERIOD, details={"levels": levels})
    for averaging in ("periodic", "hierarchical"):
        build = functools.partial(build_post_local_sgd, ctx, averaging=averaging)
        add_versions(case, f"post-local-sgd/{averaging}", averaging, build, "ddp builtin")
    return case
