"""An average that repeats on the same tensors, replayed as one CUDA graph: one launch instead of dozens.

Work that repeats on the same tensors every call (a quantized hook's bucket, with its error
memories and buffers) costs host time per kernel and per collective, often more than the device
time on a fast link. :class:`CapturedAverages` records it once per key in a CUDA graph (NCCL
collectives included) after a few eager calls and replays it on a side stream; the caller's
stream waits for it. dcomm-ddp's int8/fp8 hooks use it.

The process group's watchdog never sees a collective replayed in a graph, so a rank that died
would leave the others waiting in NCCL for good. The caller marks calls as watched (DDP's
bucket 0, the first it hands over); every :data:`WATCHED_EVERY`-th watched call runs eagerly
instead (the same results), so the watchdog always has a recent collective to time out on.

A graph is keyed by what it touches (a bucket's index, size and address); whoever replaces a
tensor a graph reads or writes calls :meth:`CapturedAverages.forget` or
:meth:`CapturedAverages.clear`. The graphs share one memory pool: they replay one at a time
on the one side stream, and none leaves a tensor behind. A capture that fails turns the graphs
off for good, with one warning naming ``owner``; the work then runs eagerly as before.
``DCOMM_CUDA_GRAPHS=0`` (:data:`SWITCH`) turns them off from the next call.

Example::

    >>> graphs = CapturedAverages("quantized hook")  # doctest: +SKIP
    >>> work = graphs.replay(key, stream)  # None until the key's graph is captured  # doctest: +SKIP
    >>> if work is None and graphs.due(key):  # doctest: +SKIP
    ...     work = graphs.capture(key, lambda: average(bucket), stream)  # average returns its bytes
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from dcomm.core.environment import switched_on
from dcomm.core.log import warn_once

__all__ = ["CAPTURE_AFTER", "MAX_GRAPHS", "SWITCH", "WATCHED_EVERY", "CapturedAverages", "StreamWork", "release_all"]

SWITCH = "DCOMM_CUDA_GRAPHS"
"""``0`` (alike on every rank) runs every average eagerly: no capture, no replay (unset: on)."""

CAPTURE_AFTER = 2
"""Eager calls per key before its capture: buffers allocated, NCCL communicators created."""

WATCHED_EVERY = 8
"""The watched bucket runs eagerly once in this many calls, where the watchdog sees it."""

MAX_GRAPHS = 512
"""Keys captured at most: buckets handed over in fresh tensors every time (DDP's join shadows)
never repeat, and must not grow the table or the graphs' memory without bound."""


class StreamWork:
    """A replayed average: ``wait()`` orders its device's current stream after it; ``bytes_sent`` it sent."""

    __slots__ = ("bytes_sent", "device", "done")

    def __init__(self, done: Any, bytes_sent: int, device: torch.device) -> None:
        self.done = done
        self.bytes_sent = bytes_sent
        self.device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.done)


class _Captured:
    """A graph, what its replay hands back, and what must live as long as it (memory it touches)."""

    __slots__ = ("graph", "keep", "work")

    def __init__(self, graph: Any, work: StreamWork, keep: object) -> None:
        self.graph, self.work, self.keep = graph, work, keep


class CapturedAverages:
    """Per key, a CUDA graph of one average, captured after :data:`CAPTURE_AFTER` eager calls."""

    __slots__ = (
        "__weakref__",
        "_captured",
        "_eager_calls",
        "_pool",
        "_ready",
        "_watched_calls",
        "enabled",
        "max_graphs",
        "owner",
        "reserved_bytes",
    )

    def __init__(self, owner: str, max_graphs: int = MAX_GRAPHS) -> None:
        self.owner = owner
        """Who captures, as the one warning on a failed capture names it."""
        self.max_graphs = max_graphs
        self._captured: dict[Hashable, _Captured] = {}
        self._eager_calls: dict[Hashable, int] = {}
        self._pool: Any = None
        self._ready: Any = None  # one event, re-recorded for every replay: the inputs are ready
        self._watched_calls = 0
        self.enabled = True
        self.reserved_bytes = 0
        """Device memory the graphs' pool reserved while capturing (held while a graph lives)."""
        _LIVE.add(self)

    def __len__(self) -> int:
        return len(self._captured)

    def clear(self) -> None:
        """Forget every graph (a tensor they use was replaced); keys are captured again when due."""
        self._captured.clear()
        self._eager_calls.clear()
        self._pool = None
        self.reserved_bytes = 0

    def forget(self, key: Hashable) -> None:
        """Forget ``key``'s graph and its count (what it touches changed); captured again when due."""
        self._captured.pop(key, None)
        self._eager_calls.pop(key, None)
        if not self._captured:
            self._pool = None  # the pool's memory goes back with the last graph
            self.reserved_bytes = 0

    def replay(self, key: Hashable, stream: Any, watched: bool = False) -> StreamWork | None:
        """Replay ``key``'s graph on ``stream`` after the current stream's work; None if none yet.

        ``watched``: this is the bucket the watchdog must see now and then (None every
        :data:`WATCHED_EVERY`-th time: average it eagerly).
        """
        captured = self._captured.get(key)
        if captured is None or not switched_on(SWITCH):
            return None
        if self.eager_turn(watched):
            return None  # eager this time: a collective the watchdog can time out on
        ready = self._ready
        ready.record(torch.cuda.current_stream(stream.device))  # the bucket is filled on it
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            captured.graph.replay()
        work = captured.work
        work.done.record(stream)  # waited for within this backward pass, before the next replay
        return work

    def eager_turn(self, watched: bool) -> bool:
        """Count a call of the watched bucket; whether it is averaged eagerly this time."""
        if not watched:
            return False
        self._watched_calls += 1
        return self._watched_calls % WATCHED_EVERY == 0

    def due(self, key: Hashable) -> bool:
        """Count an eager call of ``key``; whether its graph should be captured now."""
        if not self.enabled or key in self._captured or len(self._captured) >= self.max_graphs:
            return False
        if not switched_on(SWITCH):
            return False
        if len(self._eager_calls) >= 4 * self.max_graphs:  # keys that never came back
            self._eager_calls.clear()
        calls = self._eager_calls.get(key, 0) + 1
        self._eager_calls[key] = calls
        return calls > CAPTURE_AFTER

    def capture(self, key: Hashable, average: Callable[[], int], stream: Any, keep: object = None) -> StreamWork | None:
        """Capture ``average`` (which returns the bytes it sends) for ``key`` and replay it.

        ``keep``: an object that owns device memory the graph reads or writes (kept alive with
        it). None if capturing failed: run the average eagerly.
        """
        graph = torch.cuda.CUDAGraph()
        reserved = 0
        try:
            # thread_local: the process group's watchdog thread keeps querying its events.
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                reserved = torch.cuda.memory_reserved(stream.device)  # after the capture emptied the cache
                bytes_sent = average()
        except Exception as exc:  # a backend or build that cannot capture: stay eager
            self.enabled = False
            self.clear()
            warn_once(
                (self.owner, "cuda graph"),
                f"{self.owner}: capturing an average in a CUDA graph failed ({type(exc).__name__}: "
                f"{exc}); averaging without graphs from now on",
            )
            return None
        self.reserved_bytes += max(0, torch.cuda.memory_reserved(stream.device) - reserved)
        self._pool = graph.pool()
        if self._ready is None:
            self._ready = torch.cuda.Event()
        self._captured[key] = _Captured(graph, StreamWork(torch.cuda.Event(), bytes_sent, stream.device), keep)
        return self.replay(key, stream)


_LIVE: weakref.WeakSet[CapturedAverages] = weakref.WeakSet()
"""Every :class:`CapturedAverages` alive, so that :func:`release_all` reaches their graphs."""


def release_all() -> None:
    """Destroy every captured graph now (after the device finishes them); they are captured again when due.

    A CUDA graph that holds NCCL collectives and is alive while its communicator is destroyed
    hangs ``destroy_process_group`` (pytorch/pytorch#115388: NCCL waits for the graph to go
    first). Importing this module makes every process group's ``shutdown``, which
    ``destroy_process_group`` calls however it was imported, call this first; it also runs at
    exit.

    Example::

        >>> release_all()  # nothing captured: returns at once
    """
    live = [graphs for graphs in list(_LIVE) if len(graphs)]
    if not live:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no graph is destroyed while it still runs
    for graphs in live:
        graphs.clear()


def _releasing_graphs_first(shutdown: Callable[..., Any]) -> Callable[..., Any]:
    """``shutdown`` (``ProcessGroup.shutdown``) preceded by :func:`release_all`."""

    @functools.wraps(shutdown)
    def releasing_shutdown(*args: Any, **kwargs: Any) -> Any:
        release_all()
        return shutdown(*args, **kwargs)

    releasing_shutdown.__dcomm_releases_graphs__ = True  # type: ignore[attr-defined]
    return releasing_shutdown


def _release_graphs_before_shutdown() -> None:
    """Make ``ProcessGroup.shutdown`` release dcomm's graphs first (once per process).

    The method, not ``destroy_process_group``: a script that imported that function by name
    before dcomm (the DDP tutorial's form) keeps torch's function, whose every path shuts the
    group down through this method (torch 2.11 and 2.13, where it is tested). ``abort`` is left
    alone: it is for a collective that never finishes, which the device synchronisation would
    wait for.
    """
    from torch.distributed import ProcessGroup

    shutdown = getattr(ProcessGroup, "shutdown", None)
    if shutdown is not None and not getattr(shutdown, "__dcomm_releases_graphs__", False):
        ProcessGroup.shutdown = _releasing_graphs_first(shutdown)  # type: ignore[method-assign]


atexit.register(release_all)
if torch.distributed.is_available():
    _release_graphs_before_shutdown()
