"""The quantized hooks' per-bucket work as one CUDA graph: one launch instead of dozens per bucket.

A quantized average of a bucket takes about a dozen kernels and two collectives, and as many
trips through Python on the autograd thread: over 1 ms of host time per bucket, which on a fast
link costs more than the bytes it saves. Once DDP has settled its buckets, every step repeats
the same work on the same tensors (the bucket, its error memories, its send and receive
buffers), so :class:`CapturedAverages` records it once per bucket in a CUDA graph (NCCL
collectives included) and replays it on a side stream; the backward stream waits for it only
at DDP's last bucket.

The process group's watchdog never sees a collective replayed in a graph, so a rank that died
would leave the others waiting in NCCL for good. The caller marks one bucket of each backward
pass as watched (DDP's bucket 0, the first it hands over); every :data:`WATCHED_EVERY`-th time,
that bucket is averaged eagerly instead (the same results), so the watchdog always has a recent
collective to time out on, whatever bucket holds index 0 after a rebuild.

A graph is keyed by the bucket (its index, size and address); whoever replaces a tensor the
graph reads or writes (a restored error memory) calls :meth:`CapturedAverages.clear`. The
graphs share one memory pool (they replay one after the other, in the order they were
captured). A capture that fails turns the graphs off for good, with one warning; that bucket
is then averaged as before.

Example::

    >>> graphs = CapturedAverages()  # doctest: +SKIP
    >>> work = graphs.replay(key, stream)  # None until the key's graph is captured  # doctest: +SKIP
    >>> if work is None and graphs.due(key):  # doctest: +SKIP
    ...     work = graphs.capture(key, lambda: average(bucket), stream)  # average returns its bytes
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from dcomm.core import warn_once

__all__ = ["CAPTURE_AFTER", "MAX_GRAPHS", "WATCHED_EVERY", "CapturedAverages", "StreamWork"]

CAPTURE_AFTER = 2
"""Eager calls per key before its capture: buffers allocated, NCCL communicators created."""

WATCHED_EVERY = 8
"""The watched bucket runs eagerly once in this many calls, where the watchdog sees it."""

MAX_GRAPHS = 512
"""Keys captured at most: buckets handed over in fresh tensors every time (DDP's join shadows)
never repeat, and must not grow the table or the graphs' memory without bound."""


class StreamWork:
    """A replayed average: ``wait()`` orders the current stream after it; ``bytes_sent`` it sent."""

    __slots__ = ("bytes_sent", "done")

    def __init__(self, done: Any, bytes_sent: int) -> None:
        self.done = done
        self.bytes_sent = bytes_sent

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


class _Captured:
    __slots__ = ("graph", "work")

    def __init__(self, graph: Any, work: StreamWork) -> None:
        self.graph, self.work = graph, work


class CapturedAverages:
    """Per key, a CUDA graph of one average, captured after :data:`CAPTURE_AFTER` eager calls."""

    __slots__ = ("_captured", "_eager_calls", "_pool", "_ready", "_watched_calls", "enabled")

    def __init__(self) -> None:
        self._captured: dict[Hashable, _Captured] = {}
        self._eager_calls: dict[Hashable, int] = {}
        self._pool: Any = None
        self._ready: Any = None  # one event, re-recorded for every replay: the bucket is filled
        self._watched_calls = 0
        self.enabled = True

    def __len__(self) -> int:
        return len(self._captured)

    def clear(self) -> None:
        """Forget every graph (a tensor they use was replaced); keys are captured again when due."""
        self._captured.clear()
        self._eager_calls.clear()
        self._pool = None

    def replay(self, key: Hashable, stream: Any, watched: bool = False) -> StreamWork | None:
        """Replay ``key``'s graph on ``stream`` after the current stream's work; None if none yet.

        ``watched``: this is the bucket the watchdog must see now and then (None every
        :data:`WATCHED_EVERY`-th time: average it eagerly).
        """
        captured = self._captured.get(key)
        if captured is None:
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
        if not self.enabled or key in self._captured or len(self._captured) >= MAX_GRAPHS:
            return False
        if len(self._eager_calls) >= 4 * MAX_GRAPHS:  # keys that never came back
            self._eager_calls.clear()
        calls = self._eager_calls.get(key, 0) + 1
        self._eager_calls[key] = calls
        return calls > CAPTURE_AFTER

    def capture(self, key: Hashable, average: Callable[[], int], stream: Any) -> StreamWork | None:
        """Capture ``average`` (which returns the bytes it sends) for ``key`` and replay it.

        None if capturing failed: run the average eagerly.
        """
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the process group's watchdog thread keeps querying its events.
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                bytes_sent = average()
        except Exception as exc:  # a backend or build that cannot capture: stay eager
            self.enabled = False
            self.clear()
            warn_once(
                ("dcomm.ddp.quantized_hooks", "cuda graph"),
                f"quantized hook: capturing a bucket's average in a CUDA graph failed ({type(exc).__name__}: "
                f"{exc}); averaging every bucket without graphs from now on",
            )
            return None
        self._pool = graph.pool()
        if self._ready is None:
            self._ready = torch.cuda.Event()
        self._captured[key] = _Captured(graph, StreamWork(torch.cuda.Event(), bytes_sent))
        return self.replay(key, stream)
