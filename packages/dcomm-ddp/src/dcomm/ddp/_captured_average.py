"""The quantized hooks' per-bucket work as one CUDA graph: one launch instead of dozens per bucket.

A quantized average of a bucket takes about a dozen kernels and two collectives, and as many
trips through Python on the autograd thread: over 1 ms of host time per bucket, which on a fast
link costs more than the bytes it saves. Once DDP has settled its buckets, every step repeats
the same work on the same tensors (the bucket, its error memories, its send and receive
buffers), so :class:`CapturedAverages` records it once per bucket in a CUDA graph (NCCL
collectives included) and replays it on the averager's side stream; the backward stream waits
for it only at DDP's last bucket.

A graph is keyed by the addresses of every tensor it reads or writes, so a rebuilt bucket or a
restored error memory gets a new one. The graphs share one memory pool (they replay one after
the other, in the order they were captured). A capture that fails turns the graphs off for
this state, with one warning; that bucket is then averaged as before.

Example::

    >>> graphs = CapturedAverages()  # doctest: +SKIP
    >>> done = graphs.run(key, lambda: average(bucket), side_stream)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from dcomm.core import warn_once

__all__ = ["CAPTURE_AFTER", "CapturedAverages", "StreamWork"]

CAPTURE_AFTER = 2
"""Eager calls per key before its capture: buffers allocated, NCCL communicators created."""


class StreamWork:
    """A work handle whose ``wait()`` orders the current stream after an event."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream(self.event.device).wait_event(self.event)


class CapturedAverages:
    """Per key, a CUDA graph of one average, captured after :data:`CAPTURE_AFTER` eager calls."""

    __slots__ = ("_eager_calls", "_graphs", "_pool", "enabled")

    def __init__(self) -> None:
        self._graphs: dict[Hashable, Any] = {}
        self._eager_calls: dict[Hashable, int] = {}
        self._pool: Any = None
        self.enabled = True

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, average: Callable[[], None], stream: Any) -> StreamWork | None:
        """Replay ``key``'s graph of ``average`` on ``stream`` (capturing it first when due).

        Returns the work to wait for, or None when the caller must run ``average`` eagerly
        itself (too early for this key, or graphs turned off).
        """
        if not self.enabled:
            return None
        graph = self._graphs.get(key)
        if graph is None:
            calls = self._eager_calls.get(key, 0)
            if calls < CAPTURE_AFTER:
                self._eager_calls[key] = calls + 1
                return None
            graph = self._capture(key, average, stream)
            if graph is None:
                return None
        current = torch.cuda.current_stream(stream.device)
        stream.wait_stream(current)  # the bucket is filled on the current stream
        with torch.cuda.stream(stream):
            graph.replay()
        return StreamWork(stream.record_event())

    def _capture(self, key: Hashable, average: Callable[[], None], stream: Any) -> Any:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the process group's watchdog thread keeps querying its events.
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                average()
        except Exception as exc:  # a backend or build that cannot capture: stay eager
            self.enabled = False
            self._graphs.clear()
            warn_once(
                ("dcomm.ddp.quantized_hooks", "cuda graph"),
                f"quantized hook: capturing a bucket's average in a CUDA graph failed ({type(exc).__name__}: "
                f"{exc}); averaging every bucket without graphs from now on",
            )
            return None
        self._pool = graph.pool()
        self._graphs[key] = graph
        return graph
