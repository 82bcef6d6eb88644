"""ZeRO overlap step paths: ``step_mode="auto"`` picks one path, the same on every rank.

The forced paths (``"per_bucket"``, ``"fused"``) are checked against non-overlapped ZeRO by the
whole matrix of ``test_ddp_zero_overlap.py``. Here: the calibration's agreement with chosen
times (through its ``clock`` argument), ``"auto"`` end to end (plain ZeRO's parameters at every
step, through the calibration and after it, one log line), and the argument errors. No timing
is asserted.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.ddp import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved, step_mode_of
from dcomm.ddp._zero.step_mode import PATHS, step_calibration
from dcomm_testing import captured_log, flat_parameters, run_ranks, seeded_mlp, seeded_normal

BUCKET_MB = 0.001  # several buckets once DDP settles its layout
RS_TOL = {"rtol": 1e-5, "atol": 1e-6}
LOGGER = "dcomm.ddp.zero_overlap"


def _all_ranks(value: object) -> list[object]:
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


# -- the agreement, with times chosen through the clock ---------------------------------------------


def _agreement(rank: int, world: int) -> list[str]:
    """Ranks that disagree locally still choose one path: the one with the smaller slowest time."""
    records = captured_log(LOGGER)
    chosen = []
    # Case 1: only the last rank finds per_bucket slow (10 s); it is the slowest, so fused wins
    # everywhere although ranks 0..world-2 time per_bucket faster. Case 2: the reverse.
    # Case 3: the per-bucket path leaves 5 s of its work to the next iteration (its parameter
    # collectives wait in the next forward): 6 s per steady iteration against fused's 4 s. Timing
    # alternating passes would charge that spill to fused (9 s against 1 s) and choose per_bucket.
    # Case 4: the per-bucket path must be 2% faster to be chosen.
    cases = [
        ({"per_bucket": 10.0 if rank == world - 1 else 1.0, "fused": 5.0}, "fused", 0.0),
        ({"per_bucket": 5.0, "fused": 10.0 if rank == 0 else 1.0}, "per_bucket", 0.0),
        ({"per_bucket": 1.0, "fused": 4.0}, "fused", 5.0),
        # Case 4: per_bucket 1% faster is within the margin: fused.
        ({"per_bucket": 9.9, "fused": 10.0}, "fused", 0.0),
    ]
    for durations, expected, spill in cases:
        now = [0.0]
        calibration = step_calibration(dist.group.WORLD, steps=2, warmup=1, clock=lambda now=now: now[0])
        modes: list[str] = []
        while calibration.chosen is None:
            mode = calibration.next_path(torch.device("cpu"))
            spilled = spill if modes and modes[-1] == "per_bucket" else 0.0
            modes.append(mode)
            now[0] += durations[mode] + spilled  # this iteration took that long on this rank
        # Blocks of 4 passes, per-bucket, fused, fused, per-bucket (2 timed intervals each), then
        # the choice at the next.
        blocks = ("per_bucket", "fused", "fused", "per_bucket")
        assert modes[:-1] == [path for path in blocks for _ in range(4)], modes
        assert modes[-1] == expected, (durations, modes)
        assert calibration.next_path(torch.device("cpu")) == expected
        assert _all_ranks(expected) == [expected] * world
        chosen.append(modes[-1])
    lines = [m for m in records.messages if "step_mode='auto' chose" in m]
    if rank == 0:
        assert len(lines) == 4, records.messages
        assert "chose 'fused'" in lines[3], lines
        assert "per_bucket 9900.000 ms, fused 10000.000 ms" in lines[3], lines
        assert "chose 'fused'" in lines[2], lines
        assert "per_bucket 6000.000 ms, fused 4000.000 ms" in lines[2], lines
        assert "chose 'fused'" in lines[0], lines
        assert "per_bucket 10000.000 ms, fused 5000.000 ms" in lines[0], lines
        assert "chose 'per_bucket'" in lines[1], lines
        assert "per_bucket 5000.000 ms, fused 10000.000 ms" in lines[1], lines
    else:
        assert lines == [], lines
    return chosen


# -- "auto" end to end -------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    return seeded_mlp(8, 16, 16, 4, activation=torch.nn.ReLU)


def _batch(rank: int, step: int) -> torch.Tensor:
    return seeded_normal(1000 * rank + step, (6, 8), scale=rank + 1, draw=torch.float32)


def _auto(rank: int, world: int) -> list[str]:
    records = captured_log(LOGGER)
    chosen = []
    optims = {"adam": (torch.optim.Adam, {"lr": 0.01}), "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}
    builders = (hook_with_zero_step, hook_with_zero_step_interleaved)
    for build, optim, rs in itertools.product(builders, optims, (False, True)):
        case = f"{build.__name__}-{optim}-rs{rs}"
        cls, kwargs = optims[optim]
        model, ref_model = _model(), _model()
        ddp, ref_ddp = DDP(model, bucket_cap_mb=BUCKET_MB), DDP(ref_model, bucket_cap_mb=BUCKET_MB)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, overlap_with_ddp=True, **kwargs)
        ref_zero = ZeroRedundancyOptimizer(ref_ddp.parameters(), optimizer_class=cls, **kwargs)
        before = len(records.messages)
        hook = build(allreduce_hook, ddp, zero, shard_buckets=True, reduce_scatter=rs)  # step_mode="auto"
        ddp.register_comm_hook(None, hook)
        # hook_with_zero_step with reduce_scatter=False has nothing to overlap per bucket: "fused" at once.
        fixed = build is hook_with_zero_step and not rs
        modes = []
        # 1 unsettled backward, 16 timed ones (8 per path; step 7 has two), the choice at step 16's.
        for step in range(19):
            zero.zero_grad(set_to_none=True)
            ref_zero.zero_grad(set_to_none=True)
            if step == 7:  # accumulate over two backward passes, in the middle of the calibration
                ddp(_batch(rank, 100)).square().sum().backward()
                ref_ddp(_batch(rank, 100)).square().sum().backward()
                ref_zero.step()
            ddp(_batch(rank, step)).square().sum().backward()
            ref_ddp(_batch(rank, step)).square().sum().backward()
            ref_zero.step()
            where = f"{case} step {step}"
            ours, theirs = flat_parameters(model), flat_parameters(ref_model)
            torch.testing.assert_close(ours, theirs, **RS_TOL, msg=lambda m, w=where: f"{w}: {m}")
            modes.append(step_mode_of(hook))
        if fixed:
            assert modes == ["fused"] * 19, (case, modes)
        else:
            assert modes[:16] == [None] * 16, (case, modes)
            assert modes[16] in PATHS, (case, modes)
        assert modes[16:] == [modes[16]] * 3, (case, modes)
        assert _all_ranks(modes[16]) == [modes[16]] * world, case
        lines = [m for m in records.messages[before:] if "step_mode='auto' chose" in m]
        assert len(lines) == (1 if rank == 0 else 0), (case, lines)
        if rank == 0:
            assert f"chose {modes[16]!r}" in lines[0], lines
            assert ("without timing" in lines[0]) == fixed, lines
        chosen.append(modes[16])
    return chosen


def _step_counts(rank: int, world: int) -> list[str]:
    """The fused path runs the local optimizer once per backward; the per-bucket path once per bucket."""
    seen = []
    builders = (hook_with_zero_step, hook_with_zero_step_interleaved)
    for mode, build in itertools.product(("per_bucket", "fused"), builders):
        model = _model()
        ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True)
        hook = build(allreduce_hook, ddp, zero, reduce_scatter=True, step_mode=mode)
        ddp.register_comm_hook(None, hook)
        steps = [0]
        zero.optim.register_step_pre_hook(lambda *_, steps=steps: steps.__setitem__(0, steps[0] + 1))
        counts = []
        for step in range(3):
            steps[0] = 0
            zero.zero_grad(set_to_none=True)
            ddp(_batch(rank, step)).square().sum().backward()
            counts.append(steps[0])
        buckets = len(zero._dcomm_zero_overlap_driver.layout)
        assert buckets > 1
        # Every rank owns a slice of every planned bucket; per bucket, each slice is stepped alone
        # (in the first backward too, when DDP's single bucket completes them all at once).
        assert counts == ([1, 1, 1] if mode == "fused" else [buckets] * 3), (mode, build.__name__, counts)
        assert step_mode_of(hook) == mode
        seen.append(f"{mode}-{build.__name__}")
    return seen


def _suite(rank: int, world: int, parts: list[str]) -> int:
    for part in parts:
        assert len(globals()[part](rank, world)) in (3, 4, 8)
    return len(parts)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_auto_chooses_one_path_on_every_rank_and_keeps_plain_zeros_parameters(world: int) -> None:
    assert run_ranks(_suite, world, ["_agreement", "_auto", "_step_counts"], timeout=300) == [3] * world


# -- argument errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [hook_with_zero_step, hook_with_zero_step_interleaved], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", ["fast", "Fused", "", None, 1, True])
def test_a_bad_step_mode_raises_naming_the_argument(build: object, bad: object) -> None:
    with pytest.raises(ValueError, match=r"step_mode: expected one of \['auto', 'per_bucket', 'fused'\], got "):
        build(allreduce_hook, None, None, step_mode=bad)  # type: ignore[operator]


def test_step_mode_of_rejects_anything_but_an_overlap_hook() -> None:
    with pytest.raises(TypeError, match=r"hook: expected a hook returned by hook_with_zero_step"):
        step_mode_of(allreduce_hook)


# -- CUDA: side stream, CUDA-event calibration, coalesced all-gathers (run on a 2-GPU host) --------


def _cuda_paths(rank: int, world: int) -> list[str]:
    device = torch.device("cuda", torch.cuda.current_device())
    seen = []
    for mode, rs in itertools.product(("per_bucket", "fused", "auto"), (False, True)):
        model, ref_model = _model().to(device), _model().to(device)
        ddp, ref_ddp = DDP(model, bucket_cap_mb=BUCKET_MB), DDP(ref_model, bucket_cap_mb=BUCKET_MB)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True)
        # dcomm's local step runs torch's fused Adam on CUDA: compare with plain ZeRO on the same kernel.
        ref_zero = ZeroRedundancyOptimizer(ref_ddp.parameters(), optimizer_class=torch.optim.Adam, fused=True)
        hook = hook_with_zero_step(allreduce_hook, ddp, zero, shard_buckets=True, reduce_scatter=rs, step_mode=mode)
        ddp.register_comm_hook(None, hook)
        # "auto" with reduce_scatter=True calibrates for 16 passes once DDP has settled (its 2nd).
        for step in range(20 if mode == "auto" else 12):
            x = _batch(rank, step).to(device)
            for d, z in ((ddp, zero), (ref_ddp, ref_zero)):
                z.zero_grad(set_to_none=True)
                d(x).square().sum().backward()
            ref_zero.step()
            where = f"{mode}-rs{rs} step {step}"
            ours, theirs = flat_parameters(model), flat_parameters(ref_model)
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
        chosen = step_mode_of(hook)
        assert chosen in PATHS, (mode, chosen)
        assert _all_ranks(chosen) == [chosen] * world
        seen.append(f"{mode}-rs{rs}")
    return seen


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_every_path_keeps_plain_zeros_parameters() -> None:
    assert [len(r) for r in run_ranks(_cuda_paths, 2, backend="nccl", timeout=300)] == [6, 6]
