"""dcomm.fsdp on any backend: FSDP hooks against torch's, fully_shard fp16/bf16 against float32.

``fsdp_hooks``: a nested FSDP model is trained for a few SGD steps on data that differs per rank,
for each strategy (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD), once with dcomm's hook and once with
torch's. The fp32 hooks must give bit-identical shards and gradients (same arithmetic); the fp16
and bf16 hooks must agree within 1e-3 and 1e-2 relative. ``fsdp2_low_precision_reduction``:
a nested ``fully_shard`` model with :func:`dcomm.fsdp.use_low_precision_reduction` (its policy set
afterwards, and given to ``fully_shard`` as ``low_precision_mp_policy``) against the same model
reducing in float32 (gradients and parameters after a few steps) and against the float64 mean of
every rank's gradient; the reduce-scatter must receive its input already in fp16/bf16 (the fast
path: fp16 pre-divide folded into NCCL's pre-multiplied sum, bf16 divided once on the shard).

torch's own fp16/bf16 FSDP hooks call ``record_stream`` with a CPU stream and crash on CPU
tensors (torch 2.13); on gloo the scenario makes that call a no-op for CPU tensors while torch's
hooks run, and restores it afterwards.

``fully_shard`` gets an explicit 1-D mesh of this backend's device (``device()``: CPU under
gloo, the rank's GPU under NCCL); its default mesh is a CUDA one wherever CUDA is available,
which under gloo on a GPU host would move the model away from the CPU data.

Example::

    python3 -m pytest tests-integration -n 2 -q -k fsdp  # gloo; tests-integration/run.py for NCCL
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from harness import device, scenario
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks as torch_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy, fully_shard

from dcomm.core import DefaultState, LowPrecisionState
from dcomm.fsdp import (
    LowPrecisionReduceScatter,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    low_precision_mp_policy,
    reduce_scatter_hook,
    register_comm_hook,
    use_low_precision_reduction,
)
from dcomm_testing import assert_close, cpu_record_stream_is_noop, recorded_calls, seeded_mlp, seeded_pair, train_sgd

STEPS = 3
TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = seeded_pair(1000 * step + rank, (8, 16), (8, 4), x_scale=rank + 1)
    return x.to(device()), y.to(device())


def _net() -> nn.Sequential:
    return seeded_mlp(16, 33, 4)  # 561 + 136 numel: padded


def _sgd_train(
    model: nn.Module, whole: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train ``model`` for STEPS SGD steps: (first-step gradients, final parameters), each ``whole(t)``."""
    return train_sgd(model, functools.partial(_batch, dist.get_rank()), STEPS, keep=whole)


def _train_fsdp(strategy: ShardingStrategy, state: object, hook: object) -> tuple[list[torch.Tensor], ...]:
    net = _net().to(device())
    net[0] = FSDP(net[0], sharding_strategy=strategy, device_id=device())
    model = FSDP(net, sharding_strategy=strategy, device_id=device())
    if hook in (allreduce_hook, reduce_scatter_hook, fp16_compress_hook, bf16_compress_hook):
        register_comm_hook(model, state, hook)  # type: ignore[arg-type]
    else:
        model.register_comm_hook(state, hook)  # type: ignore[arg-type]
    grads, params = _sgd_train(model, lambda t: t.detach().clone())
    return params, grads


_close = functools.partial(assert_close, dtype=torch.float32)
"""Close within ``tol`` of the reference's largest value; ours always float32."""


@scenario(min_world_size=2)
def scenario_fsdp_hooks(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD):
        sharded = strategy is not ShardingStrategy.NO_SHARD
        ours = reduce_scatter_hook if sharded else allreduce_hook
        theirs = torch_hooks.reduce_scatter_hook if sharded else torch_hooks.allreduce_hook
        fp32 = _train_fsdp(strategy, DefaultState(group), ours)
        ref = _train_fsdp(strategy, torch_hooks.DefaultState(group), theirs)
        for a, b in zip(fp32[0] + fp32[1], ref[0] + ref[1], strict=True):
            assert torch.equal(a, b), f"{strategy.name}: fp32 hook differs from torch's"
        for dtype, hook, torch_hook in (
            (torch.float16, fp16_compress_hook, torch_hooks.fp16_compress_hook),
            (torch.bfloat16, bf16_compress_hook, torch_hooks.bf16_compress_hook),
        ):
            what = f"{strategy.name}/{dtype}"
            params, grads = _train_fsdp(strategy, LowPrecisionState(group), hook)
            with cpu_record_stream_is_noop():
                ref_params, ref_grads = _train_fsdp(strategy, torch_hooks.LowPrecisionState(group), torch_hook)
            _close(grads, ref_grads, TOL[dtype], f"{what} gradients vs torch's hook")
            _close(params, ref_params, TOL[dtype], f"{what} parameters vs torch's hook")
            _close(grads, fp32[1], TOL[dtype], f"{what} gradients vs fp32 reduction")


def _mesh() -> DeviceMesh:
    """A 1-D mesh of every rank on the backend's device (not fully_shard's CUDA-if-present default)."""
    return init_device_mesh(device().type, (dist.get_world_size(),))


def _input_dtype(reducer: object, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.dtype:
    """The input's dtype, from a ``LowPrecisionReduceScatter`` call's arguments."""
    return (kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]).dtype


def _train_fully_shard(
    dtype: torch.dtype | None, policy_at_construction: bool = False, dcomm: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.dtype]]:
    """(first-step gradients, parameters after STEPS, dtype of every reduce-scatter input dcomm got).

    ``dcomm=False``: torch's own reduction in ``dtype`` (``MixedPrecisionPolicy(reduce_dtype=dtype)``).
    """
    net = _net().to(device())
    mesh = _mesh()
    kwargs = {"mp_policy": low_precision_mp_policy(dtype)} if dtype is not None and policy_at_construction else {}
    if not dcomm:
        kwargs = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=dtype)}
    fully_shard(net[0], mesh=mesh, **kwargs)
    fully_shard(net, mesh=mesh, **kwargs)
    if dtype is not None and dcomm:
        use_low_precision_reduction(net, dtype)
    with recorded_calls(LowPrecisionReduceScatter, "__call__", _input_dtype) as calls:
        grads, params = _sgd_train(net, lambda t: t.detach().full_tensor())
    return grads, params, calls


@scenario(min_world_size=2)
def scenario_fsdp2_low_precision_reduction(rank: int, world_size: int) -> None:
    ref = _net().double().to(device())
    for r in range(world_size):
        x, y = _batch(r, 0)
        (nn.functional.mse_loss(ref(x.double()), y.double()) / world_size).backward()
    exact = [p.grad for p in ref.parameters()]
    fp32_grads, fp32_params, _ = _train_fully_shard(None)
    _close(fp32_grads, exact, 1e-5, "fp32 fully_shard vs float64 mean")
    for dtype, tol in TOL.items():
        for at_construction in (False, True):
            what = f"{dtype} (policy {'given to fully_shard' if at_construction else 'set afterwards'})"
            grads, params, calls = _train_fully_shard(dtype, at_construction)
            # bf16 over NCCL: FSDP2's own bf16 AVG is dcomm's average, so it is left to torch, bit for bit.
            left_to_torch = dtype == torch.bfloat16 and device().type == "cuda"
            assert calls == ([] if left_to_torch else [dtype] * (2 * STEPS)), (what, calls)
            if left_to_torch:
                torch_grads, torch_params, _ = _train_fully_shard(dtype, dcomm=False)
                for ours, theirs in ((grads, torch_grads), (params, torch_params)):
                    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), what
            _close(grads, exact, tol, f"{what} gradients vs float64 mean")
            _close(grads, fp32_grads, tol, f"{what} gradients vs float32 reduction")
            _close(params, fp32_params, tol, f"{what} parameters vs float32 reduction")
            assert any(not torch.equal(a, b) for a, b in zip(grads, fp32_grads, strict=True)), what
