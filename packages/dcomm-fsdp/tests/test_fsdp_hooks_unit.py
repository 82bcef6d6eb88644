"""dcomm's FSDP hooks on raw tensors and their error messages, on real gloo ranks.

Checks the divide factors for world sizes 2, 3, 4 and 8 against torch's FSDP state, that the
hooks apply them (a float64 reference; fp16 sums that would overflow without the pre-division),
that the low-precision buffers are communicated synchronously and tied to the stream before they
are dropped, and that every misuse gets a ``ValueError`` naming argument, value and fix.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks as torch_hooks
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

import dcomm.fsdp
import dcomm.fsdp.hooks
from dcomm.core import DefaultState, LowPrecisionState, divide_factors
from dcomm.fsdp import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    reduce_scatter_hook,
    register_comm_hook,
)
from dcomm_testing import run_ranks, seeded_normal

EXPECTED_FACTORS = {2: (2.0, 1.0), 3: (2.0, 1.5), 4: (2.0, 2.0), 8: (4.0, 2.0)}


@pytest.mark.parametrize("world", sorted(EXPECTED_FACTORS))
def test_divide_factors_match_torch(world: int) -> None:
    pre = torch_hooks.DefaultState._get_gradient_predivide_factor(world)
    assert divide_factors(world) == EXPECTED_FACTORS[world] == (pre, world / pre)


def rank_grad(rank: int, numel: int) -> torch.Tensor:
    return seeded_normal(7 + rank, (numel,), scale=rank + 1)


def fake_state(world: int, group: dist.ProcessGroup, parameter_type: torch.dtype = torch.float32) -> object:
    """A state with the factors of ``world`` ranks over a (smaller) real group."""
    pre, post = divide_factors(world)
    return types.SimpleNamespace(
        process_group=group,
        world_size=world,
        gradient_predivide_factor=pre,
        gradient_postdivide_factor=post,
        parameter_type=parameter_type,
    )


def _hooks_on_tensors(rank: int, group: dist.ProcessGroup) -> None:
    world = dist.get_world_size(group)
    n = 5 * world
    total = torch.stack([rank_grad(r, n) for r in range(world)]).sum(0)
    shard = slice(5 * rank, 5 * rank + 5)
    state, torch_state = DefaultState(group), torch_hooks.DefaultState(group)

    # fp32 hooks: the float64 mean, and bit-identical to torch's hooks.
    grad, ref = rank_grad(rank, n).float(), rank_grad(rank, n).float()
    allreduce_hook(state, grad)
    torch_hooks.allreduce_hook(torch_state, ref)
    assert torch.equal(grad, ref)
    torch.testing.assert_close(grad.double(), total / world, rtol=1e-6, atol=1e-6)
    out, ref_out = torch.empty(5), torch.empty(5)
    grad, ref = rank_grad(rank, n).float(), rank_grad(rank, n).float()
    reduce_scatter_hook(state, grad, out)
    torch_hooks.reduce_scatter_hook(torch_state, ref, ref_out)
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(out.double(), total[shard] / world, rtol=1e-6, atol=1e-6)

    # Low-precision hooks: in place, result in parameter_type, within the dtype's tolerance.
    for hook, tol in ((fp16_compress_hook, 1e-3), (bf16_compress_hook, 1e-2)):
        lp = LowPrecisionState(group)
        grad = rank_grad(rank, n).float()
        ptr = grad.data_ptr()
        hook(lp, grad)
        assert grad.dtype == torch.float32
        assert grad.data_ptr() == ptr
        torch.testing.assert_close(grad.double(), total / world, rtol=tol, atol=tol * total.abs().max().item())
        out = torch.empty(5)
        ptr = out.data_ptr()
        hook(lp, rank_grad(rank, n).float(), out)
        assert out.dtype == torch.float32
        assert out.data_ptr() == ptr
        torch.testing.assert_close(out.double(), total[shard] / world, rtol=tol, atol=tol * total.abs().max().item())
        # A target in another dtype is rebound to parameter_type, like torch's hooks do.
        out = torch.empty(5, dtype=torch.bfloat16)
        hook(lp, rank_grad(rank, n).bfloat16(), out)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), total[shard] / world, rtol=2e-2, atol=2e-2 * total.abs().max().item())

    # The factors of 8 ranks, applied by the hooks exactly (pre 4, post 2) on this group.
    for pretend in (3, 8):
        pre, post = divide_factors(pretend)
        exact = torch.stack([rank_grad(r, n) / pre for r in range(world)]).sum(0) / post
        grad = rank_grad(rank, n).float()
        allreduce_hook(fake_state(pretend, group), grad)  # type: ignore[arg-type]
        torch.testing.assert_close(grad.double(), exact, rtol=1e-6, atol=1e-6)
        out = torch.empty(5)
        fp16_compress_hook(fake_state(pretend, group), rank_grad(rank, n).float(), out)  # type: ignore[arg-type]
        torch.testing.assert_close(out.double(), exact[shard], rtol=1e-3, atol=1e-3 * exact.abs().max().item())

    # fp16 overflow: every rank holds 20000; the plain sum (20000 * world) exceeds fp16's 65504
    # at world 4, the pre-divided one does not, and the average comes back exact.
    big = torch.full((n,), 20000.0)
    fp16_compress_hook(LowPrecisionState(group), big)
    assert torch.equal(big, torch.full((n,), 20000.0)), big
    big_out = torch.empty(5)
    fp16_compress_hook(LowPrecisionState(group), torch.full((n,), 20000.0), big_out)
    assert torch.equal(big_out, torch.full((5,), 20000.0)), big_out


def _hooks_on_groups(rank: int, world: int) -> None:
    # Every rank creates every group (collective); ranks 0..size-1 use each.
    for size in (4, 3, 2):
        group = dist.new_group(list(range(size))) if size < world else dist.group.WORLD
        if rank < size:
            _hooks_on_tensors(rank, group)


def test_hooks_average_and_apply_divide_factors() -> None:
    """Real groups of 4, 3 (post-divide 1.5) and 2 ranks in one run; 8 via a pretend state."""
    run_ranks(_hooks_on_groups, 4)


def _buffer_lifetime(rank: int, world: int) -> list[str]:
    """Record what the low-precision hooks do with their buffers, in order."""
    events: list[tuple[str, int, torch.dtype]] = []
    real_all_reduce = dist.all_reduce
    real_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_reduce(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        assert not kwargs.get("async_op"), "an FSDP hook must not leave its collective in flight"
        events.append(("collective", tensor.data_ptr(), tensor.dtype))
        return real_all_reduce(tensor, *args, **kwargs)

    def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        assert not kwargs.get("async_op"), "an FSDP hook must not leave its collective in flight"
        events.append(("collective", tensor.data_ptr(), tensor.dtype))
        events.append(("collective-out", output.data_ptr(), output.dtype))
        return real_rs(output, tensor, *args, **kwargs)

    def keep(tensor: torch.Tensor) -> None:
        events.append(("keep", tensor.data_ptr(), tensor.dtype))

    dist.all_reduce = all_reduce  # type: ignore[assignment]
    dist.reduce_scatter_single = reduce_scatter  # type: ignore[attr-defined]
    dist.reduce_scatter_tensor = reduce_scatter  # type: ignore[assignment]
    dcomm.fsdp.hooks.keep_until_stream_done = keep  # type: ignore[assignment]
    state = LowPrecisionState(dist.group.WORLD)
    checked = []
    for hook, dtype in ((fp16_compress_hook, torch.float16), (bf16_compress_hook, torch.bfloat16)):
        for sharded in (False, True):
            events.clear()
            grad = rank_grad(rank, 4 * world).float()
            hook(state, grad, torch.empty(4)) if sharded else hook(state, grad)
            kinds = [e[0] for e in events]
            # Communicated in low precision, a buffer distinct from the gradient ...
            sent = [e for e in events if e[0].startswith("collective")]
            assert sent, events
            assert all(e[2] == dtype for e in sent), events
            assert all(e[1] != grad.data_ptr() for e in sent), events
            # ... and every buffer the collective touched is tied to the stream after it ran.
            kept = {e[1] for e in events if e[0] == "keep"}
            assert {e[1] for e in sent} <= kept, events
            assert kinds.index("keep") > max(i for i, k in enumerate(kinds) if k.startswith("collective")), kinds
            checked.append(f"{hook.__name__}/{'rs' if sharded else 'ar'}")
    return checked


def test_low_precision_buffers_outlive_the_collective() -> None:
    results = run_ranks(_buffer_lifetime, 2)
    assert len(results[0]) == 4


def _bad_input(rank: int, world: int) -> None:
    group = dist.group.WORLD
    grad = torch.ones(4)
    for hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook):
        with pytest.raises(TypeError, match=r"state: .* got None; pass .*State\(dist.group.WORLD\)"):
            hook(None, grad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"state: .*process_group is None"):
            hook(types.SimpleNamespace(process_group=None), grad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"state: .*got <.*ProcessGroup"):
            hook(group, grad)  # type: ignore[arg-type]
    for hook in (fp16_compress_hook, bf16_compress_hook):
        with pytest.raises(TypeError, match=r"state: .*parameter_type.*DefaultState has none; pass LowPrecisionState"):
            hook(DefaultState(group), grad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"state: reduce_scatter_hook .*2 ranks.*gradient of 6 elements.*shard of 2"):
        reduce_scatter_hook(DefaultState(group), torch.ones(6), torch.empty(2))
    with pytest.raises(ValueError, match=r"state: bf16_compress_hook .*model.process_group"):
        bf16_compress_hook(LowPrecisionState(group), torch.ones(6), torch.empty(2))

    def model(strategy: ShardingStrategy, **kw: object) -> FSDP:
        return FSDP(nn.Linear(3, 2), sharding_strategy=strategy, device_id=torch.device("cpu"), **kw)

    with pytest.raises(TypeError, match=r"module: expected the root FullyShardedDataParallel.*got Linear"):
        register_comm_hook(nn.Linear(2, 2), DefaultState(group), allreduce_hook)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"hook: reduce_scatter_hook needs a sharded.*NO_SHARD.*allreduce_hook"):
        register_comm_hook(model(ShardingStrategy.NO_SHARD), DefaultState(group), reduce_scatter_hook)
    with pytest.raises(ValueError, match=r"hook: allreduce_hook serves NO_SHARD.*FULL_SHARD.*reduce_scatter_hook"):
        register_comm_hook(model(ShardingStrategy.FULL_SHARD), DefaultState(group), allreduce_hook)
    with pytest.raises(TypeError, match=r"state: .*LowPrecisionState"):
        register_comm_hook(model(ShardingStrategy.FULL_SHARD), DefaultState(group), fp16_compress_hook)
    with pytest.raises(TypeError, match=r"hook: expected a callable such as dcomm\.fsdp\.allreduce_hook, got 'ar'"):
        register_comm_hook(model(ShardingStrategy.NO_SHARD), DefaultState(group), "ar")  # type: ignore[arg-type]
    singles = [dist.new_group([r]) for r in range(world)]
    with pytest.raises(ValueError, match=r"state: its process_group has 1 ranks but the module shards over 2"):
        register_comm_hook(model(ShardingStrategy.FULL_SHARD), LowPrecisionState(singles[rank]), bf16_compress_hook)
    # Hybrid strategies: the intra-node group is WORLD, the inter-node group this rank alone.
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        hybrid = model(strategy, process_group=(group, singles[rank]))
        with pytest.raises(ValueError, match=rf"sharding_strategy: .*ShardingStrategy.{strategy.name}; use FULL_SHARD"):
            register_comm_hook(hybrid, LowPrecisionState(group), bf16_compress_hook)
    # The checks pass a good registration through, and it is used.
    good = model(ShardingStrategy.FULL_SHARD)
    register_comm_hook(good, LowPrecisionState(group), bf16_compress_hook)
    good(torch.ones(2, 3) * rank).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in good.parameters())


def test_bad_input_gets_clear_errors() -> None:
    run_ranks(_bad_input, 2)
