"""Faults: a rank that raises or dies mid-step, resuming from a checkpoint, corrupt checkpoints.

Post-local SGD (DDP with dcomm's hook, dcomm's averager inside ``PostLocalSGDOptimizer``) trains
on every rank with different data. When one rank fails, every other rank must end with an error
of its own (a collective that failed), not hang until it is killed; a checkpoint written before
the failure must resume bit-identically; a truncated or corrupted checkpoint must be refused with
a clear error and leave every object as it was. gloo always; NCCL when there is a GPU per rank.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.averaging import PeriodicModelAverager, PostLocalSGDOptimizer
from dcomm.ddp import PostLocalSGDState, post_localSGD_hook
from dcomm_testing import RankFailure, run_ranks, seeded_batch

WARMUP, STEPS, FAIL_AT = 2, 6, 3
COLLECTIVE_TIMEOUT = 60.0
BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 3 else [])
# On NCCL a peer that fails mid-step leaves the survivors inside a collective until NCCL's
# watchdog times it out, and the watchdog then tears the process down (TORCH_NCCL_ASYNC_ERROR_
# HANDLING) instead of raising in Python: seen on 2x H200, torch 2.11, 2026-11-26 ("Watchdog
# caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE ...)", rank killed). The
# survivors therefore do not end with a Python error there; that test runs on gloo only.
SURVIVOR_BACKENDS = ["gloo"]


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


def _fails_mid_training(rank: int, world: int, backend: str, how: str, folder: str) -> None:
    training = _Training(backend, rank)
    for step in range(STEPS):
        if step == FAIL_AT:
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
