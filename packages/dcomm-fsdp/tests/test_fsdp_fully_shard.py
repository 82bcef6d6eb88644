"""fully_shard (FSDP2) with dcomm's fp16/bf16 reduce-scatter against float32 and float64 references.

Each rank trains the same nested ``fully_shard`` model on its own data. After the first backward
the full gradients must equal the float64 mean of all ranks' gradients within the tolerance of
the dtype (fp16 1e-3, bf16 1e-2 relative), and the parameters after a few SGD steps must stay
within that tolerance of a float32 reduction. The reduce-scatter must receive its input already
in fp16/bf16 (FSDP2 casts in its copy-in) whether the policy comes from ``fully_shard``
(``low_precision_mp_policy``), is set afterwards, or after the lazy init; its fast path must equal
a literal pre-divide, SUM, post-divide bit for bit; the cast-it-yourself fallback must stay
correct and warn. World sizes 3 (pre 2, post 1.5, uneven shards) and 4 (also HSDP rejection) on
gloo.

Everything runs on the CPU, also on a host with GPUs: every ``fully_shard`` call gets an explicit
CPU mesh (its default mesh is a CUDA one when CUDA is available, which would move the model off
the CPU data), and the loss is computed in float32 (``mse_loss`` of a bf16 output and a float32
target has no backward before torch 2.12: "Found dtype Float but expected BFloat16").
"""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import dcomm.fsdp.fully_shard as fully_shard_module
from dcomm.core import divide_factors
from dcomm.fsdp import LowPrecisionReduceScatter, low_precision_mp_policy, use_low_precision_reduction
from dcomm.fsdp._torch_private import fsdp_param_groups, mp_policy, reduces_as_fsdp_default
from dcomm_testing import assert_close, recorded_calls, run_ranks, seeded_mlp, seeded_pair, train_sgd

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
    net, ref = seeded_mlp(6, 9, 5), seeded_mlp(6, 9, 5, dtype=torch.float64)
    kwargs: dict = {"mesh": cpu_mesh()}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    fully_shard(net[0], **kwargs)
    fully_shard(net, **kwargs)
    return net, ref


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_pair(1000 * step + rank, (4, 6), (4, 5), x_scale=rank + 1)


def exact_mean_grads(ref: nn.Module, world: int) -> list[torch.Tensor]:
    """The float64 mean over ranks of each rank's first-step gradient, computed locally."""
    ref.zero_grad()
    for r in range(world):
        x, y = batch(r, 0)
        (nn.functional.mse_loss(ref(x.double()), y.double()) / world).backward()
    return [p.grad.clone() for p in ref.parameters()]


def reduce_scatter_input_dtype(reducer: object, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.dtype:
    """The input's dtype, from a ``LowPrecisionReduceScatter`` call's arguments."""
    return (kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]).dtype


def train(net: nn.Module, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(full first-step gradients, full parameters after STEPS SGD steps)."""
    return train_sgd(net, functools.partial(batch, rank), STEPS, loss=loss, keep=lambda t: t.detach().full_tensor())


assert_fp32_close = functools.partial(assert_close, dtype=torch.float32)
"""Close within ``tol`` of the reference's largest value; ours always float32."""


def train_spied(net: nn.Module, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.dtype]]:
    """:func:`train`, also returning the dtype of every input LowPrecisionReduceScatter received."""
    with recorded_calls(LowPrecisionReduceScatter, "__call__", reduce_scatter_input_dtype) as calls:
        grads, params = train(net, rank)
    return grads, params, calls


def _fast_path_is_literal_pre_sum_post(rank: int, world: int) -> None:
    """The fast path (dtype input) equals cast, divide by pre, SUM reduce-scatter, divide by post."""
    pre, post = divide_factors(world)
    gen = torch.Generator().manual_seed(rank)
    for dtype in TOL:
        # bf16: magnitudes from 1e-30 to 1e30 (float32's range); fp16: within its own range.
        exponents = torch.randint(-30, 31, (world * 40,), generator=gen) if dtype == torch.bfloat16 else 0
        data = torch.randn(world * 40, generator=gen) * (rank + 1) * 10.0**exponents
        expected_input = data.to(dtype)
        literal = expected_input.clone().div_(pre)
        expected = torch.empty(40, dtype=dtype)
        dist.reduce_scatter_tensor(expected, literal, group=dist.group.WORLD)
        expected.div_(post)
        out = torch.empty(40, dtype=dtype)
        LowPrecisionReduceScatter(dtype)(out, expected_input.clone(), dist.group.WORLD)
        assert torch.equal(out, expected), (dtype, (out - expected).abs().max())


def _plan_worked_out_once_per_group(rank: int, world: int) -> None:
    """The group size, op and divisors are worked out once per group and dtypes, then reused."""
    comm = LowPrecisionReduceScatter(torch.float16)
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    groups = (
        [(pair, [0, 1]), (dist.group.WORLD, list(range(world)))]
        if rank < 2
        else [(dist.group.WORLD, list(range(world)))]
    )
    for group, members in groups * 2:
        size = len(members)
        out = torch.empty(3, dtype=torch.float16)
        comm(out, torch.full((size * 3,), float(rank + 1), dtype=torch.float16), group)
        want = sum(r + 1 for r in members) / size
        assert torch.equal(out, torch.full((3,), want, dtype=torch.float16)), (out, want)
    assert len(comm._plans) == len(groups), comm._plans


def _fully_shard(rank: int, world: int) -> None:
    _fast_path_is_literal_pre_sum_post(rank, world)
    _plan_worked_out_once_per_group(rank, world)
    net, ref = build()
    exact = exact_mean_grads(ref, world)
    fp32_grads, fp32_params = train(net, rank)
    assert_fp32_close(fp32_grads, exact, 1e-6, "fp32 fully_shard")

    for dtype, tol in TOL.items():
        for mp in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
            what = f"{dtype}, mp_policy={mp}"
            net, _ = build(mp)
            comm = use_low_precision_reduction(net, dtype)
            assert isinstance(comm, LowPrecisionReduceScatter)
            assert comm.dtype is dtype
            grads, params, calls = train_spied(net, rank)
            # Both FSDP units reduced through dcomm, every step, on input FSDP2 had already cast.
            assert calls == [dtype] * (2 * STEPS), (what, calls)
            grad_tol = tol if mp is None else 2e-2  # bf16 compute dominates the error
            assert_fp32_close(grads, exact, grad_tol, f"{what} gradients vs float64 mean")
            if mp is None:
                assert_fp32_close(params, fp32_params, tol, f"{what} parameters vs float32 reduction")
                # The reduction really ran in low precision.
                assert any(not torch.equal(a, b) for a, b in zip(grads, fp32_grads, strict=True)), what

        # The public-API way (policy given to fully_shard) does the same arithmetic.
        net, _ = build(low_precision_mp_policy(dtype))
        use_low_precision_reduction(net, dtype)
        grads_ctor, params_ctor, calls = train_spied(net, rank)
        assert calls == [dtype] * (2 * STEPS), (dtype, calls)
        net, _ = build()
        use_low_precision_reduction(net, dtype)
        grads_set, params_set = train(net, rank)
        for a, b in zip(grads_ctor + params_ctor, grads_set + params_set, strict=True):
            assert torch.equal(a, b), f"{dtype}: low_precision_mp_policy differs from the policy set afterwards"

        # Called after the lazy init (a forward already ran): the dtypes are recomputed.
        net, _ = build()
        net(batch(rank, 0)[0])
        use_low_precision_reduction(net, dtype)
        grads, _, calls = train_spied(net, rank)
        assert calls == [dtype] * (2 * STEPS), (f"{dtype} after lazy init", calls)
        assert_fp32_close(grads, exact, tol, f"{dtype} after lazy init: gradients vs float64 mean")

        # Where the reduce dtype cannot be set, the reduce-scatter casts by itself: correct, warns once.
        real_set = fully_shard_module._set_reduce_dtype
        fully_shard_module._set_reduce_dtype = lambda module, dtype: False  # type: ignore[assignment]
        try:
            net, _ = build()
            use_low_precision_reduction(net, dtype)
        finally:
            fully_shard_module._set_reduce_dtype = real_set  # type: ignore[assignment]
        instances: dict[int, LowPrecisionReduceScatter] = {}
        real_call = LowPrecisionReduceScatter.__call__

        def record(self, *args, _real=real_call, _seen=instances, **kw):  # type: ignore[no-untyped-def]
            _seen[id(self)] = self
            return _real(self, *args, **kw)

        LowPrecisionReduceScatter.__call__ = record  # type: ignore[method-assign]
        try:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                grads, params, calls = train_spied(net, rank)
        finally:
            LowPrecisionReduceScatter.__call__ = real_call  # type: ignore[method-assign]
        warning = r"got a torch.float32 reduce-scatter input.*low_precision_mp_policy"
        warned = [w for w in rec if re.search(warning, str(w.message))]
        assert len(warned) == (1 if rank == 0 else 0), warned  # once per process, on rank 0 only
        assert sum(rs.fallbacks for rs in instances.values()) == len(calls)  # every fallback counted
        assert calls == [torch.float32] * (2 * STEPS), (f"{dtype} fallback", calls)
        assert_fp32_close(grads, exact, tol, f"{dtype} fallback: gradients vs float64 mean")
        assert_fp32_close(params, fp32_params, tol, f"{dtype} fallback: parameters vs float32 reduction")

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


def _reductions(net: nn.Module) -> list[tuple[bool, torch.dtype]]:
    """Per FSDP2 parameter group: (reduces as fully_shard left it, its reduce dtype)."""
    groups = [g for m in net.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups(m)]
    return [(reduces_as_fsdp_default(g), mp_policy(g).reduce_dtype) for g in groups]


def _bf16_over_nccl_is_left_to_torch(rank: int, world: int) -> None:
    # gloo stands in for NCCL here: only the decision is checked, nothing is reduced.
    net, _ = build()
    use_low_precision_reduction(net, torch.float16)  # fp16: dcomm's reduce-scatter (torch divides in 2 kernels)
    assert _reductions(net) == [(False, torch.float16)] * 2
    net, _ = build()
    use_low_precision_reduction(net, torch.bfloat16)  # gloo has no AVG: dcomm's reduce-scatter
    assert _reductions(net) == [(False, torch.bfloat16)] * 2
    original = fully_shard_module.reduced_by_nccl
    fully_shard_module.reduced_by_nccl = lambda group, device: True  # type: ignore[assignment]
    try:
        net, _ = build()
        comm = use_low_precision_reduction(net, torch.bfloat16)  # FSDP2's bf16 AVG is dcomm's average
        assert _reductions(net) == [(True, torch.bfloat16)] * 2
        assert comm.fallbacks == 0
        net, _ = build()
        net.set_gradient_divide_factor(3.0)  # the root's own factor: torch's reduction is no longer the average
        use_low_precision_reduction(net, torch.bfloat16)  # so dcomm's reduce-scatter, on every module alike
        assert _reductions(net) == [(False, torch.bfloat16)] * 2
        for module in (net[0], net):
            assert isinstance(fsdp_param_groups(module)[0]._reduce_scatter_comm, LowPrecisionReduceScatter)
        net, _ = build()
        with pytest.MonkeyPatch.context() as patch:  # a torch whose parameter groups moved: install, as before
            patch.setattr(fully_shard_module, "_set_reduce_dtype", lambda module, dtype: False)
            use_low_precision_reduction(net, torch.bfloat16)
        assert [default for default, _ in _reductions(net)] == [False, False]
    finally:
        fully_shard_module.reduced_by_nccl = original


def test_bf16_over_nccl_with_fsdp_defaults_is_left_to_torch() -> None:
    run_ranks(_bf16_over_nccl_is_left_to_torch, 2)


def test_bad_dtype_and_old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"dtype: expected torch.float16 or torch.bfloat16, got torch.float32"):
        LowPrecisionReduceScatter(torch.float32)
    with pytest.raises(ValueError, match=r"dtype: expected torch.float16 or torch.bfloat16, got torch.float64"):
        use_low_precision_reduction(nn.Linear(2, 2), torch.float64)
    with pytest.raises(ValueError, match=r"dtype: expected torch.float16 or torch.bfloat16, got torch.float32"):
        low_precision_mp_policy(torch.float32)
    policy = low_precision_mp_policy(torch.float16, param_dtype=torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float16, None)
    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    with pytest.raises(RuntimeError, match=r"needs FSDPModule.set_custom_reduce_scatter, .*torch >= 2.11"):
        use_low_precision_reduction(nn.Linear(2, 2))
