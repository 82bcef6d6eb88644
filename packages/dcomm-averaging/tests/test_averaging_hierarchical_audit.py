"""HierarchicalModelAverager against torch's: uneven parameter layouts and a resume mid-period after warm-up.

Uneven layouts: fp32 and fp64 parameters mixed, parameters that are views of one flat buffer, and
param groups holding a frozen parameter (no gradient). The resume saves and loads the averager's
state between two averaging steps, with three levels (one of group size 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hier

from dcomm.averaging import HierarchicalModelAverager
from dcomm_testing import run_ranks


def _param(values: list[float], dtype: torch.dtype = torch.float64, grad: bool = True) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor(values, dtype=dtype))
    if grad:
        p.grad = torch.zeros_like(p)
    return p


def _uneven_parameters(rank: int, world: int) -> None:
    """Mixed dtypes, views of one flat buffer, frozen parameters: against torch and an fp64 reference."""
    sizes = {2: 1, 3: world}  # steps 0 and 3: everyone; step 2: groups of 1 (no change); step 1: none
    ours = HierarchicalModelAverager(sizes)
    theirs = torch_hier.HierarchicalModelAverager(sizes)

    def values(r: int, step: int) -> list[float]:
        return [(r + 1) * (i + 1) / 8 + step for i in range(10)]

    for step in range(4):
        flat = torch.tensor(values(rank, step), dtype=torch.float64)
        views = [torch.nn.Parameter(flat[:4]), torch.nn.Parameter(flat[4:])]  # share flat's storage
        single = _param(values(rank, step)[:3], torch.float32)
        frozen = _param(values(rank, step)[3:], grad=False)
        for v in views:
            v.grad = torch.zeros_like(v)
        ref = [_param(values(rank, step)[:4]), _param(values(rank, step)[4:]), single.detach().clone(), frozen]
        ref[2] = _param(values(rank, step)[:3], torch.float32)
        ref[3] = _param(values(rank, step)[3:], grad=False)
        ours.average_parameters([{"params": [views[0], single]}, {"params": [frozen, views[1]]}])
        theirs.average_parameters([{"params": ref[:3:2]}, {"params": ref[3:0:-2]}])
        mean = [sum(values(r, step)[i] for r in range(world)) / world for i in range(10)]
        expected = torch.tensor(mean if step % 3 == 0 else values(rank, step), dtype=torch.float64)
        torch.testing.assert_close(flat, expected, rtol=0, atol=1e-12)
        assert views[0].data_ptr() == flat.data_ptr()  # the views still share the flat buffer
        assert single.dtype == torch.float32
        torch.testing.assert_close(single.double(), expected[:3], rtol=1e-6, atol=0)
        assert torch.equal(frozen, torch.tensor(values(rank, step)[3:], dtype=torch.float64))  # grad None
        assert torch.equal(torch.cat([views[0], views[1]]), torch.cat([ref[0], ref[1]]))  # fp64: as torch
        torch.testing.assert_close(single, ref[2], rtol=1e-6, atol=0)
        assert torch.equal(frozen, ref[3])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(120)
def test_uneven_parameters_match_torch(world: int) -> None:
    run_ranks(_uneven_parameters, world, timeout=60)


def _resume_mid_period(rank: int, world: int) -> None:
    sizes = {2: 2, 3: 1, 4: 4}
    warmup = 5
    uninterrupted = HierarchicalModelAverager(sizes, warmup)
    theirs = torch_hier.HierarchicalModelAverager(sizes, warmup)
    first = HierarchicalModelAverager(sizes, warmup)
    resumed = HierarchicalModelAverager(sizes, warmup)
    for step in range(14):
        if step == 7:  # mid-period: after step 6 (period 3) and before 8 (period 4)
            state = first.state_dict()
            assert state == {"step": 7, "period_group_size_dict": sizes, "warmup_steps": warmup}
            resumed.load_state_dict(state)
        current = first if step < 7 else resumed
        results = []
        for averager in (uninterrupted, theirs, current):
            p = _param([float(rank * 3 + step)])
            averager.average_parameters([p])
            results.append(p.item())
        assert results[0] == results[1] == results[2], (step, results)
        period = next((q for q in (4, 3, 2) if step % q == 0), None)  # the largest dividing the step
        averages = step >= warmup and period is not None and sizes[period] > 1
        assert (results[0] != rank * 3 + step) == averages, step


@pytest.mark.timeout(120)
def test_resume_mid_period_after_warmup_matches_torch() -> None:
    run_ranks(_resume_mid_period, 4, timeout=60)


def _world_still_in_step(world: int) -> None:
    """A group over the whole world is created and used: no rank created a group the others did not."""
    everyone = dist.new_group(list(range(world)))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    assert total.item() == world


def _subgroup_splits_refused(rank: int, world: int) -> None:
    # One group of half the ranks, created on every rank; its members ask for smaller groups.
    half = dist.new_group(list(range(world // 2)))
    if rank < world // 2:
        with pytest.raises(ValueError, match=rf"^process_group: its {world // 2} of the {world} ranks cannot be split"):
            HierarchicalModelAverager({1: 1, 2: world // 2}, process_group=half)
        # Sizes equal to the group's: nothing to create, it averages within the group.
        averager = HierarchicalModelAverager({1: world // 2}, process_group=half)
        param = _param([float(rank), 2.0 * rank])
        averager.average_parameters([param])
        mean = (world // 2 - 1) / 2
        assert torch.equal(param.detach(), torch.tensor([mean, 2 * mean], dtype=torch.float64))
    else:
        with pytest.raises(ValueError, match=r"^process_group: this rank \(\d\) is not a member"):
            HierarchicalModelAverager({1: 1, 2: world // 2}, process_group=half)
    # Each rank its own subgroup (dist.new_subgroups): every rank refuses.
    mine, _ = dist.new_subgroups(world // 2)
    with pytest.raises(ValueError, match=r"^process_group: its 2 of the 4 ranks cannot be split into groups of \[1\]"):
        HierarchicalModelAverager({1: 1, 2: world // 2}, process_group=mine)
    _world_still_in_step(world)


@pytest.mark.timeout(120)
def test_subgroups_of_a_smaller_process_group_refused_on_every_member() -> None:
    run_ranks(_subgroup_splits_refused, 4, timeout=60)
