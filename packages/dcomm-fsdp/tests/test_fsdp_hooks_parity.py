"""FSDP (FullyShardedDataParallel) with dcomm's hooks against torch's hooks, on real gloo ranks.

Every strategy (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD) and every hook dtype, at world sizes 2 and
4, with a nested FSDP model whose flat parameters need padding, trained for a few SGD steps on
data that differs per rank. Tolerances: fp32 hooks bit-identical (same arithmetic as torch and
as FSDP's own reduction); fp16 1e-3 relative, bf16 1e-2 relative to torch's hooks.

torch's own fp16/bf16 FSDP hooks crash on CPU tensors in torch 2.13 (``record_stream`` with a
CPU stream: "unknown parameter type"); the rank function turns ``record_stream`` into a no-op
for CPU tensors so that the reference can run. dcomm's hooks need no such help.

Everything runs on the CPU, also on a host with GPUs: every FSDP unit gets
``device_id=torch.device("cpu")``, as gloo needs. The loss is computed in float32: under
``MixedPrecision(param_dtype=torch.bfloat16)`` the model output is bf16, and ``mse_loss`` of a
bf16 output and a float32 target has no backward before torch 2.12 ("Found dtype Float but
expected BFloat16", pytorch/pytorch#94086), whatever the hook.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks as torch_hooks
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

import dcomm.fsdp
from dcomm.core import DefaultState, LowPrecisionState
from dcomm_testing import assert_close, cpu_record_stream_is_noop, run_ranks, seeded_mlp, seeded_pair, train_sgd

STEPS = 3
STRATEGIES = (ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD)
TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def make_model(strategy: ShardingStrategy, mixed_precision: MixedPrecision | None = None) -> FSDP:
    """Same initial weights on every rank; an inner FSDP unit and a root unit (101 + 45 numel)."""
    net = seeded_mlp(6, 8, 5)
    kwargs = {"sharding_strategy": strategy, "device_id": torch.device("cpu"), "mixed_precision": mixed_precision}
    net[0] = FSDP(net[0], **kwargs)
    return FSDP(net, **kwargs)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_pair(100 * step + rank, (4, 6), (4, 5), x_scale=rank + 1)


def float32_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def train(model: FSDP, rank: int, steps: int = STEPS) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Return (this rank's flat parameter shards after ``steps`` SGD steps, first-step gradients)."""
    first_grads, params = train_sgd(model, functools.partial(batch, rank), steps, loss=float32_mse)
    return params, first_grads


def trained(strategy: ShardingStrategy, state: object, hook: object, rank: int, **kw: object) -> tuple:
    model = make_model(strategy, **kw)  # type: ignore[arg-type]
    if hook is not None:
        model.register_comm_hook(state, hook)
    return train(model, rank)


def assert_all_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], rtol: float, what: str) -> None:
    assert all(b.dtype == torch.float32 for b in theirs), what
    assert_close(ours, theirs, rtol, what, dtype=torch.float32)


def _parity(rank: int, world: int) -> None:
    cpu_record_stream_is_noop()
    group = dist.group.WORLD
    for strategy in STRATEGIES:
        sharded = strategy is not ShardingStrategy.NO_SHARD
        ours_default = dcomm.fsdp.reduce_scatter_hook if sharded else dcomm.fsdp.allreduce_hook
        theirs_default = torch_hooks.reduce_scatter_hook if sharded else torch_hooks.allreduce_hook

        builtin_params, builtin_grads = trained(strategy, None, None, rank)
        params, grads = trained(strategy, DefaultState(group), ours_default, rank)
        ref_params, ref_grads = trained(strategy, torch_hooks.DefaultState(group), theirs_default, rank)
        triples = zip(params + grads, ref_params + ref_grads, builtin_params + builtin_grads, strict=True)
        for mine, ref, builtin in triples:
            assert torch.equal(mine, ref), f"{strategy.name}: fp32 hook differs from torch's hook"
            assert torch.equal(mine, builtin), f"{strategy.name}: fp32 hook differs from FSDP's own reduction"
        # The gradients really are averaged: ranks saw different data, so a hook that skipped
        # communication would leave NO_SHARD gradients differing between ranks.
        if not sharded:
            gathered = [torch.empty_like(grads[0]) for _ in range(world)]
            dist.all_gather(gathered, grads[0])
            assert all(torch.equal(g, gathered[0]) for g in gathered), "NO_SHARD gradients not averaged"

        for dtype, ours, theirs in (
            (torch.float16, dcomm.fsdp.fp16_compress_hook, torch_hooks.fp16_compress_hook),
            (torch.bfloat16, dcomm.fsdp.bf16_compress_hook, torch_hooks.bf16_compress_hook),
        ):
            what = f"{strategy.name}/{dtype}"
            low_params, low_grads = trained(strategy, LowPrecisionState(group), ours, rank)
            ref_params, ref_grads = trained(strategy, torch_hooks.LowPrecisionState(group), theirs, rank)
            assert_all_close(low_grads, ref_grads, TOL[dtype], f"{what} gradients vs torch's hook")
            assert_all_close(low_params, ref_params, TOL[dtype], f"{what} parameters vs torch's hook")
            # ... and against the float32 reduction, independently of torch's hooks.
            assert_all_close(low_grads, builtin_grads, TOL[dtype], f"{what} gradients vs fp32 reduction")
            # The low-precision reduction must actually have happened (a fp32 pass-through would
            # be bit-identical to the fp32 reduction for some element at least, never for all).
            assert any(not torch.equal(a, b) for a, b in zip(low_grads, builtin_grads, strict=True)), what


@pytest.mark.parametrize("world", [2, 4])
def test_hooks_match_torch_in_every_strategy(world: int) -> None:
    run_ranks(_parity, world)


def _mixed_precision(rank: int, world: int) -> None:
    """Where FSDP treats torch's hooks specially (by identity), dcomm's must still be right."""
    cpu_record_stream_is_noop()
    group = dist.group.WORLD
    mp = MixedPrecision(param_dtype=torch.bfloat16)  # compute, and FSDP's reduce dtype, in bf16
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD):
        what = f"{strategy.name}/bf16 compute"
        ours, theirs = dcomm.fsdp.fp16_compress_hook, torch_hooks.fp16_compress_hook
        _, grads = trained(strategy, LowPrecisionState(group), ours, rank, mixed_precision=mp)
        _, ref = trained(strategy, torch_hooks.LowPrecisionState(group), theirs, rank, mixed_precision=mp)
        assert_all_close(grads, ref, TOL[torch.float16], what)

        # A state whose parameter_type disagrees with the parameters: FSDP still casts the
        # gradient of a dcomm hook to the parameter dtype, so the optimizer sees float32.
        _, fp32_grads = trained(strategy, None, None, rank)
        wrong = LowPrecisionState(group, parameter_type=torch.bfloat16)
        _, grads = trained(strategy, wrong, dcomm.fsdp.bf16_compress_hook, rank)
        assert_all_close(grads, fp32_grads, TOL[torch.bfloat16], f"{strategy.name}/parameter_type=bf16")


def test_hooks_with_mixed_precision_and_mismatched_parameter_type() -> None:
    run_ranks(_mixed_precision, 2)
