"""DiLoCoOptimizer against torchft's DiLoCo, the peer implementation, where torchft is importable.

torchft averages across replica groups that meet through a lighthouse; here a lighthouse runs
in this process and two single-rank replica groups (gloo, CPU) train on the same data as two
ranks of DiLoCoOptimizer. Same fp32 arithmetic, so parameters must be bit-identical after every
step. torchft is not a test dependency: without it this module is skipped. To run it, put
torchft 0.2 and its OpenTelemetry dependencies on ``PYTHONPATH``.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from test_averaging_diloco import backward, make_model, make_optimizers

from dcomm.averaging import DiLoCoOptimizer
from dcomm_testing import run_ranks

pytest.importorskip("torchft")

STEPS = 12
# (sync_every, fragments): torchft's fragments are modules, so each fragment here is one Linear.
CONFIGS = [(3, 1), (6, 3)]


def _torchft_replica(replica: int, lighthouse: str, sync_every: int, fragments: int, folder: str) -> None:
    from torchft.local_sgd import DiLoCo

    from dcomm_testing.torchft_replicas import make_manager

    torch.set_num_threads(1)
    model = make_model(0, torch.float32)
    inner, outer = make_optimizers(model)
    manager = make_manager(replica, lighthouse, min_replica_size=2, timeout_s=60.0, quorum_timeout_s=60.0)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)] if fragments > 1 else [model]
    # One outer optimizer per fragment: with one shared optimizer torchft's outer step would also
    # move the other fragments' parameters by their inner gradients.
    outers = [torch.optim.SGD(layer.parameters(), **outer.defaults) for layer in layers]
    cpu = torch.device("cpu")
    history = []
    with DiLoCo(manager, layers, inner, outers, sync_every=sync_every, backup_device=cpu, pin_memory=False):
        for step in range(1, STEPS + 1):
            inner.zero_grad()
            backward(model, replica, step)
            inner.step()
            history.append([p.detach().clone() for p in model.parameters()])
    manager.shutdown(wait=False)
    torch.save(history, Path(folder) / f"replica{replica}.pt")


def _torchft_history(sync_every: int, fragments: int, folder: Path) -> list[list[list[torch.Tensor]]]:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_torchft_replica, args=(i, server.address(), sync_every, fragments, str(folder)))
        for i in range(2)
    ]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=240)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        server.shutdown()
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return [torch.load(folder / f"replica{i}.pt") for i in range(2)]


def _ours(rank: int, world: int, sync_every: int, fragments: int) -> list[list[list[float]]]:
    model = make_model(rank, torch.float32)
    opt = DiLoCoOptimizer(*make_optimizers(model), sync_every, None, fragments)
    history = []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()
        history.append([p.detach().tolist() for p in model.parameters()])
    return history


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("sync_every", "fragments"), CONFIGS)
def test_diloco_is_bit_identical_to_torchft(sync_every: int, fragments: int, tmp_path: Path) -> None:
    theirs = _torchft_history(sync_every, fragments, tmp_path)
    ours = run_ranks(_ours, 2, sync_every, fragments, timeout=240)
    for rank in range(2):
        for step in range(STEPS):
            for a, b in zip(ours[rank][step], theirs[rank][step], strict=True):
                assert torch.equal(torch.tensor(a), b), f"rank {rank}, step {step + 1} differs from torchft"
