"""fully_shard (FSDP2) with dcomm's int8/fp8 reduce-scatter, on gloo, against float64 references.

The reduce-scatter itself is checked value by value against the exact float64 average of every
rank's chunk (bound: the ranks' mean rounding error of their blocks); a nested ``fully_shard``
model's first-step gradients against the float64 mean of all ranks' gradients (bound: one
quantization step of the largest local gradient value). Everything on CPU meshes (see
test_fsdp_fully_shard.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from dcomm.fsdp import QuantizedReduceScatter, use_quantized_reduction
from dcomm_testing import quantization_half_step, run_ranks, seeded_mlp, seeded_pair, spread_normal

TIMEOUT = 240.0
BLOCK = 16


def chunk_data(rank: int, numel: int) -> torch.Tensor:
    return spread_normal(rank, numel, (-3, 1), scale=rank + 1)


def _reduce_scatter(rank: int, world: int) -> None:
    shard = 37  # not a whole number of blocks: each chunk is padded
    inputs = [chunk_data(r, shard * world) for r in range(world)]
    exact = torch.stack([x.double() for x in inputs]).mean(0)[rank * shard : (rank + 1) * shard]
    for fmt in ("int8", "fp8"):
        comm = QuantizedReduceScatter(fmt, block_size=BLOCK)
        out = torch.empty(shard)
        assert comm(out, inputs[rank].clone(), dist.group.WORLD) is None
        mine = slice(rank * shard, (rank + 1) * shard)
        bound = torch.stack([quantization_half_step(x.view(world, shard)[rank], fmt, BLOCK) for x in inputs]).mean(0)
        err = (out.double() - exact).abs()
        assert (err <= bound * (1 + 1e-5) + 1e-7).all(), (fmt, (err - bound).max().item())
        assert (err > 0).any(), "no rounding at all: was anything quantized?"
        assert not torch.equal(out, inputs[rank][mine]), "the shard is this rank's own input"
        row_bytes = shard // BLOCK * BLOCK + BLOCK  # codes of 3 padded blocks (int8/fp8: 1 byte)
        assert comm.bytes_sent == (world - 1) * (row_bytes + 4 * 3)
    with pytest.raises(ValueError, match="op: QuantizedReduceScatter"):
        QuantizedReduceScatter()(torch.empty(2), torch.empty(2 * world), dist.group.WORLD, op=dist.ReduceOp.MAX)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_within_bound_of_exact_average(world: int) -> None:
    run_ranks(_reduce_scatter, world, timeout=TIMEOUT)


def _fully_shard(rank: int, world: int) -> None:
    for fmt in ("int8", "fp8"):
        net, ref = seeded_mlp(6, 40, 5), seeded_mlp(6, 40, 5, dtype=torch.float64)  # the same weights
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(net[0], mesh=mesh)
        fully_shard(net, mesh=mesh)
        comm = use_quantized_reduction(net, fmt)
        exact = [torch.zeros_like(q) for q in ref.parameters()]
        largest = 0.0  # the largest value of any rank's local gradient: a bound on every block's maximum
        for r in range(world):
            x, y = seeded_pair(r, (4, 6), (4, 5), x_scale=r + 1)
            if r == rank:
                nn.functional.mse_loss(net(x), y).backward()
            ref.zero_grad()
            nn.functional.mse_loss(ref(x.double()), y.double()).backward()
            for total, q in zip(exact, ref.parameters(), strict=True):
                total += q.grad / world
                largest = max(largest, q.grad.abs().max().item())
        assert comm.bytes_sent > 0
        # Half a step of the largest block maximum (int8), or 2^-4 of it (fp8): a loose but
        # rank-independent bound; data that was not averaged is off by far more.
        bound = largest * (0.5 / 127 if fmt == "int8" else 2.0**-4)
        for p, total in zip(net.parameters(), exact, strict=True):
            full = p.grad.full_tensor().double()
            err = (full - total).abs().max().item()
            assert err <= bound, (fmt, err, bound)
            assert err > 0, "no rounding at all: was anything quantized?"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_gradients_close_to_exact_mean(world: int) -> None:
    run_ranks(_fully_shard, world, timeout=TIMEOUT)


def test_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="dtype: expected one of"):
        QuantizedReduceScatter("int2")
    with pytest.raises(ValueError, match="block_size: expected an even int >= 2, got 7"):
        QuantizedReduceScatter("int8", block_size=7)
    with pytest.raises(TypeError, match="block_size: expected an even int >= 2, got True"):
        QuantizedReduceScatter("int8", block_size=True)
    with pytest.raises(ValueError, match="no fully_shard module"):
        use_quantized_reduction(nn.Linear(2, 2), "int8")
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(
        RuntimeError, match=r"^use_quantized_reduction needs FSDPModule.set_force_sum_reduction_for_comms"
    ):
        use_quantized_reduction(nn.Linear(2, 2), "int8")
