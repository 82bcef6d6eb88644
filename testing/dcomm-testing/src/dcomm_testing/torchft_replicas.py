"""A torchft job on one machine: a lighthouse in this process and one torchft Manager per replica.

Each replica is a one-rank replica group with its own ``TCPStore`` on port 0 and a gloo (or
NCCL, one GPU per replica) process group; the lighthouse binds port 0 too, so parallel tests
never collide. The timeouts are short so that a killed replica is noticed within about a second.

Example::

    >>> lighthouse = start_lighthouse()  # doctest: +SKIP
    >>> manager = make_manager(0, lighthouse.address())  # in a replica's process  # doctest: +SKIP
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["die_after_quorum", "make_manager", "start_lighthouse"]

HEARTBEAT_TIMEOUT_MS = 1000
"""A replica that has not sent a heartbeat for this long is dead to the lighthouse."""


def start_lighthouse(min_replicas: int = 1, join_timeout_ms: int = 30000) -> Any:
    """A torchft ``LighthouseServer`` on a free port of localhost; call ``.shutdown()`` when done.

    A quorum forms once every replica that sends heartbeats has joined (or ``join_timeout_ms``
    after the first joined, with at least ``min_replicas``): start the replicas' first quorums
    together (a barrier after the managers exist) to have all of them in it. The default is
    longer than :func:`make_manager`'s 10 s collective timeout: a survivor whose collective with
    a dead peer only ends at that timeout still makes the next quorum (with equal timeouts it
    missed it by milliseconds under load, and healed from a peer).

    Example::

        >>> start_lighthouse(min_replicas=2).address()  # doctest: +SKIP
    """
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )


def make_manager(
    replica: int,
    lighthouse: str,
    *,
    min_replica_size: int = 1,
    init_sync: bool = True,
    timeout_s: float = 10.0,
    quorum_timeout_s: float = 60.0,
    backend: str = "gloo",
) -> Any:
    """A torchft ``Manager`` for one-rank replica group ``replica``, with its own store.

    ``backend``: ``"gloo"``, or ``"nccl"`` (torchft's ``ProcessGroupNCCL``; the caller has set
    this process's CUDA device).

    Example::

        >>> manager = make_manager(0, lighthouse.address(), init_sync=False)  # doctest: +SKIP
    """
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: got {backend!r}; pass 'gloo' or 'nccl'")
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    manager = Manager(
        pg=(ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo)(timeout=timeout),
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"replica_{replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timeout,
        init_sync=init_sync,
        heartbeat_interval=timedelta(milliseconds=100),
    )
    manager.dcomm_store = store  # the store must live as long as the manager
    return manager


def die_after_quorum(manager: Any, quorum: int) -> None:
    """SIGKILL this process right after ``manager``'s ``quorum``-th quorum (1: the first), before it sends.

    The peers of that quorum then find it dead inside their sync: the point where torchft's own
    DiLoCo throws its survivors' last ``sync_every`` inner steps away.

    Example::

        >>> die_after_quorum(manager, 3)  # dies inside the second sync of a DiLoCoOptimizer  # doctest: +SKIP
    """
    start_quorum = manager.start_quorum
    calls = [0]

    def start_then_maybe_die(*args: Any, **kwargs: Any) -> None:
        start_quorum(*args, **kwargs)
        calls[0] += 1
        if calls[0] == quorum:
            os.kill(os.getpid(), signal.SIGKILL)

    manager.start_quorum = start_then_maybe_die
