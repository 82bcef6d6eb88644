"""A simulated 2-node layout on one host: the groups dcomm derives from ``LOCAL_WORLD_SIZE``.

torchrun on one host sets ``LOCAL_WORLD_SIZE`` to the whole world, so these scenarios set it to
half the world themselves, as a 2-node launch would, and check that dcomm's intra-node groups,
post-local SGD with ``subgroup=None`` and a hierarchical averager all act on the two halves:
against torch's post-local SGD given the same halves explicitly, and against float64 means.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from harness import device, scenario
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_plsgd

from dcomm.averaging import HierarchicalModelAverager
from dcomm.core import intra_node_subgroups
from dcomm.ddp import PostLocalSGDState, post_localSGD_hook
from dcomm_testing import seeded_mlp, seeded_normal, train_ddp

STEPS = 5
START = 2


@contextlib.contextmanager
def _nodes_of(size: int) -> Iterator[None]:
    """``LOCAL_WORLD_SIZE`` as a launch with ``size`` ranks per node would set it."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(size)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def _train(hook, state) -> list[torch.Tensor]:
    rank = dist.get_rank()

    def batch(step: int) -> torch.Tensor:
        return seeded_normal(1_000 * step + rank, (6, 8), scale=rank + 1, draw=torch.float32).to(device())

    model = seeded_mlp(8, 16, 4, device=device())
    params = train_ddp(model, hook, state, batch, STEPS, lr=0.1, momentum=0.0, loss=lambda out: out.square().mean())
    return [p.cpu() for p in params]


@scenario(min_world_size=4, world_size_multiple=2)
def scenario_two_node_layout(rank: int, world_size: int) -> None:
    per_node = world_size // 2
    node_ranks = list(range(rank // per_node * per_node, (rank // per_node + 1) * per_node))
    with _nodes_of(per_node):
        mine, groups = intra_node_subgroups()
        assert dist.get_process_group_ranks(mine) == node_ranks
        assert len(groups) == 2

        # Post-local SGD, subgroup=None: after the switch, gradients are averaged within the node.
        state = PostLocalSGDState(None, None, START)
        assert dist.get_process_group_ranks(state.subgroup) == node_ranks
        ours = _train(post_localSGD_hook, state)
        theirs = _train(torch_plsgd.post_localSGD_hook, torch_plsgd.PostLocalSGDState(None, mine, START))
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # Replicas agree inside a node and differ across nodes (local steps diverged).
        local = ours[0].to(device())
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        gathered = [g.cpu() for g in gathered]
        assert all(torch.equal(gathered[r], gathered[node_ranks[0]]) for r in node_ranks)
        other = (node_ranks[0] + per_node) % world_size
        assert not torch.equal(gathered[other], gathered[node_ranks[0]])

        # A hierarchical averager over the same halves: step 1 averages within the node only.
        averager = HierarchicalModelAverager({1: per_node, 2: world_size})
        averager.step = 1
        values = {r: torch.arange(5, dtype=torch.float64) * (r + 1) for r in range(world_size)}
        param = nn.Parameter(values[rank].float().to(device()))
        param.grad = torch.zeros_like(param)
        averager.average_parameters([param])
        expected = torch.stack([values[r] for r in node_ranks]).mean(0)
        torch.testing.assert_close(param.detach().double().cpu(), expected, rtol=1e-6, atol=1e-6)
