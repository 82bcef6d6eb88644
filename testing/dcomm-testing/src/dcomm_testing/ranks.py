"""Run a function on N ranks of a fresh process group: the shared multi-process test helper.

Each rank is a separate process joined through a ``FileStore`` in a private temporary folder, so
concurrent pytest-xdist workers never collide. Ranks start from a fork server that has already
imported torch (fast on Linux); a rank's exception is re-raised in the caller with its traceback,
and a rank that hangs is killed after ``timeout`` seconds with a message naming it.

Example::

    >>> def worker(rank: int, world_size: int, scale: float) -> float:
    ...     t = torch.tensor([rank * scale])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> run_ranks(worker, 2, 1.5)  # doctest: +SKIP
    [1.5, 1.5]
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

__all__ = ["RankFailure", "rank_process_context", "run_ranks"]

T = TypeVar("T")


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung; the message holds each rank's story."""


def rank_process_context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """Where rank processes come from: a fork server that has imported torch once (Linux), else spawn.

    Example::

        >>> rank_process_context().Process(target=main).start()  # doctest: +SKIP
    """
    if sys.platform.startswith("linux"):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.nn.parallel"])
        return ctx
    return multiprocessing.get_context("spawn")


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    env: Mapping[str, str],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank % int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        device_id = None
        if backend == "nccl":
            device_id = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device_id)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
            device_id=device_id,
        )
        _wait_for_all(store, "dcomm/initialized", world_size, max(timeout, _START_S))
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # fn may have aborted it (NCCL, after a failure)
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


_START_S = 60.0
"""Seconds at least that ranks get to start and meet (CUDA and NCCL start-up), whatever ``timeout``."""

_GRACE_S = 10.0
"""Seconds the other ranks get to end by themselves once one rank has failed (then they are killed)."""


def _wait_for_all(store: Any, key: str, world_size: int, timeout: float) -> None:
    """Store barrier: no rank may start (and quickly tear down) before every rank's connections are up."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: not every rank of {world_size} joined within {timeout:.0f}s")
        time.sleep(0.005)


def _drain(results: Any, outcomes: dict[int, tuple[bool, Any]]) -> None:
    """Collect results queued by ranks that have already exited."""
    try:
        while True:
            rank, ok, value = results.get(timeout=0.5)
            outcomes[rank] = (ok, value)
    except queue.Empty:
        pass


def _start(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    backend: str,
    timeout: float,
    env: Mapping[str, str],
    store_path: str,
) -> tuple[list[Any], Any]:
    """Start one process per rank; return the processes and the queue their outcomes arrive on."""
    ctx = rank_process_context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, backend, store_path, timeout, dict(env), args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return procs, results


def _collect(procs: list[Any], results: Any, timeout: float, grace: float) -> dict[int, tuple[bool, Any]]:
    """Each rank's ``(ok, value or traceback)``; ranks still running ``grace`` s after a failure, or at the
    deadline, are killed."""
    world_size = len(procs)
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + max(timeout, _START_S) + 30.0
    first_failure: float | None = None
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                if all(p.exitcode is not None for p in procs):
                    _drain(results, outcomes)
                    break
                # Survivors of a failed rank block in its collectives: stop them soon.
                if (first_failure is not None and now - first_failure > grace) or now > deadline:
                    break
                continue
            outcomes[rank] = (ok, value)
            if not ok and first_failure is None:
                first_failure = time.monotonic()
    finally:
        finished = len(outcomes) == world_size
        for proc in procs:
            if not finished and proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return outcomes


def _report(name: str, procs: list[Any], outcomes: dict[int, tuple[bool, Any]], timeout: float) -> None:
    """Raise :class:`RankFailure` with every failed or missing rank's story, if any."""
    world_size = len(procs)
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        failures.append(
            f"ranks {missing} returned nothing (exit codes {codes}): they died, or were killed "
            f"after {timeout:.0f}s or after another rank failed"
        )
    if failures:
        raise RankFailure(f"{name} failed on {world_size} ranks:\n" + "\n".join(failures))


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    grace: float = _GRACE_S,
) -> list[T]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return their results.

    ``fn`` must be importable by name (a module-level function) and its arguments and result
    picklable. ``env`` is set in every rank before the process group starts (``LOCAL_WORLD_SIZE``
    for a simulated multi-node layout, say). ``timeout`` bounds the process group's collectives
    and the whole run; starting and meeting get at least 60 s whatever it says (CUDA and NCCL
    start-up), so a short collective timeout does not fail the start. Once a rank has failed, the
    others get ``grace`` seconds to end by themselves before they are killed (raise it above
    ``timeout`` where they must time out in a collective and report that, as NCCL ranks do).

    Example::

        >>> run_ranks(worker, 4, env={"LOCAL_WORLD_SIZE": "2"})  # doctest: +SKIP
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    folder = tempfile.mkdtemp(prefix="dcomm-ranks-")
    try:
        procs, results = _start(fn, world_size, args, backend, timeout, env or {}, os.path.join(folder, "store"))
        outcomes = _collect(procs, results, timeout, grace)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _report(fn.__name__, procs, outcomes, timeout)
    return [outcomes[r][1] for r in range(world_size)]
