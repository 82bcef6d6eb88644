"""int8/fp8 hooks that send bf16 where it is faster: the schedule, the choice, the hand-over, resume.

The calibration's times come from a clock the test drives (no timing is asserted): each
backward pass "takes" the duration the case gives its wire. Every step's parameters must equal
those of a reference that runs the same schedule by hand: the quantized hook (choice off) for
the first passes and the quantized blocks, dcomm's ``bf16_compress_hook`` for the bf16 blocks and,
once chosen, for good.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.ddp import QuantizedState, bf16_compress_hook, fp8_compress_hook, int8_compress_hook
from dcomm.ddp._wire_choice import CALIBRATION_STEPS, SETTLE_PASSES
from dcomm.ddp.native_hooks import native_hooks_available
from dcomm_testing import captured_log, flat_parameters, rank_device, run_ranks, seeded_mlp, seeded_normal

TIMEOUT = 240.0
HOOKS = {"int8": int8_compress_hook, "fp8": fp8_compress_hook}
BUCKET_MB = 0.002  # several buckets
CALIBRATION = 4 * (CALIBRATION_STEPS + 2)  # 4 blocks: one dropped, the timed ones, one more to end the block
STEPS = SETTLE_PASSES + CALIBRATION + 4
LOGGER = "dcomm.ddp.quantized_hooks"


def scheduled_wire(fmt: str, chosen: str, number: int) -> str:
    """The wire of backward pass ``number`` (1-based): settle, calibrate in blocks, then the choice."""
    if number <= SETTLE_PASSES:
        return fmt
    blocks = ("bf16", fmt, fmt, "bf16")
    if number <= SETTLE_PASSES + CALIBRATION:
        return blocks[(number - SETTLE_PASSES - 1) // (CALIBRATION // 4)]
    return chosen


def reference_hook(fmt: str, chosen: str):
    """A Python hook that runs the schedule by hand with the quantized hook (choice off) and bf16.

    A pass ends at its last bucket (static_graph's first iteration has none: not counted).
    """
    ended = [0]
    quantized = HOOKS[fmt]

    def hook(state, bucket):  # unannotated: DDP then skips its annotation checks
        if scheduled_wire(fmt, chosen, ended[0] + 1) == "bf16":
            future = bf16_compress_hook(None, bucket)
        else:
            future = quantized(state, bucket)
        if bucket.is_last():
            ended[0] += 1
        return future

    return hook


def batch(rank: int, step: int) -> torch.Tensor:
    return seeded_normal(100 * step + rank, (8, 16), scale=rank + 1, draw=torch.float32).to(rank_device())


class _WithUnused(torch.nn.Module):
    """A small MLP and a layer that never runs (for ``find_unused_parameters=True``)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.body = seeded_mlp(16, 32, 32, 4, device=device)
        self.unused = torch.nn.Linear(4, 4, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _ddp(rank: int, unused: bool = False, **options) -> DDP:
    """A small MLP, the same on every rank, in DDP with several buckets (``options``: DDP's)."""
    device = rank_device()
    ids = [device.index] if device.type == "cuda" else None
    torch.manual_seed(0)
    model = _WithUnused(device) if unused else seeded_mlp(16, 32, 32, 4, device=device)
    return DDP(model, device_ids=ids, bucket_cap_mb=BUCKET_MB, **options)


def _train_with_clock(
    rank: int, fmt: str, durations: dict[str, float], chosen: str, accumulate: bool = False, **options
):
    """(model, ddp, state, optimizer) after STEPS steps, equal to the reference at every step.

    ``accumulate``: each step adds a backward under ``no_sync()`` first; ``options``: for DDP.
    """
    ddp, ref_ddp = _ddp(rank, **options), _ddp(rank, **options)
    model, reference = ddp.module, ref_ddp.module
    state = QuantizedState(None, error_feedback=True)
    now = [0.0]
    state._wire.clock = lambda: now[0]
    ddp.register_comm_hook(state, HOOKS[fmt])
    ref_ddp.register_comm_hook(
        QuantizedState(None, error_feedback=True, bf16_if_faster=False), reference_hook(fmt, chosen)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.9)
    native = native_hooks_available()
    for step in range(STEPS):
        now[0] += durations[scheduled_wire(fmt, chosen, step + 1)]  # this pass takes that long on this rank
        for net, optim in ((ddp, opt), (ref_ddp, ref_opt)):
            optim.zero_grad()
            if accumulate:
                with net.no_sync():
                    net(batch(rank, 1000 + step)).square().sum().backward()
            net(batch(rank, step)).square().sum().backward()
            optim.step()
        # Chosen at the end of this pass: the next one's wire, and the C++ hook on for bf16.
        wire = scheduled_wire(fmt, chosen, step + 2)
        assert state._wire.wire(fmt) == wire, (fmt, step, state._wire.wire(fmt), wire)
        assert [s.on for s in state._wire.switches] == ([wire == "bf16"] if native else []), (fmt, step)
        ours, theirs = flat_parameters(model), flat_parameters(reference)
        assert torch.equal(ours, theirs), (fmt, chosen, step, (ours - theirs).abs().max())
    return model, ddp, state, opt


def _choice(rank: int, world: int) -> None:
    records = captured_log(LOGGER)
    native = native_hooks_available()
    for fmt in HOOKS:
        # The last rank finds the quantized wire slow: its slowest time decides for every rank.
        slow_last = {"bf16": 1.0, fmt: 3.0 if rank == world - 1 else 0.5}
        model, ddp, state, opt = _train_with_clock(rank, fmt, slow_last, "bf16")
        assert state.wire == "bf16", state.wire
        assert not state.error_dict, "bf16 keeps no error memories"
        assert not state.shard_error_dict, "bf16 keeps no error memories"
        assert len(state._graphs) == 0, "nor CUDA graphs"
        switches = state._wire.switches
        assert [s.on for s in switches] == ([True] if native else []), "the C++ bf16 hook took over"
        assert [s.hand_over for s in switches] == ([False] if native else []), "still calling back after the choice"
        # Bytes: one more step sends each bucket as a ring allreduce of bf16 values.
        before = state.bytes_sent
        opt.zero_grad()
        ddp(batch(rank, 99)).square().sum().backward()
        numel = sum(p.numel() for p in model.parameters())
        expected = 2 * (world - 1) * numel * 2 // world  # each bucket's count rounds down on its own
        assert 0 <= expected - (state.bytes_sent - before) < 16, (state.bytes_sent - before, expected)

        # Resume into a fresh state, loaded before or after registering: bf16 at once, in C++ too.
        saved = state.state_dict()
        assert saved["wire"] == "bf16", saved
        assert saved["passes"] == SETTLE_PASSES + CALIBRATION, saved
        for load_first in (True, False):
            fresh = QuantizedState(None, error_feedback=True)
            other = _ddp(rank)
            if load_first:
                fresh.load_state_dict(saved)
            other.register_comm_hook(fresh, HOOKS[fmt])
            if not load_first:
                fresh.load_state_dict(saved)
            assert fresh.wire == "bf16"
            assert fresh.bytes_sent == saved["bytes_sent"]
            assert [s.on for s in fresh._wire.switches] == ([True] if native else [])
            other(batch(rank, 0)).square().sum().backward()
            grads = torch.cat([p.grad.flatten() for p in other.parameters()])
            plain = _ddp(rank)
            plain.register_comm_hook(None, bf16_compress_hook)
            plain(batch(rank, 0)).square().sum().backward()
            assert torch.equal(grads, torch.cat([p.grad.flatten() for p in plain.parameters()]))

        # The quantized wire is faster everywhere: it stays, with its error memories.
        model, ddp, state, opt = _train_with_clock(rank, fmt, {"bf16": 2.0, fmt: 1.0}, fmt)
        assert state.wire == fmt
        assert state.error_dict
        assert [s.on for s in state._wire.switches] == ([False] if native else [])
    lines = [m for m in records.messages if "_compress_hook: " in m]
    if rank == 0:
        assert len(lines) == 4, lines
        assert "int8_compress_hook: bf16 is faster on this link" in lines[0], lines
        assert "slowest rank: int8 3000.000 ms, bf16 1000.000 ms" in lines[0], lines
        assert "int8_compress_hook: keeps int8" in lines[1], lines
        assert "fp8_compress_hook: bf16 is faster" in lines[2], lines
    else:
        assert lines == [], lines


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_bf16_where_faster_follows_the_schedule_and_hands_over(world: int) -> None:
    run_ranks(_choice, world, timeout=TIMEOUT)


def _ddp_options(rank: int, world: int) -> None:
    # Gradient accumulation (no_sync), a static graph (whose first iteration hands every bucket
    # over at once, none last: not a pass), unused parameters, gradients as bucket views: the
    # same schedule, the same parameters as the reference at every step.
    cases = [
        {"accumulate": True},
        {"static_graph": True},
        {"find_unused_parameters": True, "unused": True},
        {"gradient_as_bucket_view": True},
    ]
    for options in cases:
        for chosen, durations in (("bf16", {"bf16": 1.0, "int8": 2.0}), ("int8", {"bf16": 2.0, "int8": 1.0})):
            _, _, state, _ = _train_with_clock(rank, "int8", durations, chosen, **options)
            assert state.wire == chosen, (options, state.wire)


def _uneven_inputs(rank: int, world: int) -> None:
    # Under Join, a rank that ran out of data shadows the others' passes through the hook (DDP
    # calls it from Python with zero buckets): it must send in the wire the others send, and
    # switch with them, or the collectives mismatch. The last rank has STEPS batches, the others
    # fewer, so they shadow through the calibration and the switch to bf16.
    from torch.distributed.algorithms.join import Join

    steps = STEPS - 2 * (world - 1 - rank) * 8
    ddp, ref_ddp = _ddp(rank), _ddp(rank)
    state = QuantizedState(None, error_feedback=True)
    now = [0.0]
    state._wire.clock = lambda: now[0]
    ddp.register_comm_hook(state, int8_compress_hook)
    ref_ddp.register_comm_hook(
        QuantizedState(None, error_feedback=True, bf16_if_faster=False), reference_hook("int8", "bf16")
    )
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.02) for net in (ddp, ref_ddp)]
    with Join([ddp, ref_ddp]):
        for step in range(steps):
            now[0] += {"bf16": 1.0, "int8": 2.0}[scheduled_wire("int8", "bf16", step + 1)]
            for net, optim in zip((ddp, ref_ddp), optimizers, strict=True):
                optim.zero_grad()
                net(batch(rank, step)).square().sum().backward()
                optim.step()
    assert state.wire == "bf16", state.wire
    ours, theirs = flat_parameters(ddp.module), flat_parameters(ref_ddp.module)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_bf16_where_faster_under_join_with_uneven_inputs(world: int) -> None:
    run_ranks(_uneven_inputs, world, timeout=TIMEOUT)


@pytest.mark.timeout(600)
def test_bf16_where_faster_with_ddp_options() -> None:
    run_ranks(_ddp_options, 2, timeout=TIMEOUT)


@pytest.mark.timeout(600)
def test_bf16_where_faster_without_the_cpp_hooks() -> None:
    # The bf16 passes then run dcomm's Python bf16 average, from the same hook call.
    run_ranks(_choice, 2, timeout=TIMEOUT, env={"DCOMM_NATIVE_HOOKS": "0"})


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_bf16_where_faster_on_nccl() -> None:
    # The quantized passes replay CUDA graphs here; choosing bf16 frees them.
    run_ranks(_choice, 2, backend="nccl", timeout=TIMEOUT)


def _off_and_old_checkpoints(rank: int, world: int) -> None:
    # bf16_if_faster=False: the codes at every step, no calibration.
    ddp = _ddp(rank)
    state = QuantizedState(None, bf16_if_faster=False)
    ddp.register_comm_hook(state, int8_compress_hook)
    for step in range(STEPS):
        ddp(batch(rank, step)).square().sum().backward()
    assert state.wire is None
    assert state._wire.passes == 0
    assert state._wire.switches == []
    # A checkpoint of dcomm 0.1.0 (no wire, no passes) still loads; a bad wire is refused.
    old = {k: v for k, v in state.state_dict().items() if k not in ("wire", "passes")}
    fresh = QuantizedState(None)
    fresh.load_state_dict(old)
    assert fresh.wire is None
    assert fresh.bytes_sent == state.bytes_sent
    with pytest.raises(ValueError, match="state_dict\\['wire'\\]"):
        fresh.load_state_dict({**state.state_dict(), "wire": "int4"})
    # A calibration cut by a checkpoint starts again after the restore.
    fresh.load_state_dict({**state.state_dict(), "wire": None, "passes": SETTLE_PASSES + 7})
    assert fresh._wire.passes == SETTLE_PASSES - 1  # the next pass ends the settling: timing starts again
    assert fresh.wire is None


@pytest.mark.timeout(300)
def test_choice_off_and_older_checkpoints() -> None:
    run_ranks(_off_and_old_checkpoints, 2, timeout=TIMEOUT)
