"""Post-local SGD training: dcomm's averagers and optimizer against torch's, and resume.

Both sides train the same DDP model (torch's ``post_localSGD_hook`` on the DDP side) on the same
per-rank data in the same processes. fp32 parameters in one bucket average with torch's exact
arithmetic, so parameters must be bit-identical after every step (tolerance 0). A resumed run
must be bit-identical to the uninterrupted one from the restore on.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

import dcomm.averaging as ours_lib
from dcomm.core import intra_node_subgroups
from dcomm_testing import PostLocalSGDRun, implementation, run_ranks

WARMUP = 3
STEPS = 10
RESUME_AT = [1, 3, 4, 7]


def variants(world: int) -> list[tuple[str, Callable[[Any], Any], bool]]:
    """(name, averager factory taking a library, whether PostLocalSGDOptimizer drives it)."""
    return [
        ("periodic", lambda lib: lib.PeriodicModelAverager(period=3, warmup_steps=WARMUP), True),
        ("2-level", lambda lib: lib.HierarchicalModelAverager({2: world // 2, 4: world}, WARMUP), False),
        ("3-level", lambda lib: lib.HierarchicalModelAverager({2: 1, 3: world // 2, 4: world}, WARMUP), True),
    ]


def _training(rank: int, world: int) -> None:
    subgroup, _ = intra_node_subgroups()
    for name, factory, wrapped in variants(world):
        # The run's one parameter (layers=1): a freshly built DDP reduces its first gradient bucket in a different
        # layout than a DDP that has rebuilt its buckets, and gloo's sum order follows the layout;
        # with several parameters a resumed run's first warm-up step would differ in the last bit
        # on 4 ranks, through torch's DDP, not the averager. Several parameters, param groups and
        # dtypes are averaged against torch in test_averaging_parameters.py.
        def run(side: str, seed: int = 0, factory=factory, wrapped=wrapped) -> PostLocalSGDRun:
            return PostLocalSGDRun(implementation(side), factory, subgroup, warmup=WARMUP, wrapped=wrapped, seed=seed)

        theirs, ours = run("torch"), run("dcomm")
        history: list[list[torch.Tensor]] = []
        checkpoints: dict[int, bytes] = {}
        ranks_disagreed = False
        for step in range(STEPS):
            if step in RESUME_AT:
                checkpoints[step] = ours.checkpoint()
            theirs.step(rank, step)
            ours.step(rank, step)
            history.append(ours.params())
            for a, b in zip(ours.params(), theirs.params(), strict=True):
                assert torch.equal(a, b), f"{name}: step {step} differs from torch"
            assert ours.averager.step == theirs.averager.step == step + 1
            spread = torch.stack([p.sum() for p in ours.params()]).sum().reshape(1)
            gathered = [torch.empty(1) for _ in range(world)]
            dist.all_gather(gathered, spread)
            ranks_disagreed |= len({g.item() for g in gathered}) > 1
        assert ranks_disagreed, f"{name}: ranks never diverged, so averaging was never tested"

        # Resume at several steps into fresh objects built from another seed.
        ours.assert_resumes(functools.partial(run, "dcomm", seed=99), rank, checkpoints, history, name)


@pytest.mark.parametrize("world", [2, 4])
def test_post_local_sgd_training_matches_torch_and_resumes(world: int) -> None:
    run_ranks(_training, world, env={"LOCAL_WORLD_SIZE": str(world // 2)}, timeout=240)


def _optimizer_api(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    head = torch.nn.Linear(2, 1)
    local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    opt = ours_lib.PostLocalSGDOptimizer(local, ours_lib.PeriodicModelAverager(2))
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is local.param_groups
    assert opt.state is local.state
    assert opt.defaults is local.defaults
    assert repr(opt) == repr(local)
    opt.add_param_group({"params": head.parameters(), "lr": 0.2})
    assert len(local.param_groups) == 2

    def closure() -> float:
        opt.zero_grad()
        x = torch.full((1, 3), float(rank + 1))
        loss = head(model(x)).sum()
        loss.backward()
        return loss.item()

    loss = opt.step(closure)
    assert isinstance(loss, float)
    assert opt.averager.step == 1
    opt.zero_grad()
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])
    opt.step()  # no closure, no gradients: SGD skips, the averager still counts
    assert opt.averager.step == 2

    # The "step" key moves both ways between dcomm's and torch's optimizers.
    state = opt.state_dict()
    assert state["step"] == 2
    twin = TorchPostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), torch_averagers.PeriodicModelAverager(2)
    )
    twin.add_param_group({"params": head.parameters(), "lr": 0.2})
    twin.load_state_dict(state)
    assert twin.averager.step == 2
    back = ours_lib.PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), ours_lib.PeriodicModelAverager(2)
    )
    back.add_param_group({"params": head.parameters(), "lr": 0.2})
    twin.averager.step = 5
    back.load_state_dict(twin.state_dict())
    assert back.averager.step == 5

    # Without "step": the same warning as torch, and the averager starts from 0.
    without = {k: v for k, v in state.items() if k != "step"}

    def caught(optimizer: Any) -> list[tuple[type[Warning], str]]:
        optimizer.averager.step = 7
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            optimizer.load_state_dict(dict(without))
        assert optimizer.averager.step == 0
        return [(w.category, str(w.message)) for w in seen]

    assert caught(back)
    assert caught(back) == caught(twin)
    # A bad "step" is refused before anything is loaded: optimizer state and averager unchanged.
    back.averager.step = 5
    before = back.optim.state_dict()
    for bad, error in [(-3, ValueError), ("3", TypeError), (torch.tensor(3), TypeError)]:
        changed = {**state, "param_groups": [{**g, "lr": 9.0} for g in state["param_groups"]], "step": bad}
        with pytest.raises(error, match=r"state_dict\['step'\]: expected a non-negative int"):
            back.load_state_dict(changed)
        assert back.averager.step == 5
        assert back.optim.state_dict()["param_groups"] == before["param_groups"]


def test_post_local_sgd_optimizer_api() -> None:
    run_ranks(_optimizer_api, 2)
