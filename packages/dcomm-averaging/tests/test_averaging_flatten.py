"""flatten_parameters: a module's parameters as views of one buffer per device and dtype.

Checked here: values, shapes, strides and identities kept, tied weights placed once, one buffer
per dtype in order, training unchanged bit for bit, bad modules refused with nothing changed, and
average_parameters' in-place path (forced on gloo) sending each buffer as one tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dcomm.averaging._in_place as in_place
import dcomm.averaging._recipes as recipes
import dcomm.averaging.parameters as impl
from dcomm.averaging import flatten_parameters
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


def _one_message(rank: int, world: int) -> None:
    # average_parameters' in-place path (NCCL's, forced here on gloo) joins a flattened model's
    # parameters into one tensor per dtype, and averages them right.
    model = _Mixed()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(rank)
    expected = [p.detach().double() - rank + (world - 1) / 2 for p in model.parameters()]
    flatten_parameters(model)
    seen: list[list[torch.Tensor]] = []
    paths = recipes._Paths(True, in_place._LAUNCH_MAX_TENSORS, seen.append, 0)
    impl._average_parameters(model.parameters(), None, impl.DEFAULT_BUCKET_CAP_MB, paths)
    sizes = [[t.numel() for t in tensors] for tensors in seen]
    assert sizes == [[179], [10]], sizes  # float32: MLP 92, convolution 57, embedding 30; float64: 10
    for param, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach().double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_average_parameters_sends_one_tensor_per_buffer(world: int) -> None:
    run_ranks(_one_message, world, timeout=120)
