"""The quantized average on real ranks: bit-exact against a single-process simulation (each block
quantized on its own, chunks averaged in one process), within the float64 rounding bound of the
exact mean, exact bytes, and error feedback that telescopes: the sum of the averages plus the
final error memories equals the sum of the exact means up to float32 arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dcomm.core import QuantizedAverage, payload_bytes, quantized_average_bytes
from dcomm.core.quantization import dequantize_rows, quantize_rows
from dcomm.core.quantized_average import AVERAGE_FORMATS, AVERAGE_PATTERNS, chunk_numel
from dcomm_testing import quantization_half_step, run_ranks

BLOCK = 32
TIMEOUT = 240.0


def rank_tensor(rank: int, step: int, numel: int) -> torch.Tensor:
    """Different on every rank and step; magnitudes 1e-3..1e1, so blocks get different scales."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    scale = torch.logspace(-3, 1, numel, dtype=torch.float64)[torch.randperm(numel, generator=gen)]
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * scale * (rank + 1)).float()


def encode_decode(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the wire makes of float32 ``values`` (whole blocks): each block quantized on its own.

    Through the row functions, as the collective, so that the fused CUDA kernels (one code apart
    from the flat torch form on rare rounding boundaries) give the same bits on GPUs too.
    """
    if fmt == "bf16":
        return values.to(torch.bfloat16).float()
    return dequantize_rows(quantize_rows(values.view(-1, BLOCK), fmt, BLOCK), fmt, BLOCK, BLOCK).view(-1)


def simulate(inputs: list[torch.Tensor], fmt: str, pattern: str) -> torch.Tensor:
    """The average every rank should get (float32), computed in one process."""
    world, numel = len(inputs), inputs[0].numel()
    if pattern == "all_gather":
        padded = -(-numel // BLOCK) * BLOCK
        copies = torch.stack([encode_decode(F.pad(x.float(), (0, padded - numel)), fmt) for x in inputs])
        return copies.sum(0)[:numel].div(world)
    chunk = chunk_numel(numel, world, BLOCK)
    sent = [encode_decode(F.pad(x.float(), (0, world * chunk - numel)), fmt) for x in inputs]
    chunks = []
    for c in range(world):
        mean = torch.stack([s[c * chunk : (c + 1) * chunk] for s in sent]).sum(0).div_(world)
        chunks.append(encode_decode(mean, fmt))
    return torch.cat(chunks)[:numel]


def _matches_simulation(rank: int, world: int, device_type: str = "cpu") -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    for fmt in AVERAGE_FORMATS:
        for pattern in AVERAGE_PATTERNS:
            averager = QuantizedAverage(fmt, BLOCK, pattern)
            # Not a multiple of world * BLOCK (a padded tail), an exact multiple, less than a block.
            for step, numel in enumerate((1000, 2 * world * BLOCK, 7)):
                inputs = [rank_tensor(r, step, numel) for r in range(world)]
                exact = torch.stack([x.double() for x in inputs]).mean(0)
                for dtype in (torch.float32, torch.bfloat16, torch.float64):
                    expected = simulate([x.to(device, dtype) for x in inputs], fmt, pattern)
                    tensor = inputs[rank].to(device, dtype, copy=True)
                    pending = averager.begin(tensor, None, key=0)  # one key: buffers reused and resized
                    first = pending.launch()
                    if dtype == torch.float32:  # as DDP hooks do: the rest in the first collective's callback
                        out = first.then(lambda _, pending=pending: pending.result()).wait()
                    else:
                        out = pending.result()
                    assert out is tensor
                    assert torch.equal(out, expected.to(dtype)), f"{fmt} {pattern} {numel} {dtype}"
                    assert pending.bytes_sent == quantized_average_bytes(numel, world, fmt, BLOCK, pattern)
                if fmt in ("int8", "fp8"):
                    # Each rank's rounding, averaged; two-shot adds the average's own rounding
                    # (bounded through the exact mean plus the first stage's error).
                    first = torch.stack([quantization_half_step(x, fmt, BLOCK) for x in inputs]).mean(0)
                    bound = first + 1e-6 * exact.abs()
                    if pattern == "two_shot":
                        bound += quantization_half_step(exact.abs() + first, fmt, BLOCK)
                    expected = simulate(inputs, fmt, pattern)
                    err = (expected.double() - exact).abs()
                    assert (err <= bound).all(), f"{fmt} {pattern}: worst excess {(err - bound).max().item():.3e}"
                    assert (err > 0).any(), "nothing was rounded: was anything quantized?"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_simulation_and_exact_bound(world: int) -> None:
    run_ranks(_matches_simulation, world, timeout=TIMEOUT)


def test_wire_bytes() -> None:
    for world in (2, 3, 4, 8):
        for numel in (1, 1000, 2**20, 3_000_001):
            chunk = chunk_numel(numel, world, 256)
            assert quantized_average_bytes(numel, world, "int8") == 2 * (world - 1) * payload_bytes(chunk, "int8")
            assert quantized_average_bytes(numel, world, "fp8", 256, "all_gather") == (world - 1) * payload_bytes(
                numel, "fp8"
            )
            assert quantized_average_bytes(numel, world, "bf16") == 2 * (world - 1) * 2 * chunk
        assert quantized_average_bytes(2**20, world, "int8") <= 0.27 * 2 * (world - 1) / world * 4 * 2**20
    assert quantized_average_bytes(10**6, 1, "int8") == 0


STEPS = 20


def _error_feedback(rank: int, world: int) -> None:
    numel = 1000
    for i, fmt in enumerate(AVERAGE_FORMATS):
        for pattern in AVERAGE_PATTERNS:
            averager = QuantizedAverage(fmt, BLOCK, pattern)
            # Both accepted lengths of the error memory: whole blocks (read in place) and numel.
            length = averager.padded_numel(numel, world) if i % 2 else numel
            error = torch.zeros(length)
            shard_error = torch.zeros(averager.shard_numel(numel, world)) if pattern == "two_shot" else None
            total = torch.zeros(numel, dtype=torch.float64)
            exact = torch.zeros(numel, dtype=torch.float64)
            magnitude = 0.0
            for step in range(STEPS):
                x = rank_tensor(rank, step, numel)
                pending = averager.begin(x.clone(), None, error=error, shard_error=shard_error, key="k")
                if step == 0:  # the first memory is exactly what encoding this rank's tensor lost
                    padded = F.pad(x, (0, averager.padded_numel(numel, world) - numel))
                    assert torch.equal(error[:numel], x - encode_decode(padded, fmt)[:numel]), (fmt, pattern)
                pending.launch()
                total += pending.result().double()
                inputs = [rank_tensor(r, step, numel).double() for r in range(world)]
                exact += torch.stack(inputs).mean(0)
                magnitude = max(magnitude, max(t.abs().max().item() for t in inputs))
            # sum(averages) = sum(exact means) - mean over ranks of the error memories - the shard
            # memories, each shard where its chunk lies; up to a few float32 roundings per step.
            errors = [torch.empty_like(error) for _ in range(world)]
            dist.all_gather(errors, error)
            carried = torch.stack([e[:numel].double() for e in errors]).mean(0)
            if shard_error is not None:
                shards = [torch.empty_like(shard_error) for _ in range(world)]
                dist.all_gather(shards, shard_error)
                carried += torch.cat(shards)[:numel].double()
            slack = STEPS * 2.0**-22 * magnitude
            residual = (total - exact + carried).abs().max().item()
            assert residual <= slack, f"{fmt} {pattern}: off by {residual:.3e} > {slack:.3e}"
            assert (total - exact).abs().max().item() > 10 * slack, f"{fmt} {pattern}: the memories carried nothing"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_error_feedback_carries_exactly_what_rounding_lost(world: int) -> None:
    run_ranks(_error_feedback, world, timeout=TIMEOUT)


def _overflowed_step(rank: int, world: int) -> None:
    numel = 8 * BLOCK
    bad_blocks = (0, 5)
    for fmt in AVERAGE_FORMATS:
        averager = QuantizedAverage(fmt, BLOCK)
        error = torch.zeros(averager.padded_numel(numel, world))
        shard_error = torch.zeros(averager.shard_numel(numel, world))

        def average(
            x: torch.Tensor,
            averager: QuantizedAverage = averager,
            error: torch.Tensor = error,
            shard_error: torch.Tensor = shard_error,
        ) -> torch.Tensor:
            pending = averager.begin(x, None, error=error, shard_error=shard_error, key="k")
            pending.launch()
            return pending.result()

        for step in range(2):
            average(rank_tensor(rank, step, numel))
        before = error.clone()
        x = rank_tensor(rank, 2, numel)
        if rank == 1:  # an fp16 step that overflowed on one rank: an inf in one block, a NaN in another
            x[bad_blocks[0] * BLOCK + 3] = float("inf")
            x[bad_blocks[1] * BLOCK + 1] = float("nan")
        out = average(x)
        for block in bad_blocks:  # every rank sees the step as bad there (so a GradScaler skips it)
            assert not torch.isfinite(out[block * BLOCK : (block + 1) * BLOCK]).all(), (fmt, block)
        # The memories stay finite: where the update was not, the carried error is kept.
        assert torch.isfinite(error).all(), fmt
        assert torch.isfinite(shard_error).all(), fmt
        if rank == 1:  # int8/fp8 blocks share one scale, so the whole block keeps its error; bf16 the value
            bad = ~torch.isfinite(x)
            if fmt != "bf16":
                bad = bad.view(-1, BLOCK).any(1, keepdim=True).expand(-1, BLOCK).reshape(-1)
            assert torch.equal(error[:numel][bad], before[:numel][bad]), fmt
            assert not torch.equal(error[:numel][~bad], before[:numel][~bad]), fmt
        good = [b for b in range(numel // BLOCK) if b not in bad_blocks]
        assert all(torch.isfinite(out[b * BLOCK : (b + 1) * BLOCK]).all() for b in good), fmt
        after = average(rank_tensor(rank, 3, numel))
        assert torch.isfinite(after).all(), (
            f"{fmt}: the next step is still poisoned at {(~torch.isfinite(after)).nonzero().view(-1)[:8].tolist()}"
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_an_overflowed_step_does_not_poison_the_error_memories(world: int) -> None:
    run_ranks(_overflowed_step, world, timeout=TIMEOUT)


def _group_of_one_and_bad_arguments(rank: int, world: int) -> None:
    averager = QuantizedAverage("int8", BLOCK)
    x = rank_tensor(rank, 0, 100)
    error = torch.zeros(100)
    pending = averager.begin(x, None, error=error)
    assert pending.bytes_sent == 0
    pending.launch().wait()
    assert pending.result() is x
    assert torch.equal(x, rank_tensor(rank, 0, 100)), "a group of one sends nothing, so nothing is rounded"
    assert not error.any()
    with pytest.raises(RuntimeError, match="launch: this average was already launched"):
        pending.launch()
    with pytest.raises(ValueError, match="tensor: expected a contiguous tensor"):
        averager.begin(torch.ones(8, 8).t(), None)
    with pytest.raises(TypeError, match="tensor: expected a floating tensor"):
        averager.begin(torch.ones(8, dtype=torch.int32), None)
    with pytest.raises(ValueError, match=r"error: expected a contiguous float32 tensor of 100 or 128 values"):
        averager.begin(x, None, error=torch.zeros(101))
    with pytest.raises(ValueError, match="shard_error"):
        averager.begin(x, None, shard_error=torch.zeros(BLOCK - 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="shard_error: the 'all_gather' pattern"):
        QuantizedAverage("int8", BLOCK, "all_gather").begin(x, None, shard_error=torch.zeros(BLOCK))


@pytest.mark.timeout(300)
def test_group_of_one_and_bad_arguments() -> None:
    run_ranks(_group_of_one_and_bad_arguments, 1, timeout=TIMEOUT)


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="fmt: expected one of"):
        QuantizedAverage("int2")
    with pytest.raises(ValueError, match="pattern: expected one of"):
        QuantizedAverage("int8", pattern="ring")
    with pytest.raises(ValueError, match="block_size"):
        QuantizedAverage("int8", block_size=3)
    with pytest.raises(TypeError, match="block_size"):
        QuantizedAverage("int8", block_size=256.0)  # type: ignore[arg-type]


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_matches_simulation_on_nccl() -> None:
    run_ranks(_matches_simulation, 2, "cuda", backend="nccl", timeout=TIMEOUT)


def _caller_stream_never_waits(rank: int, world: int) -> None:
    # Rank 1 joins the all-to-all only after rank 0 has seen its own stream drain: if the middle
    # step made rank 0's current stream wait for the communication, this would hang.
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    side_channel = dist.new_group(backend="gloo")
    averager = QuantizedAverage("int8", BLOCK)
    x = rank_tensor(rank, 0, 4096).to(device)
    # Before the test, every rank together: NCCL connects its communicator and its point-to-point
    # channels, and CUDA loads every kernel of the average (a lazily loaded kernel cannot load
    # while a collective kernel waits for the other rank, so the first use would hang here).
    averager.begin(x.clone(), None, error=torch.zeros(4096, device=device)).result()
    torch.ones(1, device=device).add_(1)
    torch.cuda.synchronize(device)
    pending = averager.begin(x, None, error=torch.zeros(4096, device=device))
    if rank == 1:
        dist.barrier(group=side_channel)
    pending.launch()
    pending.advance()
    if rank == 0:
        after = torch.ones(1, device=device).add_(1)
        torch.cuda.current_stream(device).synchronize()
        assert after.item() == 2.0
        dist.barrier(group=side_channel)
    out = pending.result()
    expected = simulate([rank_tensor(r, 0, 4096).to(device) for r in range(world)], "int8", "two_shot")
    assert torch.equal(out, expected)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_caller_stream_never_waits_for_the_communication_on_nccl() -> None:
    run_ranks(_caller_stream_never_waits, 2, backend="nccl", timeout=TIMEOUT)
