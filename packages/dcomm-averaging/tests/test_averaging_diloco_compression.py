"""DiLoCo's compressed pseudo-gradients: accuracy, error feedback, identical replicas, bytes.

The exchange is fed the same per-rank vectors sync after sync. Rounding to the nearest code is
deterministic, so without error feedback every sync would make the same error and the
cumulative error would grow linearly with the number of syncs; with it the cumulative error
stays within a couple of single-sync errors. Training with a compressed pseudo-gradient stays
within a stated relative distance of the uncompressed run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_averaging_diloco import STEPS, backward, make_model, make_optimizers

from dcomm.averaging import DiLoCoOptimizer
from dcomm.averaging._diloco.exchange import BLOCK_SIZE, PseudoGradientExchange
from dcomm.core import payload_bytes
from dcomm_testing import run_ranks, spread_normal
from dcomm_testing.marks import ON_GLOO_AND_NCCL

FORMATS = ["bf16", "fp8", "int8", "int4"]
# Largest error of one sync, relative to the largest |mean|, for vectors of mixed magnitudes.
ONE_SYNC_RTOL = {"bf16": 1e-2, "fp8": 0.1, "int8": 2e-2, "int4": 0.3}
# Largest parameter difference after 13 steps of training (3 syncs), relative to the largest |parameter|.
TRAINING_RTOL = {"bf16": 1e-3, "fp8": 1e-2, "int8": 2e-3, "int4": 2e-2}
SYNCS = 20


def rank_vector(rank: int, numel: int) -> torch.Tensor:
    return spread_normal(rank, numel, (-3, 1), scale=rank + 1, shuffle=False)


def _error_feedback(rank: int, world: int) -> None:
    numel = 1000  # not a whole number of blocks or chunks
    mean = sum(rank_vector(r, numel).double() for r in range(world)) / world
    scale = mean.abs().max().item()
    for fmt in FORMATS:
        exchange = PseudoGradientExchange(dist.group.WORLD, fmt)
        feedback = exchange.new_feedback(numel, torch.device("cpu"))
        total = torch.zeros(numel, dtype=torch.float64)
        errors = []
        for _ in range(SYNCS):
            out = exchange.start(rank_vector(rank, numel), feedback).result()
            gathered = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(gathered, out)
            assert all(torch.equal(g, out) for g in gathered), f"{fmt}: ranks got different averages"
            total += out.double()
            errors.append((total - mean * (len(errors) + 1)).abs().max().item())
        first = errors[0]
        assert 0 < first <= ONE_SYNC_RTOL[fmt] * scale, f"{fmt}: one sync off by {first / scale:.3g} of the scale"
        assert max(errors) <= 2.5 * first, f"{fmt}: cumulative error grew to {max(errors) / first:.2f}x one sync's"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_keeps_the_cumulative_error_bounded(world: int) -> None:
    run_ranks(_error_feedback, world, timeout=240)


def _training(rank: int, world: int) -> None:
    final = {}
    for compression in [None, *FORMATS]:
        model = make_model(rank, torch.float32)
        opt = DiLoCoOptimizer(*make_optimizers(model), 4, None, 2, 1, compression)
        for step in range(1, STEPS + 1):
            backward(model, rank, step)
            opt.step()
            opt.zero_grad()
        final[compression] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        numel = final[compression].numel()
        syncs = STEPS // 4 * 2  # two fragments, each once per period
        if compression is not None:
            chunks = [-(-n // (world * BLOCK_SIZE)) * BLOCK_SIZE for n in (36, 24)]  # the two fragments
            row = [payload_bytes(c, compression) if compression != "bf16" else 2 * c for c in chunks]
            assert opt.bytes_sent == syncs // 2 * sum(2 * (world - 1) * r for r in row), compression
    reference = final[None]
    assert reference.numel() == numel == 60
    for fmt in FORMATS:
        distance = (final[fmt] - reference).abs().max().item() / reference.abs().max().item()
        assert 0 < distance <= TRAINING_RTOL[fmt], f"{fmt}: {distance:.3g} of the largest parameter"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_compressed_training_stays_close_to_uncompressed(world: int) -> None:
    run_ranks(_training, world, timeout=240)


class Shapes(torch.nn.Module):
    """A channels-last conv weight (4-D, permuted strides), a 0-dim scale, a bias and a 3-D tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.mix = torch.nn.Parameter(torch.randn(2, 5, 5) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).mean(dim=(2, 3))
        return (self.scale * torch.einsum("bi,kij->bkj", y, self.mix)).flatten(1)


def _any_shape(rank: int, world: int, device_type: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    finals = {}
    for compression in (None, "int4"):
        torch.manual_seed(rank)
        model = Shapes().to(device)
        inner = torch.optim.AdamW(model.parameters(), lr=0.02)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        opt = DiLoCoOptimizer(inner, outer, 3, None, 2, 0, compression)
        for step in range(1, 10):
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(4, 3, 6, 6, generator=gen).to(device, memory_format=torch.channels_last)
            (model(x) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            params = list(model.parameters())
            assert opt._offsets == [1, 0]  # fragment 0 syncs at steps 1, 4, 7; fragment 1 at 3, 6, 9
            synced = {1: 0, 0: 1}.get(step % 3)
            for fragment, members in enumerate(opt._fragments):
                flat = torch.cat([params[j].detach().reshape(-1) for j in members])
                gathered = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(gathered, flat)
                same = all(torch.equal(g, flat) for g in gathered)
                assert same == (fragment == synced), f"{compression}, step {step}, fragment {fragment}: {same}"
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
        finals[compression] = flat.cpu()
    distance = (finals["int4"] - finals[None]).abs().max() / finals[None].abs().max()
    assert 0 < distance <= TRAINING_RTOL["int4"], f"int4 is {distance:.3g} of the largest parameter away"


@pytest.mark.timeout(300)
@ON_GLOO_AND_NCCL
def test_compressed_sync_of_any_shape_and_layout(device_type: str, backend: str) -> None:
    run_ranks(_any_shape, 2, device_type, backend=backend, timeout=240)
