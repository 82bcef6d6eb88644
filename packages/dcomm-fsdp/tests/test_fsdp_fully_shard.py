"""fully_shard (FSDP2) with dcomm's fp16/bf16 reduce-scatter against float32 and float64 references.

Each rank trains the same nested ``fully_shard`` model on its own data. After the first backward
the full gradients must equal the float64 mean of all ranks' gradients within the tolerance of
the dtype (fp16 1e-3, bf16 1e-2 relative), and the parameters after a few SGD steps must stay
within that tolerance of a float32 reduction. World sizes 3 (post-divide 1.5, uneven shards)
and 4 (also HSDP rejection) on gloo.

Everything runs on the CPU, also on a host with GPUs: every ``fully_shard`` call gets an explicit
CPU mesh (its default mesh is a CUDA one when CUDA is available, which would move the model off
the CPU data), and the loss is computed in float32 (``mse_loss`` of a bf16 output and a float32
target has no backward before torch 2.12: "Found dtype Float but expected BFloat16").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dcomm.core.testing import run_ranks
from dcomm.fsdp import LowPrecisionReduceScatter, use_low_precision_reduction

STEPS = 3
TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def cpu_mesh() -> DeviceMesh:
    """A 1-D CPU mesh over every rank: what fully_shard defaults to only where CUDA is absent."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE in float32 whatever the output dtype (mixed-dtype mse_loss backward needs torch >= 2.12)."""
    return nn.functional.mse_loss(out.float(), y.float())


def build(mp_policy: MixedPrecisionPolicy | None = None) -> tuple[nn.Module, nn.Module]:
    """(a fully_shard model on a CPU mesh, an unsharded float64 copy with the same weights)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))
    ref = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5)).double()
    ref.load_state_dict(net.state_dict())
    kwargs: dict = {"mesh": cpu_mesh()}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    fully_shard(net[0], **kwargs)
    fully_shard(net, **kwargs)
    return net, ref


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=gen) * (rank + 1), torch.randn(4, 5, generator=gen)


def exact_mean_grads(ref: nn.Module, world: int) -> list[torch.Tensor]:
    """The float64 mean over ranks of each rank's first-step gradient, computed locally."""
    ref.zero_grad()
    for r in range(world):
        x, y = batch(r, 0)
        (nn.functional.mse_loss(ref(x.double()), y.double()) / world).backward()
    return [p.grad.clone() for p in ref.parameters()]


def train(net: nn.Module, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(full first-step gradients, full parameters after STEPS SGD steps)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    first: list[torch.Tensor] = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss(net(x), y).backward()
        if step == 0:
            first = [p.grad.full_tensor() for p in net.parameters()]
        opt.step()
    return first, [p.detach().full_tensor() for p in net.parameters()]


def assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor], tol: float, what: str) -> None:
    assert len(ours) == len(ref) > 0
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == torch.float32, (what, a.dtype)
        b = b.to(torch.float64)
        torch.testing.assert_close(
            a.double(), b, rtol=tol, atol=tol * b.abs().max().item(), msg=lambda m: f"{what}: {m}"
        )


def _fully_shard(rank: int, world: int) -> None:
    net, ref = build()
    exact = exact_mean_grads(ref, world)
    fp32_grads, fp32_params = train(net, rank)
    assert_close(fp32_grads, exact, 1e-6, "fp32 fully_shard")

    for dtype, tol in TOL.items():
        for mp in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
            what = f"{dtype}, mp_policy={mp}"
            net, _ = build(mp)
            comm = use_low_precision_reduction(net, dtype)
            assert isinstance(comm, LowPrecisionReduceScatter)
            assert comm.dtype is dtype
            calls: list[torch.dtype] = []
            real_call = LowPrecisionReduceScatter.__call__

            def spy(self, *args, _real=real_call, _calls=calls, **kw):  # type: ignore[no-untyped-def]
                _calls.append(kw["input_tensor"].dtype if "input_tensor" in kw else args[1].dtype)
                return _real(self, *args, **kw)

            LowPrecisionReduceScatter.__call__ = spy  # type: ignore[method-assign]
            try:
                grads, params = train(net, rank)
            finally:
                LowPrecisionReduceScatter.__call__ = real_call  # type: ignore[method-assign]
            # Both FSDP units reduced through dcomm, every step.
            assert len(calls) == 2 * STEPS, (what, calls)
            grad_tol = tol if mp is None else 2e-2  # bf16 compute dominates the error
            assert_close(grads, exact, grad_tol, f"{what} gradients vs float64 mean")
            if mp is None:
                assert_close(params, fp32_params, tol, f"{what} parameters vs float32 reduction")
                # The reduction really ran in low precision.
                assert any(not torch.equal(a, b) for a, b in zip(grads, fp32_grads, strict=True)), what

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp = nn.Linear(4, 4)
        fully_shard(hsdp, mesh=mesh)
        with pytest.raises(ValueError, match=r"module: parameter 'weight' is replicated .*\(2, 2\) \(HSDP\)"):
            use_low_precision_reduction(hsdp)

    with pytest.raises(ValueError, match=r"module: no fully_shard module in Linear; call .*fully_shard"):
        use_low_precision_reduction(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"op: LowPrecisionReduceScatter .*needs ReduceOp.SUM"):
        LowPrecisionReduceScatter()(torch.empty(2), torch.empty(2 * world), dist.group.WORLD, dist.ReduceOp.AVG)
    with pytest.raises(ValueError, match=rf"input_tensor: expected {2 * world} elements"):
        LowPrecisionReduceScatter()(torch.empty(2), torch.empty(3), dist.group.WORLD)


@pytest.mark.parametrize("world", [3, 4])
def test_fully_shard_low_precision_matches_float_reduction(world: int) -> None:
    run_ranks(_fully_shard, world)


def test_bad_dtype_and_old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"dtype: expected torch.float16 or torch.bfloat16, got torch.float32"):
        LowPrecisionReduceScatter(torch.float32)
    with pytest.raises(ValueError, match=r"dtype: expected torch.float16 or torch.bfloat16, got torch.float64"):
        use_low_precision_reduction(nn.Linear(2, 2), torch.float64)
    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    with pytest.raises(RuntimeError, match=r"needs FSDPModule.set_custom_reduce_scatter, .*torch >= 2.11"):
        use_low_precision_reduction(nn.Linear(2, 2))
