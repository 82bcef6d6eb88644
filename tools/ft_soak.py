"""Fault soak: DiLoCo on torchft with a replica killed (SIGKILL) every few syncs and restarted.

Three replicas (one process each, gloo on the CPU) train a small MLP with
``DiLoCoOptimizer(manager=...)``; a lighthouse runs in this process. Every 5 to 10 syncs one
replica (in turn) is killed and started again at once: it heals from a live peer at its first
quorum. Every replica writes a checksum of its parameters after every sync; the soak passes when
the run ends (no hang), every sync was committed by at least one replica, and all replicas that
committed a sync hold the same parameters after it. It reports the failures survived, how long
the survivors waited to commit after each kill and how long the restarted replica took to heal.

Usage::

    python -m tools.ft_soak                      # 3 replicas, 60 syncs, about 1-2 minutes
    python -m tools.ft_soak --syncs 24 --kills 1  # the CI-sized run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dcomm.averaging import DiLoCoOptimizer
from dcomm_testing.torchft_replicas import make_manager, start_lighthouse

REPLICAS = 3
SYNC_EVERY = 5


def checksum(model: torch.nn.Module) -> str:
    """A digest of the parameters' bytes: equal digests, equal parameters."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def replica_main(replica: int, lighthouse: str, folder: str, steps: int, barrier: Any, step_sleep: float) -> None:
    """Train until ``steps`` inner steps; after every sync append ``{sync, step, checksum, time}``."""
    torch.set_num_threads(1)
    manager = make_manager(replica, lighthouse, timeout_s=5.0)
    if barrier is not None:
        barrier.wait(timeout=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    if barrier is None:  # restarted: about to join the others' next quorum
        (Path(folder) / "up").touch()
    opt = DiLoCoOptimizer(inner, outer, SYNC_EVERY, manager=manager)
    log = (Path(folder) / f"replica{replica}.jsonl").open("a")
    log.write(json.dumps({"joined_at": opt.inner_steps, "pid": os.getpid(), "time": time.time()}) + "\n")
    log.flush()
    while opt.inner_steps < steps:
        step = opt.inner_steps + 1
        if step == steps and (Path(folder) / "hold").exists():  # let a restarted replica join the last sync
            while not (Path(folder) / "up").exists():
                time.sleep(0.05)
            time.sleep(2.0)  # it builds its optimizer and asks for a quorum
        generator = torch.Generator().manual_seed(1000 * replica + step)
        x = torch.randn(16, 32, generator=generator)
        loss = ((model(x) - x.roll(1, dims=1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if opt.inner_steps % SYNC_EVERY == 0:
            record = {"sync": opt.inner_steps // SYNC_EVERY, "checksum": checksum(model), "time": time.time()}
            log.write(json.dumps(record) + "\n")
            log.flush()
        time.sleep(step_sleep)
    manager.shutdown(wait=False)


def _records(folder: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for replica in range(REPLICAS):
        path = folder / f"replica{replica}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        out[replica] = [json.loads(line) for line in lines if line.endswith("}")]
    return out


def run(
    folder: Path, syncs: int, kills: int | None, seed: int = 0, step_sleep: float = 0.2, margin: int = 12
) -> dict[str, Any]:
    """Run the soak in ``folder``; return its summary (raises ``RuntimeError`` when it fails).

    ``step_sleep`` paces the inner steps (a sync about every second) so that a restarted replica,
    whose start takes seconds, is back within a few syncs; the next kill waits until it is. No kill
    happens in the last ``margin`` syncs, and while a restarted replica is not back the others wait
    before their last step until it is about to join (else it would wait for a quorum that never
    comes).
    """
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lighthouse = start_lighthouse()
    ctx = multiprocessing.get_context("spawn")
    steps = syncs * SYNC_EVERY
    barrier = ctx.Barrier(REPLICAS)

    def start(replica: int, first: bool) -> Any:
        args = (replica, lighthouse.address(), str(folder), steps, barrier if first else None, step_sleep)
        proc = ctx.Process(target=replica_main, args=args)
        proc.start()
        return proc

    procs = {i: start(i, True) for i in range(REPLICAS)}
    started = time.time()
    deadline = started + 120 + syncs * 10
    events: list[dict[str, Any]] = []
    next_kill = rng.randint(5, 10)
    victim = 0
    try:
        while any(p.is_alive() for p in procs.values()):
            if time.time() > deadline:
                raise RuntimeError(f"ft_soak: no end after {deadline - started:.0f} s: a replica hangs")
            records = _records(folder)
            done = max((r["sync"] for rs in records.values() for r in rs if "sync" in r), default=0)
            budget_left = kills is None or len(events) < kills
            since = events[-1]["time"] if events else 0.0
            everyone_back = all(any("sync" in r and r["time"] > since for r in rs) for rs in records.values())
            if everyone_back:
                (folder / "hold").unlink(missing_ok=True)
                (folder / "up").unlink(missing_ok=True)
            if budget_left and everyone_back and next_kill <= done <= syncs - margin:
                procs[victim].kill()
                procs[victim].join()
                events.append({"replica": victim, "after_sync": done, "time": time.time()})
                (folder / "hold").touch()
                procs[victim] = start(victim, False)
                victim = (victim + 1) % REPLICAS
                next_kill = done + rng.randint(5, 10)
            time.sleep(0.05)
        failed = [i for i, p in procs.items() if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"ft_soak: replicas {failed} exited with {[procs[i].exitcode for i in failed]}")
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    return _summary(_records(folder), events, syncs, time.time() - started)


def _summary(records: dict[int, list[dict[str, Any]]], events: list[dict[str, Any]], syncs: int, wall: float) -> dict:
    by_sync: dict[int, set[str]] = {}
    for rs in records.values():
        for r in rs:
            if "sync" in r:
                by_sync.setdefault(r["sync"], set()).add(r["checksum"])
    missing = [k for k in range(1, syncs + 1) if k not in by_sync]
    differing = [k for k, sums in by_sync.items() if len(sums) > 1]
    if missing or differing:
        raise RuntimeError(f"ft_soak: syncs never committed {missing}; replicas differ after syncs {differing}")
    for event in events:
        after = [r for rs in records.values() for r in rs if "sync" in r and r["time"] > event["time"]]
        event["survivors_commit_s"] = round(min(r["time"] for r in after) - event["time"], 2) if after else None
        mine = [r for r in records[event["replica"]] if "joined_at" in r and r["time"] > event["time"]]
        healed = [r for r in records[event["replica"]] if "sync" in r and r["time"] > event["time"]]
        event["heal_s"] = round(min(r["time"] for r in healed) - event["time"], 2) if healed and mine else None
        event["rejoined_at_step"] = mine[0]["joined_at"] if mine else None
    return {
        "replicas": REPLICAS,
        "syncs": syncs,
        "sync_every": SYNC_EVERY,
        "failures_survived": len(events),
        "wall_s": round(wall, 1),
        "equal_after_every_sync": True,
        "kills": events,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=60)
    parser.add_argument("--kills", type=int, help="at most this many kills (default: every 5-10 syncs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("ft-soak"))
    args = parser.parse_args(argv)
    for stale in args.out.glob("replica*.jsonl"):
        stale.unlink()
    summary = run(args.out, args.syncs, args.kills, args.seed)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    for event in summary["kills"]:
        print(
            f"killed replica {event['replica']} after sync {event['after_sync']}: survivors committed "
            f"{event['survivors_commit_s']} s later, it healed (rejoined at step {event['rejoined_at_step']}) "
            f"{event['heal_s']} s after the kill"
        )
    print(
        f"{summary['failures_survived']} failures survived over {summary['syncs']} syncs in {summary['wall_s']} s; "
        "every replica equal after every sync"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
