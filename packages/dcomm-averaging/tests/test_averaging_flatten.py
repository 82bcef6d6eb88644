"""flatten_parameters: a module's parameters as views of one buffer per device and dtype.

Checked here: values, shapes, strides and identities kept, tied weights placed once, one buffer
per dtype in order, training unchanged bit for bit, bad modules refused with nothing changed, and
average_parameters on a flattened model equal to torch's on the same model not flattened (that a
flattened model is one allreduce per buffer is checked in test_averaging_buckets).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils as torch_utils
from torch import nn

from dcomm.averaging import average_parameters, flatten_parameters
from dcomm_testing import run_ranks, seeded_mlp, seeded_normal


class _Mixed(nn.Module):
    """An MLP, a channels-last convolution, a float64 layer and a weight used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = seeded_mlp(6, 8, 4)
        self.conv = nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last)
        self.precise = nn.Linear(4, 2, dtype=torch.float64)
        self.embed = nn.Embedding(5, 6)
        self.head = nn.Linear(6, 5, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = self.mlp(self.embed(ids)).sum(1)
        y = self.conv(image).mean((2, 3)).sum(1, keepdim=True)
        z = self.precise(x.double()).float().sum(1, keepdim=True)
        return self.head(self.embed(ids)).sum() + (x * y + z).sum()


def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(6).remainder(5).view(2, 3) + step % 2
    image = seeded_normal(step, (2, 2, 5, 5), draw=torch.float32).contiguous(memory_format=torch.channels_last)
    return ids.remainder(5), image


def test_views_of_one_buffer_per_dtype_with_everything_kept() -> None:
    model = _Mixed()
    before = {name: (p, p.detach().clone(), p.stride()) for name, p in model.named_parameters()}
    buffers = flatten_parameters(model)
    assert [(b.dtype, b.numel()) for b in buffers] == [
        (torch.float32, sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)),
        (torch.float64, 4 * 2 + 2),
    ]
    offset = {torch.float32: 0, torch.float64: 0}
    flat_of = {b.dtype: b for b in buffers}
    for name, param in model.named_parameters():
        same, values, stride = before[name]
        assert param is same, name
        assert torch.equal(param, values), name
        assert param.stride() == stride, name  # channels-last stays channels-last
        flat = flat_of[param.dtype]
        assert param.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), name
        assert param.storage_offset() == offset[param.dtype], name  # registration order, back to back
        offset[param.dtype] += param.numel()
    assert model.head.weight is model.embed.weight  # the tied weight kept its one place


def test_training_is_unchanged_bit_for_bit() -> None:
    runs = []
    for flatten in (False, True):
        model = _Mixed()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # built before: still right
        if flatten:
            flatten_parameters(model)
        for step in range(4):
            optimizer.zero_grad()
            model(*_inputs(step)).backward()
            optimizer.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_bad_modules_are_refused_with_nothing_changed() -> None:
    with pytest.raises(ValueError, match="module: it has no parameters to flatten"):
        flatten_parameters(nn.ReLU())
    with pytest.raises(ValueError, match="module: a parameter of shape \\(3, 4\\) is on the meta device"):
        flatten_parameters(nn.Linear(4, 3, device="meta"))
    model = nn.Linear(4, 3)
    bias = model.bias.data
    model.weight.data = torch.zeros(1, 4).expand(3, 4)  # overlapping rows
    with pytest.raises(ValueError, match="has gaps or overlaps in memory; make it contiguous first"):
        flatten_parameters(model)
    assert model.bias.data.data_ptr() == bias.data_ptr()


def _flattened_against_torch(rank: int, world: int) -> None:
    ours, theirs = _Mixed(), _Mixed()
    with torch.no_grad():
        for mine, twin in zip(ours.parameters(), theirs.parameters(), strict=True):
            mine.add_(rank)
            twin.add_(rank)
    flatten_parameters(ours)
    average_parameters(ours.parameters(), None)
    torch_utils.average_parameters(theirs.parameters(), dist.group.WORLD)
    for mine, twin in zip(ours.parameters(), theirs.parameters(), strict=True):
        # fp32 and fp64 parameters: torch averages the list in float64, as dcomm does.
        assert mine.dtype == twin.dtype
        if world == 2:
            assert torch.equal(mine, twin)
        torch.testing.assert_close(mine, twin, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_flattened_model_averaged_as_torch_averages_it(world: int) -> None:
    run_ranks(_flattened_against_torch, world, timeout=120)
