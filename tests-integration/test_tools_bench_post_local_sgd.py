"""The post-local SGD bench case on 4 gloo ranks: its hierarchical averagers' groups are created once.

A run builds the case again for every workload and precision; each torch or dcomm
``HierarchicalModelAverager`` creates process groups (NCCL communicators on GPUs) that nothing
frees, so a rebuilt variant must reuse the averager built first, with its step counter back at 0.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch.distributed as dist

from dcomm_testing import run_ranks

IMPLS = ("torch", "dcomm")
BUILDS = 3


def _groups_created_per_build(rank: int, world: int) -> list[int]:
    from tools.bench.cases.common import Context
    from tools.bench.cases.post_local_sgd import (
        PERIOD,
        START_LOCAL_SGD_ITER,
        build_post_local_sgd,
        hierarchical_averager,
    )
    from tools.bench.timing import Bench
    from tools.bench.workloads import WORKLOADS

    ctx = Context(Bench.create(), WORKLOADS["mlp-wide"]["small"], "fp32")
    new_group = dist.new_group
    created = 0

    def counting_new_group(*args: object, **kwargs: object) -> dist.ProcessGroup:
        nonlocal created
        created += 1
        return new_group(*args, **kwargs)

    counts = []
    # torch's averager reaches new_group through distributed_c10d, dcomm's through torch.distributed.
    with (
        mock.patch.object(dist, "new_group", counting_new_group),
        mock.patch.object(dist.distributed_c10d, "new_group", counting_new_group),
    ):
        for _ in range(BUILDS):
            for impl in IMPLS:
                before = created
                variant = build_post_local_sgd(ctx, impl, averaging="hierarchical")
                for _ in range(START_LOCAL_SGD_ITER + PERIOD):  # past the warm-up: every level averages
                    variant.step()
                counts.append(created - before)
    for impl in IMPLS:
        averager = hierarchical_averager(impl, world)
        averager.step = 5
        again = hierarchical_averager(impl, world)
        assert again is averager, impl
        assert again.step == 0, (impl, again.step)
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rebuilt_hierarchical_variants_create_no_new_groups() -> None:
    counts = run_ranks(_groups_created_per_build, 4, timeout=240)
    assert all(c == counts[0] for c in counts), counts  # every rank created the same groups
    first_torch, first_dcomm, *rebuilt = counts[0]
    # {2: 2, 4: 4} at world 4: each averager splits the world into two groups of 2, once.
    assert (first_torch, first_dcomm) == (2, 2), counts[0]
    assert rebuilt == [0] * (len(IMPLS) * (BUILDS - 1)), counts[0]
