"""Misuse of average_parameters and the averagers: refused on every rank, before any value changes.

Each check was a defect: integer buffers raised after the float ones were averaged, an empty
parameter list returned at once while the peers waited in the allreduce, a meta tensor was
skipped in silence, a sparse parameter reported "gaps or overlaps", and a group excluding this
rank reported "world size -1".
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils as torch_utils

from dcomm.averaging import HierarchicalModelAverager, average_parameters
from dcomm.core import DefaultState
from dcomm_testing import run_ranks, seeded_batch


def _batchnorm_model(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    for step in range(rank + 1):  # num_batches_tracked differs between ranks (1, 2, 3, ...)
        model(seeded_batch(rank, step, (5, 4)))
    return model


def _integer_buffers(rank: int, world: int) -> None:
    ours, theirs = _batchnorm_model(rank), _batchnorm_model(rank)
    tracked = ours[1].num_batches_tracked
    average_parameters([*ours.parameters(), *ours.buffers()], None)
    torch_utils.average_parameters(iter([*theirs.parameters(), *theirs.buffers()]), dist.group.WORLD)
    assert ours[1].num_batches_tracked is tracked
    assert tracked.dtype == torch.int64
    # As torch: the counts averaged in floating point and truncated toward zero. dcomm averages them
    # in float64, so the mean of (1, ..., world) is exact; torch's float32 division by 3 may land
    # just below 2 and truncate to 1.
    theirs_count = theirs[1].num_batches_tracked.item()
    assert tracked.item() == int((world + 1) / 2), (tracked.item(), theirs_count)
    assert abs(tracked.item() - theirs_count) <= 1
    for mine, ref in zip([*ours.parameters(), *ours.buffers()], [*theirs.parameters(), *theirs.buffers()], strict=True):
        assert mine.dtype == ref.dtype
        torch.testing.assert_close(mine.double(), ref.double(), rtol=1e-6, atol=1e-6)
    # Integer tensors alone are averaged the same way.
    counts = [torch.tensor([2 * rank + 1, 7], dtype=torch.int32)]
    average_parameters(counts, None)
    assert counts[0].tolist() == [int(sum(2 * r + 1 for r in range(world)) / world), 7]


def _refused_before_any_collective(rank: int, world: int) -> None:
    good = torch.nn.Parameter(torch.full((3,), float(rank)))
    # An empty list raises (as torch does), on every rank: its peers learn of it in their check.
    with pytest.raises(ValueError, match=rf"^params: got no parameters to average; .*\(found on rank {world - 1};"):
        average_parameters([] if rank == world - 1 else [good], None)
    bad_cases = [
        (torch.empty(2, device="meta"), r"^params: a parameter of shape \(2,\) is on the meta device"),
        (torch.zeros(4).to_sparse(), r"^params: a parameter of shape \(4,\) has the torch.sparse_coo layout"),
    ]
    for bad, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            average_parameters([good, bad], None)
        assert torch.equal(good, torch.full((3,), float(rank))), "a parameter was averaged before the error"
    # A strided layout with gaps is refused by the checks of the whole call, before any device's
    # parameters are averaged (with several devices, one was averaged before the error).
    gapped = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match=r"^params: a parameter of shape \(4, 3\) and strides \(6, 2\) has gaps"):
        average_parameters([good, gapped], None)
    assert torch.equal(good, torch.full((3,), float(rank))), "a parameter was averaged before the error"
    # Still in step: a real average after the refusals.
    average_parameters([good], None)
    assert torch.equal(good, torch.full((3,), (world - 1) / 2))


def _group_without_this_rank(rank: int, world: int) -> None:
    group = dist.new_group([0])
    if rank == 0:
        assert DefaultState(group).world_size == 1
        return
    with pytest.raises(ValueError, match=r"^process_group: this rank \(\d\) is not a member of the group; build"):
        DefaultState(group)
    with pytest.raises(ValueError, match=r"^process_group: this rank \(\d\) is not a member of the group; build"):
        HierarchicalModelAverager({1: 1, 2: 1}, process_group=group)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(300)
def test_integer_buffers_averaged_as_torch_does(world: int) -> None:
    run_ranks(_integer_buffers, world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(300)
def test_bad_parameters_refused_before_any_collective(world: int) -> None:
    run_ranks(_refused_before_any_collective, world)


@pytest.mark.timeout(300)
def test_group_without_this_rank_named() -> None:
    run_ranks(_group_without_this_rank, 2)
