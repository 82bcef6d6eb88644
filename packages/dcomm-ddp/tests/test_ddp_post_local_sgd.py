"""Post-local SGD against torch's PostLocalSGDState/hook on 4 gloo ranks in 2 simulated nodes.

Every rank trains on its own batches, so the parameters show which ranks communicated: all
equal before the switch, equal within a node after it (``post_local_gradient_allreduce=True``),
all different without it. dcomm's run must equal torch's bit for bit (the same fp32 arithmetic).
"""

import copy
import os
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_plsgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.ddp import PostLocalSGDState, post_localSGD_hook
from dcomm_testing import (
    BackwardOrderedMLP,
    BucketStub,
    DDPRun,
    assert_close,
    rank_groups,
    run_ranks,
    seeded_batch,
    seeded_mlp,
)

STEPS = 6
START = 3
BUCKET_CAPS = [0.0003] * 8  # several buckets per step: the counter must advance once per step


def batch(step: int) -> torch.Tensor:
    return seeded_batch(dist.get_rank(), step, (5, 6), draw=torch.float32)


class Run(DDPRun):
    """A DDP model, its optimizer, the hook state and an optional torch averager."""

    def __init__(
        self, hook: Callable, state: object, period: int = 0, caps: list | None = BUCKET_CAPS, ordered: bool = False
    ) -> None:
        model = BackwardOrderedMLP(6, 10, 3) if ordered else seeded_mlp(6, 10, 3)
        super().__init__(model, hook, state, batch, bucket_cap_mb_list=caps)
        self.averager = PeriodicModelAverager(period, warmup_steps=START) if period else None

    def step(self, step: int) -> None:
        super().step(step)
        if self.averager is not None:
            self.averager.average_parameters(self.model.parameters())

    def train(self, first: int = 0, last: int = STEPS) -> list[torch.Tensor]:
        return super().train(first, last)

    def checkpoint(self) -> dict:
        return copy.deepcopy(
            {
                "hook": self.state.state_dict(),
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "averager_step": self.averager.step if self.averager else None,
            }
        )


def _switching(rank: int, world: int) -> None:
    nodes = [[0, 1], [2, 3]]
    torch_node, _ = dist.new_subgroups_by_enumeration(nodes)  # torch's default needs GPUs

    for post_local in (True, False):
        ours = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=post_local)
        theirs = torch_plsgd.PostLocalSGDState(None, torch_node, START, post_local)
        if post_local:
            # Built at construction from LOCAL_WORLD_SIZE=2.
            assert dist.get_process_group_ranks(ours.subgroup) == nodes[rank // 2]
        else:
            assert ours.subgroup is None  # never needed, never built
        mine = Run(post_localSGD_hook, ours).train()
        assert_close(mine, Run(torch_plsgd.post_localSGD_hook, theirs).train(), 0.0, f"post_local={post_local}")
        assert ours.iter == STEPS  # keeps counting after the switch
        assert theirs.iter == START  # torch's stops
        assert rank_groups(mine) == (nodes if post_local else [[0], [1], [2], [3]])

        # Stopped before the switch, every rank still agrees: the switch happens at START.
        before = PostLocalSGDState(dist.group.WORLD, None, START, post_local_gradient_allreduce=post_local)
        params = Run(post_localSGD_hook, before).train(last=START)
        assert before.iter == START
        assert rank_groups(params) == [[0, 1, 2, 3]]

    # Local from the first step.
    ours = PostLocalSGDState(None, None, 0)
    theirs = torch_plsgd.PostLocalSGDState(None, torch_node, 0)
    mine = Run(post_localSGD_hook, ours).train()
    assert_close(mine, Run(torch_plsgd.post_localSGD_hook, theirs).train(), 0.0, "start_localSGD_iter=0")
    assert rank_groups(mine) == nodes

    # With torch's periodic averager after each optimizer step, as post-local SGD is meant to run.
    ours = PostLocalSGDState(None, None, START)
    theirs = torch_plsgd.PostLocalSGDState(None, torch_node, START)
    mine = Run(post_localSGD_hook, ours, period=2).train()
    assert_close(mine, Run(torch_plsgd.post_localSGD_hook, theirs, period=2).train(), 0.0, "with averager")

    # Subgroups built lazily, at the first local step inside the hook, on every rank at once.
    lazy = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False)
    lazy.post_local_gradient_allreduce = True
    assert lazy.subgroup is None
    mine = Run(post_localSGD_hook, lazy).train()
    assert dist.get_process_group_ranks(lazy.subgroup) == nodes[rank // 2]
    theirs = torch_plsgd.PostLocalSGDState(None, torch_node, START)
    assert_close(mine, Run(torch_plsgd.post_localSGD_hook, theirs).train(), 0.0, "lazy subgroups")

    # Partial migrations: torch's state with dcomm's hook (its subgroups built from
    # LOCAL_WORLD_SIZE, where torch's hook would need GPUs), dcomm's state with torch's hook.
    reference = Run(torch_plsgd.post_localSGD_hook, torch_plsgd.PostLocalSGDState(None, torch_node, START)).train()
    theirs = torch_plsgd.PostLocalSGDState(None, None, START)
    assert_close(Run(post_localSGD_hook, theirs).train(), reference, 0.0, "torch's state, dcomm's hook")
    assert dist.get_process_group_ranks(theirs.subgroup) == nodes[rank // 2]
    assert theirs.iter == STEPS
    ours = PostLocalSGDState(None, torch_node, START)
    assert_close(Run(torch_plsgd.post_localSGD_hook, ours).train(), reference, 0.0, "dcomm's state, torch's hook")
    assert ours.iter == START  # torch's hook stops counting at the switch

    # The wrong state type: a clear error from backward on every rank, nothing hangs.
    run = Run(post_localSGD_hook, dist.group.WORLD)
    match = r"state: post_localSGD_hook expects a dcomm\.ddp\.PostLocalSGDState or a torch"
    with pytest.raises(Exception, match=match):
        run.step(0)


def test_switches_like_torch() -> None:
    run_ranks(_switching, 4, env={"LOCAL_WORLD_SIZE": "2"})


def _resume(rank: int, world: int) -> None:
    # World 2: a sum of two is the same in any order, any bucket layout resumes exactly.
    # World 4: one bucket whose layout DDP keeps (see dcomm_testing.BackwardOrderedMLP).
    layout = {"caps": BUCKET_CAPS} if world == 2 else {"caps": None, "ordered": True}
    for post_local in (True, False):
        state = PostLocalSGDState(None, None, START, post_local)
        reference = Run(post_localSGD_hook, state, period=3, **layout)
        checkpoints = []
        for step in range(STEPS):
            reference.step(step)
            checkpoints.append(reference.checkpoint())
        final = reference.params()
        assert rank_groups(final) != [list(range(world))]  # the run ended between averages

        for stopped in (1, START - 1, START, STEPS - 2):  # before, at and after the switch
            ckpt = checkpoints[stopped - 1]
            state = PostLocalSGDState(None, None, START, post_local)
            restored = Run(post_localSGD_hook, state, period=3, **layout)
            # After DDP's constructor, which broadcasts rank 0's parameters: replicas differ after
            # local steps, and each rank restores its own.
            restored.model.load_state_dict(ckpt["model"])
            restored.opt.load_state_dict(ckpt["opt"])
            restored.averager.step = ckpt["averager_step"]
            state.load_state_dict(ckpt["hook"])
            assert state.iter == stopped
            assert_close(restored.train(first=stopped), final, 0.0, f"post_local={post_local}, resumed at {stopped}")
            assert state.iter == STEPS


@pytest.mark.parametrize("world", [2, 4])
def test_resume_at_any_step_is_bit_identical(world: int) -> None:
    # World 2 as two one-rank nodes: after the switch nothing is averaged but the model.
    run_ranks(_resume, world, env={"LOCAL_WORLD_SIZE": "1" if world == 2 else "2"})


def _node_size_does_not_divide(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE: 3 does not divide the 4 ranks \[0, 1, 2, 3\]"):
        PostLocalSGDState(None, None, 2)
    # No subgroup needed, none built: constructing is fine.
    assert PostLocalSGDState(None, None, 2, post_local_gradient_allreduce=False).subgroup is None
    # A rank outside the subgroup it is given.
    outside = dist.new_group([0, 1])
    if rank >= 2:
        with pytest.raises(ValueError, match="subgroup: this rank is not a member"):
            PostLocalSGDState(None, outside, 2)
    dist.barrier()  # no rank tears down while the others still connect the new group


def test_node_size_must_divide_world() -> None:
    run_ranks(_node_size_does_not_divide, 4, env={"LOCAL_WORLD_SIZE": "3"})


def _node_sizes_disagree(rank: int, world: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "4"
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE: the ranks disagree \(2 on ranks \[0, 1\], 4 on"):
        PostLocalSGDState(None, None, 2)


@pytest.mark.timeout(300)
def test_node_sizes_that_disagree_raise_on_every_rank() -> None:
    """Once silently corrupting: ranks 0-1 built pairs, ranks 2-3 one group of 4."""
    run_ranks(_node_sizes_disagree, 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"start_localSGD_iter": -1}, ValueError, r"start_localSGD_iter: expected a non-negative int, got -1; pass"),
        ({"start_localSGD_iter": 2.5}, TypeError, r"start_localSGD_iter: expected a non-negative int, got 2\.5"),
        ({"start_localSGD_iter": True}, TypeError, r"start_localSGD_iter: expected a non-negative int, got True"),
        ({"start_localSGD_iter": "10"}, TypeError, r"start_localSGD_iter: expected a non-negative int, got '10'"),
        ({"post_local_gradient_allreduce": "yes"}, TypeError, r"post_local_gradient_allreduce: expected True or False"),
        ({"process_group": 3}, TypeError, r"process_group: expected a ProcessGroup or None, got int; pass"),
        ({"subgroup": "node"}, TypeError, r"subgroup: expected a ProcessGroup or None, got str; pass"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    args = {"process_group": None, "subgroup": None, "start_localSGD_iter": 3} | kwargs
    with pytest.raises(error, match=match):
        PostLocalSGDState(**args)


def test_state_dict_round_trip_and_bad_state_dicts() -> None:
    state = PostLocalSGDState(None, None, 5, post_local_gradient_allreduce=False)
    state.iter = 7
    saved = state.state_dict()
    assert saved == {"iter": 7, "start_localSGD_iter": 5, "post_local_gradient_allreduce": False}
    fresh = PostLocalSGDState(None, None, 5, post_local_gradient_allreduce=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(saved)
    assert (fresh.iter, fresh.start_localSGD_iter, fresh.post_local_gradient_allreduce) == (7, 5, False)
    assert "iter=7" in repr(fresh)
    with pytest.raises(AttributeError):
        fresh.unknown = 1  # __slots__

    # A differing schedule is the averagers' policy: the constructed one stays, and a warning says so.
    other = PostLocalSGDState(None, None, 3, post_local_gradient_allreduce=False)
    with pytest.warns(UserWarning, match=r"saved start_localSGD_iter=5 differs from this PostLocalSGDState's .*=3"):
        other.load_state_dict(saved)
    assert (other.iter, other.start_localSGD_iter) == (7, 3)

    fresh.iter = 4
    for bad, error, match in [
        ([7, 5, False], TypeError, "state_dict: expected the mapping PostLocalSGDState.state_dict"),
        ({"start_localSGD_iter": 5}, ValueError, r"state_dict: missing keys \['iter'\]"),
        (saved | {"iter": -2}, ValueError, r"state_dict\['iter'\]: expected a non-negative int, got -2"),
        (saved | {"iter": torch.tensor(3)}, TypeError, r"state_dict\['iter'\]: expected a non-negative int"),
        (saved | {"iter": "3"}, TypeError, r"state_dict\['iter'\]: expected a non-negative int, got '3'"),
    ]:
        with pytest.raises(error, match=match):
            fresh.load_state_dict(bad)
        assert fresh.iter == 4  # a rejected load changes nothing


def test_hook_rejects_other_states() -> None:
    match = (
        r"state: post_localSGD_hook expects a dcomm.ddp.PostLocalSGDState or a "
        r"torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook.PostLocalSGDState, got "
        r"builtins.NoneType \(no process_group, subgroup, .*maybe_increase_iter\)"
    )
    with pytest.raises(TypeError, match=match):
        post_localSGD_hook(None, None)  # type: ignore[arg-type]


def test_maybe_increase_iter_counts_last_buckets_like_torch() -> None:
    ours = PostLocalSGDState(None, None, 2, False)
    theirs = torch_plsgd.PostLocalSGDState(None, None, 2, False)
    for last in (False, True, False, True, True):
        ours.maybe_increase_iter(BucketStub(last))
        theirs.maybe_increase_iter(BucketStub(last))
        assert ours.iter == theirs.iter
    assert ours.iter == 3


def test_public_attributes_match_torch() -> None:
    ours = PostLocalSGDState(None, None, 4, False)
    theirs = torch_plsgd.PostLocalSGDState(None, None, 4, False)
    for name in ("process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce", "iter"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_construction_without_process_group_defers_subgroups() -> None:
    # No default group yet: nothing is built until the first local step.
    assert not dist.is_initialized()
    assert PostLocalSGDState(None, None, 3).subgroup is None


def _gpu0_current_on_every_rank(rank: int, world: int) -> list[bool]:
    # As torch's own tests run: GPU 0 current on every rank, rank r's model on GPU r. Building the
    # node subgroups (at construction, or in the hook) must agree through GPU r.
    torch.cuda.set_device(0)
    eager = PostLocalSGDState(None, None, 2)
    lazy = PostLocalSGDState(None, None, 2, post_local_gradient_allreduce=False)
    lazy.post_local_gradient_allreduce = True  # its subgroups are built in the hook, at step 2
    same = []
    for state in (eager, lazy):
        module = torch.nn.Linear(1, 5).to(rank)
        hooked = DDP(copy.deepcopy(module), device_ids=[rank])
        hooked.register_comm_hook(state, post_localSGD_hook)
        plain = DDP(copy.deepcopy(module), device_ids=[rank])
        for _ in range(4):
            batch = torch.tensor([float(rank)], device=rank)
            for model in (hooked, plain):
                model.zero_grad()
                model(batch).sum().backward()
            same.append(torch.equal(hooked.module.weight.grad, plain.module.weight.grad))
        same.append(dist.get_process_group_ranks(state.subgroup) == list(range(world)))
    return same


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_subgroups_on_nccl_agree_through_the_models_gpu_not_the_current_one() -> None:
    assert run_ranks(_gpu0_current_on_every_rank, 2, backend="nccl", timeout=120) == [[True] * 10] * 2
