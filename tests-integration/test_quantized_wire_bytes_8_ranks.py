"""int8 and fp8 DDP hooks at 8 gloo ranks: the bytes they put on the wire, counted at the c10d
dispatcher (independently of the hooks' own ``bytes_sent``), are at most 0.27x of an fp32 ring
allreduce of the same bucket, and every rank ends with the same, close average.

:class:`tools.demo_lm.comm_bytes.CommCounter` counts the payload each rank hands to each
collective. What travels follows from it per collective: an all-to-all's input minus the rank's
own chunk, ``(world - 1) / world`` of it; an all-gather's input goes to each of the ``world - 1``
peers; a ring allreduce sends ``2 (world - 1) / world`` of its tensor (reduce-scatter, then
all-gather). The same derivation applied to a plain fp32 ``dist.all_reduce`` of the bucket gives
exactly the ring's bytes, ratio 1, so the 0.27 bound would catch a hook that sent fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from dcomm.core import payload_bytes, quantized_average_bytes
from dcomm.core.quantized_average import chunk_numel
from dcomm.ddp import QuantizedState, fp8_compress_hook, int8_compress_hook, quantized_allreduce_bytes
from dcomm_testing import BucketStub, quantization_half_step, run_ranks, spread_normal
from tools.demo_lm.comm_bytes import CommCounter

WORLD = 8
TIMEOUT = 150.0
HOOKS = {"int8": int8_compress_hook, "fp8": fp8_compress_hook}
BLOCK = 256  # the hooks' default block size
MAX_RATIO = 0.27


def wire_bytes(by_collective: dict[str, int], world: int) -> Fraction:
    """Bytes one rank puts on the wire, from the bytes it handed to each ``c10d`` collective."""
    travels = {
        "alltoall_base_": Fraction(world - 1, world),  # the rank's own chunk stays home
        "_allgather_base_": Fraction(world - 1),  # the rank's piece goes to every peer
        "allreduce_": Fraction(2 * (world - 1), world),  # a ring: reduce-scatter, then all-gather
    }
    unexpected = set(by_collective) - set(travels)
    assert not unexpected, f"collectives this test cannot convert to wire bytes: {sorted(unexpected)}"
    return sum((travels[name] * sent for name, sent in by_collective.items()), Fraction(0))


def fp32_ring_bytes(numel: int, world: int) -> Fraction:
    """Bytes one rank sends in a ring allreduce of ``numel`` fp32 values."""
    return Fraction(2 * (world - 1), world) * 4 * numel


@contextlib.contextmanager
def sent_per_collective(counter: CommCounter) -> Iterator[dict[str, int]]:
    """Fills the yielded dict with the bytes this rank handed to each ``c10d`` collective in the block."""
    before = dict(counter.by_collective)
    sent: dict[str, int] = {}
    with counter.counting():
        yield sent
    sent.update({k: v - before.get(k, 0) for k, v in counter.by_collective.items() if v != before.get(k, 0)})


def _measure(rank: int, world: int, numel: int) -> dict[str, tuple[dict[str, int], int]]:
    counter = CommCounter.install()
    # Different on every rank, magnitudes spread over 1e-4..1e1: blocks of very different scales.
    grad = spread_normal(rank, numel, (-4, 1), scale=rank + 1)
    exact = grad.double()  # float64 sum of float32 values: exact to ~1e-16, far below any bound here
    dist.all_reduce(exact)
    exact /= world
    counted = {}
    for fmt, hook in HOOKS.items():
        state = QuantizedState(None, error_feedback=True)  # as registered with DDP; first step: no carried error
        buffer = grad.clone()
        with sent_per_collective(counter) as sent:
            out = hook(state, BucketStub(True, buffer=buffer)).wait()
        counted[fmt] = (sent, state.bytes_sent)
        assert out is buffer, fmt
        # Every rank holds the same average, bit for bit.
        reference = out.clone()
        dist.broadcast(reference, src=0)
        assert torch.equal(out, reference), f"{fmt}: rank {rank} differs from rank 0"
        # Off the exact mean by at most the ranks' roundings (averaged), the re-quantization of the
        # average on its owner, and the fp32 result's own rounding (as in the dcomm-ddp unit test).
        first = quantization_half_step(grad, fmt, BLOCK)
        dist.all_reduce(first)
        first /= world
        second = quantization_half_step(exact.abs() + first, fmt, BLOCK)
        err = (out.double() - exact).abs()
        bound = first + second + exact.abs() * (torch.finfo(torch.float32).eps + 1e-6)
        assert (err <= bound).all(), f"{fmt}: worst excess {(err - bound).max().item():.3e}"
        assert (err > 0).any(), f"{fmt}: no rounding at all: was anything quantized?"
    # The same counter and derivation on an fp32 allreduce of the bucket: exactly the ring's bytes.
    with sent_per_collective(counter) as sent:
        dist.all_reduce(grad.clone())
    counted["fp32 allreduce"] = (sent, 0)
    return counted


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("numel", [25 * 2**18, 3_000_001])  # DDP's default 25 MiB fp32 bucket; an odd size
def test_quantized_hooks_send_at_most_027_of_fp32_allreduce_at_8_ranks(numel: int) -> None:
    per_rank = run_ranks(_measure, WORLD, numel, timeout=TIMEOUT)
    ring = fp32_ring_bytes(numel, WORLD)
    chunk = payload_bytes(chunk_numel(numel, WORLD, BLOCK), "int8", BLOCK)  # fp8 codes are one byte too
    for rank, counted in enumerate(per_rank):
        by_collective, _ = counted.pop("fp32 allreduce")
        assert by_collective == {"allreduce_": 4 * numel}, (rank, by_collective)
        fp32_wire = wire_bytes(by_collective, WORLD)
        assert fp32_wire == ring, rank  # ratio 1: the bound below fails for a hook that sends fp32
        assert fp32_wire / ring > MAX_RATIO
        for fmt, (by_collective, bytes_sent) in counted.items():
            where = f"{fmt}, rank {rank}, numel {numel}"
            # Two-shot: an all-to-all of every rank's chunk, an all-gather of this rank's average.
            assert payload_bytes(chunk_numel(numel, WORLD, BLOCK), fmt, BLOCK) == chunk, where
            assert by_collective == {"alltoall_base_": WORLD * chunk, "_allgather_base_": chunk}, where
            wire = wire_bytes(by_collective, WORLD)
            assert wire == 2 * (WORLD - 1) * chunk, where
            # What the dispatcher saw equals the hook's own counter and the documented formula.
            assert wire == bytes_sent == quantized_allreduce_bytes(numel, WORLD, fmt), where
            assert bytes_sent == quantized_average_bytes(numel, WORLD, fmt, BLOCK, "two_shot"), where
            ratio = wire / ring
            assert ratio <= MAX_RATIO, f"{where}: {float(ratio):.5f} of an fp32 ring allreduce"
            if rank == 0:
                print(f"{fmt} numel={numel} world={WORLD}: {int(wire)} B on the wire, {float(ratio):.5f} of fp32 ring")
