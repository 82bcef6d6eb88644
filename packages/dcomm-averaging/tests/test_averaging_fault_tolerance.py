"""DiLoCoOptimizer and PeriodicModelAverager under a torchft Manager: parity, failures, healing.

A lighthouse runs in the test process; each replica is a spawned process with its own Manager
(one-rank replica group, gloo on the CPU; the failure test also on torchft's NCCL group, one GPU
per replica, where there are 3 GPUs). Without failures the manager path must equal the
``process_group`` path bit for bit (the same gloo sums, the same division). With a replica killed
(SIGKILL) at a chosen point, the survivors must equal an fp64 reference in which that replica
leaves at that sync; a restarted replica must heal from a peer and take part in the later syncs.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_averaging_diloco import backward, make_model, make_optimizers, reference

from dcomm.averaging import DiLoCoOptimizer
from dcomm_testing import run_ranks

pytest.importorskip("torchft")

from dcomm_testing.torchft_replicas import die_after_quorum, make_manager, start_lighthouse

JOIN_TIMEOUT = 120


# -- replicas ---------------------------------------------------------------------------------


def _die_at_commit(manager: Any, commit: int) -> None:
    """SIGKILL this process at its ``commit``-th commit: its peers have its contribution, it never commits."""
    should_commit = manager.should_commit
    calls = [0]

    def maybe_die_then_commit(*args: Any, **kwargs: Any) -> bool:
        calls[0] += 1
        if calls[0] == commit:
            os.kill(os.getpid(), signal.SIGKILL)
        return should_commit(*args, **kwargs)

    manager.should_commit = maybe_die_then_commit


def _wait_for(path: Path) -> None:
    import time

    deadline = time.monotonic() + JOIN_TIMEOUT
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _diloco_replica(replica: int, lighthouse: str, folder: str, cfg: dict[str, Any], barrier: Any) -> None:
    torch.set_num_threads(1)
    backend = cfg.get("backend", "gloo")
    device = torch.device("cuda", replica) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    manager = make_manager(replica, lighthouse, init_sync=cfg["init_sync"], backend=backend)
    if barrier is not None:  # every manager heartbeats: the first quorum waits for all of them
        barrier.wait(timeout=JOIN_TIMEOUT)
    if cfg.get("die_after_quorum"):
        die_after_quorum(manager, cfg["die_after_quorum"])
    if cfg.get("die_at_commit"):
        _die_at_commit(manager, cfg["die_at_commit"])
    # With init_sync the replicas heal from the first at the first quorum: start them apart.
    model = make_model(replica if cfg["init_sync"] else 0, cfg["dtype"]).to(device)
    inner, outer = make_optimizers(model)
    if cfg.get("restarted"):
        (Path(folder) / "up").touch()
    opt = DiLoCoOptimizer(
        inner,
        outer,
        cfg["sync_every"],
        fragments=cfg["fragments"],
        fragment_sync_delay=cfg["delay"],
        compression=cfg["compression"],
        manager=manager,
    )
    history: dict[int, Any] = {"joined_at": opt.inner_steps}
    while opt.inner_steps < cfg["steps"]:
        step = opt.inner_steps + 1
        if step == cfg.get("wait_at_step"):  # until the restarted replica is about to join
            _wait_for(Path(folder) / "up")
        opt.zero_grad()
        backward(model, replica, step)
        opt.step()
        history[opt.inner_steps] = [p.detach().cpu().clone() for p in model.parameters()]
        if cfg.get("step_sleep"):
            import time

            time.sleep(cfg["step_sleep"])
    history["inner"] = inner.state_dict()
    manager.shutdown(wait=False)
    torch.save(history, Path(folder) / f"replica{replica}.pt")


def _run_replicas(
    target: Any, cfgs: list[dict[str, Any]], folder: Path, restart: dict[int, dict[str, Any]] | None = None
) -> dict[int, Any]:
    """Run one process per entry of ``cfgs``; a replica in ``restart`` is started again once it dies."""
    lighthouse = start_lighthouse()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(cfgs))
    procs = {
        i: ctx.Process(target=target, args=(i, lighthouse.address(), str(folder), cfg, barrier))
        for i, cfg in enumerate(cfgs)
    }
    restarted: dict[int, Any] = {}
    try:
        for proc in procs.values():
            proc.start()
        for i, cfg in (restart or {}).items():
            procs[i].join(timeout=JOIN_TIMEOUT)
            assert procs[i].exitcode == -signal.SIGKILL, f"replica {i} should have been killed: {procs[i].exitcode}"
            restarted[i] = ctx.Process(target=target, args=(i, lighthouse.address(), str(folder), cfg, None))
            restarted[i].start()
        everyone = [p for i, p in procs.items() if i not in restarted] + list(restarted.values())
        for proc in everyone:
            proc.join(timeout=JOIN_TIMEOUT)
    finally:
        for proc in [*procs.values(), *restarted.values()]:
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    results = {}
    for i in range(len(cfgs)):
        path = folder / f"replica{i}.pt"
        if path.exists():
            results[i] = torch.load(path)
    return results


def _process_group_replica(rank: int, world: int, cfg: dict[str, Any]) -> dict[int, list[list[float]]]:
    model = make_model(rank, cfg["dtype"])
    opt = DiLoCoOptimizer(
        *make_optimizers(model), cfg["sync_every"], None, cfg["fragments"], cfg["delay"], cfg["compression"]
    )
    history = {}
    for step in range(1, cfg["steps"] + 1):
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()
        history[step] = [p.detach().tolist() for p in model.parameters()]
    return history


# -- without failures: the manager path is the process_group path -----------------------------

PARITY = [
    # (sync_every, fragments, fragment_sync_delay, compression, init_sync)
    (3, 1, 0, None, True),
    (6, 3, 1, None, False),
    (4, 1, 1, "int8", True),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sync_every", "fragments", "delay", "compression", "init_sync"), PARITY)
def test_manager_path_equals_process_group_path(
    sync_every: int, fragments: int, delay: int, compression: str | None, init_sync: bool, tmp_path: Path
) -> None:
    world = 3
    cfg = {
        "sync_every": sync_every,
        "fragments": fragments,
        "delay": delay,
        "compression": compression,
        "init_sync": init_sync,
        "steps": 12,
        "dtype": torch.float32,
    }
    theirs = _run_replicas(_diloco_replica, [cfg] * world, tmp_path)
    ours = run_ranks(_process_group_replica, world, cfg, timeout=240)
    assert sorted(theirs) == list(range(world))
    for rank in range(world):
        for step in range(1, cfg["steps"] + 1):
            for a, b in zip(ours[rank][step], theirs[rank][step], strict=True):
                assert torch.equal(torch.tensor(a), b), f"replica {rank}, step {step}: manager path differs"


# -- bad input --------------------------------------------------------------------------------


def test_manager_and_process_group_together_is_a_value_error() -> None:
    model = make_model(0, torch.float32)
    with pytest.raises(ValueError, match="process_group: got both"):
        DiLoCoOptimizer(*make_optimizers(model), 4, process_group=object(), manager=object())  # type: ignore[arg-type]


def test_manager_that_is_not_a_manager_is_a_type_error() -> None:
    model = make_model(0, torch.float32)
    with pytest.raises(TypeError, match=r"manager: expected a torchft\.Manager"):
        DiLoCoOptimizer(*make_optimizers(model), 4, manager="lighthouse:29510")


def test_without_torchft_the_manager_path_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    model = make_model(0, torch.float32)
    with pytest.raises(ImportError, match=r"dcomm-averaging\[ft\]"):
        DiLoCoOptimizer(*make_optimizers(model), 4, manager=object())


# -- failures: the survivors equal DiLoCo in which the dead replica leaves at that sync ---------


def _fp64_cfg(sync_every: int, steps: int, **overrides: Any) -> dict[str, Any]:
    """A replica's settings for the failure tests: fp64, one fragment, no compression, no init_sync."""
    cfg = {"sync_every": sync_every, "fragments": 1, "delay": 0, "compression": None, "init_sync": False}
    return cfg | {"steps": steps, "dtype": torch.float64} | overrides


def _reference(
    sync_every: int,
    delay: int,
    steps: int,
    contributors: dict[int, list[int]],
    joiner: tuple[int, int, int] | None = None,
) -> dict[int, dict[int, list[torch.Tensor]]]:
    """fp64 DiLoCo over replicas 0-2 where sync ``k`` averages over ``contributors[k]`` (default: the live ones).

    A replica absent from a sync's contributors has left there. ``joiner=(replica,
    sync, source)``: that replica comes back at that sync with the new global parameters and the
    inner optimizer state of ``source``. Returns ``history[replica][step]`` of the live replicas.
    """
    dtype = torch.float64
    models = {r: make_model(0, dtype) for r in range(3)}
    inners = {r: make_optimizers(m)[0] for r, m in models.items()}
    glob = make_model(0, dtype)
    outer = make_optimizers(glob)[1]
    alive = set(range(3))
    waiting: list[tuple[int, int, list[torch.Tensor]]] = []
    history: dict[int, dict[int, list[torch.Tensor]]] = {r: {} for r in range(3)}

    def apply(averages: list[torch.Tensor], sync: int) -> None:
        for p, average in zip(glob.parameters(), averages, strict=True):
            p.grad = average
        outer.step()
        with torch.no_grad():
            for r in alive:
                for p, g in zip(models[r].parameters(), glob.parameters(), strict=True):
                    p.copy_(g)
        if joiner is not None and joiner[1] == sync:
            replica, _, source = joiner
            models[replica] = make_model(0, dtype)
            with torch.no_grad():
                for p, g in zip(models[replica].parameters(), glob.parameters(), strict=True):
                    p.copy_(g)
            inners[replica] = make_optimizers(models[replica])[0]
            inners[replica].load_state_dict(copy.deepcopy(inners[source].state_dict()))  # not shared
            alive.add(replica)

    for step in range(1, steps + 1):
        for r in sorted(alive):
            backward(models[r], r, step)
            inners[r].step()
            inners[r].zero_grad()
        for entry in [w for w in waiting if w[0] == step]:
            waiting.remove(entry)
            apply(entry[2], entry[1])
        if step % sync_every == 0:
            sync = step // sync_every
            members = contributors.get(sync, sorted(alive))
            averages = []
            for j, g in enumerate(glob.parameters()):
                deltas = [g.detach() - list(models[r].parameters())[j].detach() for r in members]
                averages.append(sum(deltas[1:], deltas[0].clone()) / len(members))
            alive.intersection_update(members)  # a replica left at the first sync it is absent from
            if delay == 0:
                apply(averages, sync)
            else:
                waiting.append((step + delay, sync, averages))
        for r in alive:
            history[r][step] = [p.detach().clone() for p in models[r].parameters()]
    return history


def _assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


FAULTS = [
    # (fragment_sync_delay, how replica 2 dies, at which point, syncs whose contributors lack it)
    (0, "die_after_quorum", 3, {2: [0, 1]}),  # inside sync 2, after its quorum: nothing sent
    (0, "die_at_commit", 3, {3: [0, 1]}),  # after sync 2's average, before its commit
    (1, "die_after_quorum", 3, {2: [0, 1]}),  # inside sync 2's delay window: the retry resends
]


ON_GLOO_AND_NCCL_REPLICAS = pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                not torch.distributed.is_nccl_available() or torch.cuda.device_count() < 3,
                reason="torchft's NCCL group needs 3 GPUs here (one per replica)",
            ),
        ),
    ],
)


@pytest.mark.timeout(300)
@ON_GLOO_AND_NCCL_REPLICAS
@pytest.mark.parametrize(("delay", "how", "when", "contributors"), FAULTS)
def test_survivors_lose_no_step_when_a_replica_dies(
    delay: int, how: str, when: int, contributors: dict[int, list[int]], backend: str, tmp_path: Path
) -> None:
    sync_every, steps = 3, 15
    cfg = _fp64_cfg(sync_every, steps, delay=delay, backend=backend)
    ours = _run_replicas(_diloco_replica, [cfg, cfg, {**cfg, how: when}], tmp_path)
    assert sorted(ours) == [0, 1], "replica 2 should have died, the survivors finished"
    reference = _reference(sync_every, delay, steps, contributors)
    for replica in (0, 1):
        for step in range(1, steps + 1):
            _assert_close(ours[replica][step], reference[replica][step], f"replica {replica}, step {step}")
    applied = max(s for s in range(sync_every + delay, steps + 1, sync_every))  # the last sync's result
    for a, b in zip(ours[0][applied], ours[1][applied], strict=True):
        assert torch.equal(a, b), f"the survivors differ after the sync applied at step {applied}"


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not torch.distributed.is_nccl_available() or not torch.cuda.is_available(), reason="needs a GPU and NCCL"
)
def test_one_replica_on_torchft_nccl_equals_diloco(tmp_path: Path) -> None:
    """The manager path on torchft's NCCL group and a GPU model: what one GPU can check."""
    sync_every, steps = 3, 9
    cfg = _fp64_cfg(sync_every, steps, backend="nccl")
    ours = _run_replicas(_diloco_replica, [cfg], tmp_path)
    assert sorted(ours) == [0]
    expected = reference(1, torch.float64, sync_every, 1, 0, 0.0, steps)
    for step in range(1, steps + 1):
        _assert_close(ours[0][step], expected[step - 1][0], f"step {step}")


@pytest.mark.timeout(300)
def test_a_restarted_replica_heals_and_takes_part(tmp_path: Path) -> None:
    sync_every, steps = 3, 24
    cfg = _fp64_cfg(sync_every, steps)
    survivor = {**cfg, "wait_at_step": 13}  # the restarted replica joins at sync 5 or later, before the end
    dying = {**cfg, "die_after_quorum": 3}
    ours = _run_replicas(
        _diloco_replica, [survivor, survivor, dying], tmp_path, restart={2: {**cfg, "restarted": True}}
    )
    assert sorted(ours) == [0, 1, 2]
    joined_at = ours[2]["joined_at"]
    assert joined_at % sync_every == 0, joined_at
    assert sync_every * 2 <= joined_at < steps, joined_at
    sync = joined_at // sync_every
    # Replica 2 left at sync 2 and came back at `sync` (its first quorum: the retry of sync 2 or a later
    # one), healed from 0 or 1.
    contributors = {k: [0, 1] for k in range(2, sync + 1)}
    for step in range(joined_at + 1, steps + 1):
        for a, b in zip(ours[2][step], ours[0][step], strict=True):
            assert not torch.equal(a, b) or step % sync_every == 0
    failures = []
    for source in (0, 1):
        reference = _reference(sync_every, 0, steps, contributors, joiner=(2, sync, source))
        try:
            for replica in (0, 1, 2):
                for step in range(joined_at + 1 if replica == 2 else 1, steps + 1):
                    _assert_close(ours[replica][step], reference[replica][step], f"replica {replica}, step {step}")
            return
        except AssertionError as error:
            failures.append(str(error))
    raise AssertionError("\n".join(failures))


# -- PeriodicModelAverager(manager=...): local SGD -----------------------------------------------

PERIOD, WARMUP, AVERAGER_STEPS = 2, 1, 10


def _local_sgd(model: torch.nn.Module, averager: Any, replica: int, step: int) -> None:
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)  # stateless: a new one per step is the same
    backward(model, replica, step)
    sgd.step()
    averager.average_parameters(model.parameters())
    sgd.zero_grad()


def _averager_replica(replica: int, lighthouse: str, folder: str, cfg: dict[str, Any], barrier: Any) -> None:
    from dcomm.averaging import PeriodicModelAverager

    torch.set_num_threads(1)
    manager = make_manager(replica, lighthouse)
    if cfg.get("die_after_quorum"):
        die_after_quorum(manager, cfg["die_after_quorum"])
    if barrier is not None:
        barrier.wait(timeout=JOIN_TIMEOUT)
    model = make_model(0, cfg["dtype"])
    averager = PeriodicModelAverager(PERIOD, WARMUP, manager=manager)
    history: dict[int, Any] = {}
    while averager.step < AVERAGER_STEPS:
        step = averager.step + 1  # the data of this call
        _local_sgd(model, averager, replica, step)
        history[averager.step] = [p.detach().clone() for p in model.parameters()]
    manager.shutdown(wait=False)
    torch.save(history, Path(folder) / f"replica{replica}.pt")


def _averager_process_group(rank: int, world: int) -> dict[int, list[list[float]]]:
    from dcomm.averaging import PeriodicModelAverager

    model = make_model(0, torch.float32)
    averager = PeriodicModelAverager(PERIOD, WARMUP)
    history = {}
    while averager.step < AVERAGER_STEPS:
        _local_sgd(model, averager, rank, averager.step + 1)
        history[averager.step] = [p.detach().tolist() for p in model.parameters()]
    return history


def _averager_reference(leaves_at: int) -> dict[int, dict[int, list[torch.Tensor]]]:
    """fp64 local SGD of replicas 0-2; replica 2 leaves at the call with step ``leaves_at``."""
    models = {r: make_model(0, torch.float64) for r in range(3)}
    history: dict[int, dict[int, list[torch.Tensor]]] = {r: {} for r in range(3)}
    for call in range(AVERAGER_STEPS):
        if call == leaves_at:
            models.pop(2)
        for r, model in models.items():
            sgd = torch.optim.SGD(model.parameters(), lr=0.05)
            backward(model, r, call + 1)
            sgd.step()
            sgd.zero_grad()
        if call >= WARMUP and (call - WARMUP) % PERIOD == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models.values()), strict=True):
                    mean = sum(p.detach() for p in params) / len(params)
                    for p in params:
                        p.copy_(mean)
        for r, model in models.items():
            history[r][call + 1] = [p.detach().clone() for p in model.parameters()]
    return history


@pytest.mark.timeout(300)
def test_averager_with_manager_equals_process_group_path(tmp_path: Path) -> None:
    ours = _run_replicas(_averager_replica, [{"dtype": torch.float32}] * 3, tmp_path)
    theirs = run_ranks(_averager_process_group, 3, timeout=240)
    for rank in range(3):
        for step in range(1, AVERAGER_STEPS + 1):
            for a, b in zip(ours[rank][step], theirs[rank][step], strict=True):
                # The manager path sums, then divides; average_parameters divides, then sums.
                torch.testing.assert_close(a, torch.tensor(b), rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(300)
def test_averager_survivors_average_without_the_dead_replica(tmp_path: Path) -> None:
    cfg = {"dtype": torch.float64}
    # Quorums: the first call (step 0), then the averaging calls at steps 1, 3, 5...: the third is step 3.
    ours = _run_replicas(_averager_replica, [cfg, cfg, {**cfg, "die_after_quorum": 3}], tmp_path)
    assert sorted(ours) == [0, 1]
    reference = _averager_reference(leaves_at=3)
    for replica in (0, 1):
        for step in range(1, AVERAGER_STEPS + 1):
            _assert_close(ours[replica][step], reference[replica][step], f"replica {replica}, step {step}")


def test_averager_with_manager_and_process_group_is_a_value_error() -> None:
    from dcomm.averaging import PeriodicModelAverager

    with pytest.raises(ValueError, match="process_group: got both"):
        PeriodicModelAverager(4, process_group=object(), manager=object())  # type: ignore[arg-type]


def _manager_here(**kwargs: Any) -> tuple[Any, Any]:
    """A lighthouse and a one-replica torchft Manager in this process (``kwargs`` override)."""
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo

    lighthouse = start_lighthouse()
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    wait = timedelta(seconds=3)
    settings = {
        "pg": ProcessGroupGloo(timeout=wait),
        "min_replica_size": 1,
        "use_async_quorum": False,
        "load_state_dict": None,
        "state_dict": None,
        "replica_id": "replica_0",
        "store_addr": "localhost",
        "store_port": store.port,
        "rank": 0,
        "world_size": 1,
        "lighthouse_addr": lighthouse.address(),
        "timeout": wait,
        "quorum_timeout": wait,
        "connect_timeout": wait,
        **kwargs,
    }
    manager = Manager(**settings)
    manager.dcomm_store = store
    return manager, lighthouse


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"use_async_quorum": True}, ValueError, "use_async_quorum=False"),
        ({"min_replica_size": 2}, TimeoutError, "min_replica_size=2"),
    ],
)
def test_bad_manager_settings_are_clear_errors(settings: dict[str, Any], error: type, message: str) -> None:
    manager, lighthouse = _manager_here(**settings)
    try:
        model = make_model(0, torch.float32)
        with pytest.raises(error, match=message):
            DiLoCoOptimizer(*make_optimizers(model), 4, manager=manager)
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="needs torch built with NCCL")
def test_a_manager_on_nccl_for_a_cpu_model_is_a_value_error() -> None:
    from torchft import ProcessGroupNCCL

    manager, lighthouse = _manager_here(pg=ProcessGroupNCCL())
    try:
        model = make_model(0, torch.float32)
        with pytest.raises(ValueError, match="torchft-nccl"):
            DiLoCoOptimizer(*make_optimizers(model), 4, manager=manager)
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()
