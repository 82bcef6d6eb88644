"""Faults: a rank that raises or dies mid-step, resuming from a checkpoint, corrupt checkpoints.

Post-local SGD (DDP with dcomm's hook, dcomm's averager inside ``PostLocalSGDOptimizer``) trains
on every rank with different data. When one rank fails, every other rank must end with an error
of its own (a collective that failed), not hang until it is killed; a checkpoint written before
the failure must resume bit-identically; a truncated or corrupted checkpoint must be refused with
a clear error and leave every object as it was. gloo always; NCCL when there is a GPU per rank.

On NCCL a survivor's collective never fails by itself: its kernel waits for the dead peer. By
default NCCL's watchdog then tears the whole process down after the collective timeout, and no
Python error is ever raised. The NCCL form therefore runs with ``TORCH_NCCL_BLOCKING_WAIT=1``
(``work.wait()`` blocks the host and raises ``DistBackendError`` at the timeout), a timeout of a
few seconds, and the failure at an averaging step, so that the averager's ``work.wait()`` is the
first place a survivor waits for the dead peer: a CUDA synchronization before it (the next step's
batch copy, or DDP's runtime statistics at the start of its first 10 forwards) would block for
good. Each rank aborts its process group on an error, since ``destroy_process_group`` waits for
the collectives the dead peer never joins.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.averaging import PeriodicModelAverager, PostLocalSGDOptimizer
from dcomm.ddp import PostLocalSGDState, post_localSGD_hook
from dcomm_testing import RankFailure, run_ranks, seeded_batch
from tools.launch import MULTICAST_OFF

WARMUP, STEPS, FAIL_AT = 2, 6, 3
COLLECTIVE_TIMEOUT = 60.0
BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 3 else [])
# With NCCL's defaults a peer that fails mid-step leaves the survivors inside a collective until
# NCCL's watchdog times it out, and the watchdog then tears the process down (TORCH_NCCL_ASYNC_
# ERROR_HANDLING) instead of raising in Python: seen on 2x H200, torch 2.11, 2026-11-26 ("Watchdog
# caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE ...)", rank killed). This form
# therefore runs on gloo; the NCCL form below (see the module docstring) has settings of its own.
SURVIVOR_BACKENDS = ["gloo"]
NCCL_FAIL_AT = 4  # an averaging step: PeriodicModelAverager(period=2, warmup_steps=2) averages at 2, 4, ...
NCCL_COLLECTIVE_TIMEOUT = 5.0
# work.wait() blocks the host and raises at the timeout; the name is read by torch 2.11 to 2.13.
NCCL_ERRORS_IN_PYTHON = {**MULTICAST_OFF, "TORCH_NCCL_BLOCKING_WAIT": "1"}


def _device(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


class _Training:
    """One parameter (DDP's bucket layout never changes, so a resume is exact), SGD with momentum."""

    def __init__(self, backend: str, rank: int) -> None:
        torch.manual_seed(0)
        self.device = _device(backend, rank)
        module = torch.nn.Linear(6, 3, bias=False).to(self.device)
        self.model = DDP(module, device_ids=[rank] if backend == "nccl" else None)
        self.hook = PostLocalSGDState(None, None, start_localSGD_iter=WARMUP)
        self.model.register_comm_hook(self.hook, post_localSGD_hook)
        local = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.opt = PostLocalSGDOptimizer(local, PeriodicModelAverager(period=2, warmup_steps=WARMUP))

    def step(self, rank: int, step: int) -> None:
        self.opt.zero_grad()
        x = seeded_batch(rank, step, (5, 6)).to(self.device)
        (self.model(x) ** 2).mean().backward()
        self.opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.module.state_dict(), "opt": self.opt.state_dict(), "hook": self.hook.state_dict()}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self.model.module.load_state_dict(checkpoint["model"])
        self.opt.load_state_dict(checkpoint["opt"])
        self.hook.load_state_dict(checkpoint["hook"])

    def snapshot(self) -> list[torch.Tensor]:
        """Parameters, optimizer state and counters, to compare bit for bit."""
        state = self.opt.optim.state_dict()["state"]
        tensors = [p.detach().cpu().clone() for p in self.model.parameters()]
        tensors += [v.cpu().clone() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [*tensors, torch.tensor([self.opt.averager.step, self.hook.iter])]


def _checkpoint_path(folder: str, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.pt"


def _fails_mid_training(rank: int, world: int, backend: str, how: str, folder: str, fail_at: int = FAIL_AT) -> None:
    training = _Training(backend, rank)
    for step in range(STEPS):
        if step == fail_at:
            torch.save(training.state_dict(), _checkpoint_path(folder, rank))
            if rank == world - 1:
                if how == "dies":
                    os._exit(3)
                raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        training.step(rank, step)


@pytest.mark.parametrize("backend", SURVIVOR_BACKENDS)
@pytest.mark.parametrize("how", ["raises", "dies"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(300)
def test_a_failed_rank_ends_every_other_rank_with_an_error(tmp_path: Path, backend: str, how: str, world: int) -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_fails_mid_training, world, backend, how, str(tmp_path), backend=backend, timeout=COLLECTIVE_TIMEOUT)
    report = str(failure.value)
    failed = world - 1
    if how == "raises":
        assert f"injected failure on rank {failed}" in report, report
    else:
        assert f"ranks [{failed}] returned nothing" in report, report
    # Every survivor raised by itself, within the collective timeout: none was killed as hung.
    for rank in range(failed):
        assert f"--- rank {rank} ---" in report, report
    assert "returned nothing" not in report.replace(f"ranks [{failed}] returned nothing", ""), report


def _fails_mid_training_on_nccl(rank: int, world: int, how: str, folder: str) -> None:
    try:
        _fails_mid_training(rank, world, "nccl", how, folder, fail_at=NCCL_FAIL_AT)
    except BaseException:
        # destroy_process_group would wait for the collectives that the failed rank never joins.
        dist.distributed_c10d._abort_process_group()
        raise


def _nccl_ranks_or_skip(world: int) -> None:
    gpus = torch.cuda.device_count()
    if not dist.is_nccl_available() or gpus < world:
        pytest.skip(
            f"the NCCL form needs torch.distributed with NCCL and {world} CUDA GPUs (one per rank); "
            f"NCCL available: {dist.is_nccl_available()}, GPUs: {gpus}"
        )


def _rank_reports(report: str) -> dict[int, str]:
    """Each rank's story in a RankFailure report (``--- rank N ---`` up to the next one)."""
    parts = re.split(r"^--- rank (\d+) ---$", report, flags=re.MULTILINE)
    return {int(rank): story for rank, story in zip(parts[1::2], parts[2::2], strict=True)}


# The error a survivor must end with: NCCL's timeout of the averager's allreduce (the dead peer is
# not detected on one host; the averager's grouped launch shows as a COALESCED work), or NCCL's
# report of a remote failure where the transport notices it.
NCCL_SURVIVOR_ERROR = re.compile(
    r"DistBackendError: .*(collective operation timeout: WorkNCCL\(.*OpType=(ALLREDUCE|COALESCED)|ncclRemoteError)",
    re.DOTALL,
)


@pytest.mark.parametrize("how", ["raises", "dies"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.timeout(240)
def test_on_nccl_a_failed_rank_ends_every_other_rank_with_a_collective_error(
    tmp_path: Path, how: str, world: int
) -> None:
    _nccl_ranks_or_skip(world)
    with pytest.raises(RankFailure) as failure:
        run_ranks(
            _fails_mid_training_on_nccl,
            world,
            how,
            str(tmp_path),
            backend="nccl",
            timeout=NCCL_COLLECTIVE_TIMEOUT,
            env=NCCL_ERRORS_IN_PYTHON,
            grace=60.0,  # survivors report their own timeout error, NCCL_COLLECTIVE_TIMEOUT after the failure
        )
    report = str(failure.value)
    failed = world - 1
    if how == "raises":
        assert f"injected failure on rank {failed}" in _rank_reports(report)[failed], report
    else:
        assert f"ranks [{failed}] returned nothing (exit codes {{{failed}: 3}})" in report, report
    # Every survivor raised a Python error from the collective: none was torn down by NCCL's
    # watchdog, killed as hung, or finished training as if nothing had happened.
    stories = _rank_reports(report)
    for rank in range(failed):
        assert rank in stories, report
        assert NCCL_SURVIVOR_ERROR.search(stories[rank]), stories[rank]
        assert "average_parameters" in stories[rank], stories[rank]  # in the averager's collective
    assert "returned nothing" not in report.replace(f"ranks [{failed}] returned nothing", ""), report


def _resumes_bit_identically(rank: int, world: int, backend: str, folder: str) -> None:
    uninterrupted = _Training(backend, rank)
    for step in range(STEPS):
        uninterrupted.step(rank, step)
    resumed = _Training(backend, rank)
    checkpoint = torch.load(_checkpoint_path(folder, rank), map_location=resumed.device)
    resumed.load_state_dict(checkpoint)
    for step in range(FAIL_AT, STEPS):
        resumed.step(rank, step)
    for ours, reference in zip(resumed.snapshot(), uninterrupted.snapshot(), strict=True):
        assert torch.equal(ours, reference), (ours, reference)


def _corrupt_checkpoints_refused(rank: int, world: int, backend: str, folder: str) -> None:
    training = _Training(backend, rank)
    for step in range(2):
        training.step(rank, step)
    before = training.snapshot()
    path = _checkpoint_path(folder, rank)
    blob = path.read_bytes()
    truncated = path.with_suffix(".truncated")
    truncated.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(RuntimeError, match=r"(?i)zip|archive|file"):
        torch.load(truncated)
    good = torch.load(io.BytesIO(blob), map_location=training.device)
    corrupted = [
        (training.opt, {**good["opt"], "step": -1}),
        (training.opt, {**good["opt"], "step": "3"}),
        (training.hook, {**good["hook"], "iter": torch.tensor(3)}),
        (training.hook, {k: v for k, v in good["hook"].items() if k != "iter"}),
        (training.hook, [1, 2, 3]),
    ]
    for target, checkpoint in corrupted:
        with pytest.raises((TypeError, ValueError), match=r"^state_dict"):
            target.load_state_dict(checkpoint)  # type: ignore[arg-type]
    for ours, reference in zip(training.snapshot(), before, strict=True):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(600)
def test_checkpoint_before_a_failure_resumes_and_corrupt_ones_are_refused(tmp_path: Path, backend: str) -> None:
    world = 3
    with pytest.raises(RankFailure):
        run_ranks(_fails_mid_training, world, backend, "raises", str(tmp_path), backend=backend, timeout=60)
    run_ranks(_resumes_bit_identically, world, backend, str(tmp_path), backend=backend, timeout=120)
    run_ranks(_corrupt_checkpoints_refused, world, backend, str(tmp_path), backend=backend, timeout=120)
