"""int8/fp8 DDP hooks on real gloo ranks: error bounds against an exact float64 average, error
feedback over many steps, bit-identical resume, and the bytes on the wire."""

import io
import itertools

import pytest
import torch
import torch.distributed as dist

import dcomm.ddp
from dcomm.core import payload_bytes, quantized_average_bytes
from dcomm.core.quantization import max_code
from dcomm.core.quantized_average import chunk_numel
from dcomm.ddp import QuantizedState, fp8_compress_hook, int8_compress_hook, quantized_allreduce_bytes
from dcomm_testing import (
    BucketStub,
    assert_same_on_ranks,
    assert_updates_close,
    quantization_half_step,
    run_ranks,
    seeded_mlp,
    seeded_normal,
    spread_normal,
    train_ddp,
)

TIMEOUT = 240.0
HOOKS = {"int8": int8_compress_hook, "fp8": fp8_compress_hook}
BLOCK = 32


def last_bucket(buffer: torch.Tensor, index: int = 0) -> BucketStub:
    """A last bucket around ``buffer``: the part of ``dist.GradBucket`` the hooks use."""
    return BucketStub(True, index, buffer)


def grad(rank: int, step: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Different on every rank and step, with magnitudes spanning 1e-4..1e1."""
    return spread_normal(1000 * step + rank, numel, (-4, 1), scale=rank + 1, dtype=dtype)


def _bounds_and_bytes(rank: int, world: int) -> None:
    numel = 1000  # not a multiple of world * BLOCK: the chunks are padded
    grads = [grad(r, 0, numel) for r in range(world)]
    exact = torch.stack([g.double() for g in grads]).mean(0)
    for (fmt, hook), pattern in itertools.product(HOOKS.items(), ("two_shot", "all_gather")):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            state = QuantizedState(None, error_feedback=False, block_size=BLOCK)
            state._pattern = pattern  # internal switch of the exchange, for measurements
            buffer = grads[rank].to(dtype, copy=True)
            out = hook(state, last_bucket(buffer)).wait()
            assert out is buffer
            # The ranks' roundings, averaged, plus (two-shot) the average's own re-quantization
            # (bounded through the exact mean plus the first stage's error), plus the bucket's own
            # rounding.
            first = torch.stack([quantization_half_step(g.to(dtype), fmt, BLOCK) for g in grads]).mean(0)
            second = quantization_half_step(exact.abs() + first, fmt, BLOCK) if pattern == "two_shot" else 0
            own = exact.abs() * (torch.finfo(dtype).eps if dtype != torch.float64 else 0)
            err = (out.double() - exact).abs()
            bound = first + second + own + 1e-6 * exact.abs()
            assert (err <= bound).all(), f"{fmt} {pattern} {dtype}: worst excess {(err - bound).max().item():.3e}"
            assert (err > 0).any(), "no rounding at all: was anything quantized?"
            # Every rank holds the same average.
            gathered = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(gathered, out)
            assert all(torch.equal(g, out) for g in gathered)
            sent = {  # a rank's own chunk (or copy) does not travel
                "two_shot": 2 * (world - 1) * payload_bytes(chunk_numel(numel, world, BLOCK), fmt, BLOCK),
                "all_gather": (world - 1) * payload_bytes(numel, fmt, BLOCK),
            }[pattern]
            assert state.bytes_sent == sent == quantized_average_bytes(numel, world, fmt, BLOCK, pattern)
            assert pattern == "all_gather" or sent == quantized_allreduce_bytes(numel, world, fmt, BLOCK)
    # A None state: WORLD, no error feedback, same result as an explicit state without it.
    a = int8_compress_hook(None, last_bucket(grads[rank].clone())).wait()
    b = int8_compress_hook(QuantizedState(None, error_feedback=False), last_bucket(grads[rank].clone())).wait()
    assert torch.equal(a, b)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_error_bounds_against_exact_average(world: int) -> None:
    run_ranks(_bounds_and_bytes, world, timeout=TIMEOUT)


# Below half the smallest code step of each format when the block maximum is 1: int8 steps by
# 1/127; fp8 e4m3 (maximum 448) has subnormals of 2^-9 / 448, about 4.4e-6.
SMALL = {"int8": 2e-3, "fp8": 1e-6}


def steady_grad(rank: int, step: int, numel: int, fmt: str) -> torch.Tensor:
    """One value per block of 1 sets the scale; the small, steady rest is below half a
    quantization step, so without error feedback it is rounded away every time."""
    g = grad(rank, step, numel) * SMALL[fmt] / 10 + SMALL[fmt] * (rank + 1)
    g[::BLOCK] = 1.0
    return g


def _error_feedback(rank: int, world: int) -> None:
    numel, steps = 300, 150
    for fmt, hook in HOOKS.items():
        gaps = {}
        for feedback in (True, False):
            state = QuantizedState(None, error_feedback=feedback, block_size=BLOCK)
            applied = torch.zeros(numel, dtype=torch.float64)
            exact = torch.zeros(numel, dtype=torch.float64)
            worst = 0.0
            for step in range(steps):
                g = steady_grad(rank, step, numel, fmt)
                exact += sum(steady_grad(r, step, numel, fmt).double() for r in range(world)) / world
                applied += hook(state, last_bucket(g)).wait().double()
                worst = max(worst, (applied - exact).abs().max().item())
            gaps[feedback] = ((applied - exact).abs().max().item(), worst)
        # With feedback the running sums never drift apart by more than a few quantization steps
        # (1/127 for int8, ~2^-4 of the block maximum for fp8); without it the loss adds up.
        step = 1.0 / max_code(fmt) if fmt == "int8" else 2.0**-4
        assert gaps[True][1] <= 3 * step, (fmt, gaps)
        assert gaps[False][0] > 20 * gaps[True][0], (fmt, gaps)
        assert gaps[False][0] > 0.5 * steps * SMALL[fmt], (fmt, gaps)  # without: the small part is lost


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_sum_converges_to_fp32_sum(world: int) -> None:
    run_ranks(_error_feedback, world, timeout=TIMEOUT)


def _overflowed_step(rank: int, world: int) -> None:
    numel = 300
    for fmt, hook in HOOKS.items():
        state = QuantizedState(None, error_feedback=True, block_size=BLOCK)
        for step in range(3):
            g = grad(rank, step, numel)
            if step == 1 and rank == 0:  # an fp16 step that overflowed (a GradScaler then skips it)
                g[7] = float("inf")
            averaged = hook(state, last_bucket(g)).wait()
            assert torch.isfinite(averaged).all() == (step != 1), (fmt, step)
            memories = [*state.error_dict.values(), *state.shard_error_dict.values()]
            assert memories, fmt
            assert all(torch.isfinite(m).all() for m in memories), f"{fmt}: step {step} poisoned the error memory"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_an_overflowed_step_leaves_later_steps_finite(world: int) -> None:
    run_ranks(_overflowed_step, world, timeout=TIMEOUT)


def _resume(rank: int, world: int) -> None:
    numel = 500
    for hook in HOOKS.values():
        state = QuantizedState(None, block_size=BLOCK)
        whole = [hook(state, last_bucket(grad(rank, s, numel), s % 2)).wait().clone() for s in range(8)]
        for stop in (1, 4):
            state = QuantizedState(None, block_size=BLOCK)
            for s in range(stop):
                hook(state, last_bucket(grad(rank, s, numel), s % 2)).wait()
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            for s in range(stop, stop + 2):  # go on, then restore into the same state
                hook(state, last_bucket(grad(rank, s, numel), s % 2)).wait()
            buffer.seek(0)
            state.load_state_dict(torch.load(buffer, weights_only=True))
            for s in range(stop, 8):
                out = hook(state, last_bucket(grad(rank, s, numel), s % 2)).wait()
                assert torch.equal(out, whole[s]), f"{hook.__name__}: step {s} after restoring at {stop}"


@pytest.mark.timeout(600)
def test_bit_identical_resume() -> None:
    run_ranks(_resume, 3, timeout=TIMEOUT)


def _ddp_training(rank: int, world: int) -> None:
    def batch(step: int) -> torch.Tensor:
        return seeded_normal(100 * step + rank, (8, 16), scale=rank + 1, draw=torch.float32)

    def train(hook: object, state: object) -> list[torch.Tensor]:
        # bucket_cap_mb=0.01: several buckets in flight at once.
        return train_ddp(seeded_mlp(16, 64, 64, 4), hook, state, batch, 6, lr=0.02, bucket_cap_mb=0.01)

    exact = train(dcomm.ddp.allreduce_hook, None)
    start = [p.detach().clone() for p in seeded_mlp(16, 64, 64, 4).parameters()]
    for name, hook in HOOKS.items():
        state = QuantizedState(None)
        params = train(hook, state)
        rtol = {"int8": 0.05, "fp8": 0.15}[name]  # of each parameter's change: 2^-7 vs 2^-4 per value
        assert_same_on_ranks(params, name)
        assert_updates_close(params, exact, start, rtol, name)
        # Tiny buckets here (padding to whole blocks per rank): see the byte test for real sizes.
        fp32_bytes = 2 * (world - 1) / world * 4 * sum(p.numel() for p in params) * 6
        assert 0 < state.bytes_sent <= 0.4 * fp32_bytes, (state.bytes_sent, fp32_bytes)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_training_close_to_fp32(world: int) -> None:
    run_ranks(_ddp_training, world, timeout=TIMEOUT)


def _static_graph(rank: int, world: int) -> None:
    # static_graph=True's first iteration launches every bucket at once, all with index 0. Its
    # buckets are the same as without a static graph, so that step's gradients must be the same
    # bits; before the fix the buckets of one size shared one buffer set (off by about 20%).
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = seeded_normal(rank, (8, 16), scale=rank + 1, draw=torch.float32)
    for (name, hook), feedback in itertools.product(HOOKS.items(), (False, True)):
        grads = []
        for static in (False, True):
            net = seeded_mlp(16, 64, 64, 4)
            ddp = DDP(net, bucket_cap_mb_list=[0.0003] * 8, static_graph=static)  # a bucket per parameter
            ddp.register_comm_hook(QuantizedState(None, error_feedback=feedback), hook)
            ddp(x).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for ours, plain in zip(*grads, strict=True):
            assert torch.equal(ours, plain), (name, feedback, (ours - plain).abs().max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_static_graph_first_iteration_equals_plain_ddp(world: int) -> None:
    run_ranks(_static_graph, world, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_wire_bytes_about_a_quarter_of_fp32_allreduce(world: int, fmt: str) -> None:
    for numel in (2**20, 25 * 2**18, 3_000_001):
        fp32_ring = 2 * (world - 1) / world * 4 * numel
        assert quantized_allreduce_bytes(numel, world, fmt) <= 0.27 * fp32_ring
    assert quantized_allreduce_bytes(10**6, 1, fmt) == 0


def test_state_arguments_and_bad_state_dict() -> None:
    with pytest.raises(TypeError, match="error_feedback: expected True or False, got 1"):
        QuantizedState(None, error_feedback=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size: expected an even int >= 2, got 3"):
        QuantizedState(None, block_size=3)
    with pytest.raises(TypeError, match=r"block_size: expected an even int >= 2, got 4\.0"):
        QuantizedState(None, block_size=4.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="process_group: expected a ProcessGroup or None, got int; pass None"):
        QuantizedState(3)  # type: ignore[arg-type]
    # What is sent never depends on timing: the codes at every step, no choice to make.
    with pytest.raises(TypeError, match="bf16_if_faster"):
        QuantizedState(None, bf16_if_faster=True)  # type: ignore[call-arg]
    assert not hasattr(QuantizedState(None), "wire")
    # Every bucket runs eagerly: no CUDA graph replay to turn off.
    with pytest.raises(TypeError, match="cuda_graphs"):
        QuantizedState(None, cuda_graphs=False)  # type: ignore[call-arg]
    assert repr(QuantizedState(None)) == "QuantizedState(error_feedback=True, block_size=256, bytes_sent=0)"
    state = QuantizedState(None, block_size=BLOCK)
    state.bytes_sent = 5
    with pytest.raises(TypeError, match=r"state_dict: expected the mapping QuantizedState.state_dict\(\) returns"):
        state.load_state_dict(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing keys"):
        state.load_state_dict({"bytes_sent": 1})
    with pytest.raises(ValueError, match=r"block_size.*construct QuantizedState"):
        state.load_state_dict(QuantizedState(None).state_dict())
    with pytest.raises(ValueError, match="bytes_sent"):
        state.load_state_dict(dict(state.state_dict(), bytes_sent=-1))
    bad = dict(state.state_dict(), bytes_sent=9, shard_error_dict=[torch.zeros(2)])
    with pytest.raises(TypeError, match=r"state_dict\['shard_error_dict'\]: expected a mapping .* got list"):
        state.load_state_dict(bad)
    assert state.bytes_sent == 5
    # dcomm-ddp 0.1's checkpoints also hold the removed wire choice: it loads, and the codes stay.
    state.load_state_dict(dict(state.state_dict(), bytes_sent=7, wire="bf16", passes=40))
    assert state.bytes_sent == 7
    # A checkpoint that holds the removed cuda_graphs switch loads too.
    state.load_state_dict(dict(state.state_dict(), bytes_sent=8, cuda_graphs=True))
    assert state.bytes_sent == 8
    with pytest.raises(TypeError, match="state: int8_compress_hook expects a QuantizedState or None, got str"):
        int8_compress_hook("WORLD", last_bucket(torch.ones(4)))  # type: ignore[arg-type]


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_nccl() -> None:
    run_ranks(_nccl, 2, backend="nccl", timeout=TIMEOUT)


def _nccl(rank: int, world: int) -> None:
    numel = 10_000
    grads = [grad(r, 0, numel) for r in range(world)]
    for fmt, hook in HOOKS.items():
        gpu_state = QuantizedState(None, error_feedback=False, block_size=BLOCK)
        out = hook(gpu_state, last_bucket(grads[rank].cuda())).wait()
        exact = torch.stack([g.double() for g in grads]).mean(0)
        first = torch.stack([quantization_half_step(g, fmt, BLOCK) for g in grads]).mean(0)
        bound = first + quantization_half_step(exact.abs() + first, fmt, BLOCK) + 1e-6 * exact.abs()
        assert ((out.cpu().double() - exact).abs() <= bound).all(), fmt
        assert gpu_state.bytes_sent == quantized_allreduce_bytes(numel, world, fmt, BLOCK)
        assert out.is_cuda
