"""Hook results DDP can read at once: the collectives of a backward pass are waited for at its last bucket.

DDP's reducer reads the future of every bucket only after the last bucket's hook has returned
(in its finalize step, on the stream of that last call). So a hook called by the reducer may
return a future that is already complete, holding the tensor the collective writes, provided
that at the last bucket it orders the current stream (CUDA: a stream wait, the host does not
block) or the host (gloo) after every collective launched since. DDP then reads the same values
it would through the collectives' own futures, and no bucket pays for a ``Future.then``
callback: on CUDA each one records events, waits on streams and re-enters Python, on the
autograd thread that also launches the backward kernels.

DDP does not always hand buckets over one by one, though (see :mod:`dcomm.ddp._bucket_order`):
in ``static_graph=True``'s first iteration it reads them right after launching them all. So a
bucket that does not follow the previous one (for this group) makes every call wait at once,
its own collective included, until a last bucket is seen again. Waiting for
more than needed is harmless; works are kept per process group.

Example::

    >>> work = start_allreduce(buffer, group)  # doctest: +SKIP
    >>> return defer_to_last_bucket(group, work, bucket, buffer)  # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import completed_future
from dcomm.ddp._bucket_order import BucketOrder

__all__ = ["defer_to_last_bucket", "wait_deferred"]


@dataclass
class _InFlight:
    """One process group's works since its last bucket, and how the buckets have come so far."""

    works: list[Any] = field(default_factory=list)
    order: BucketOrder = field(default_factory=BucketOrder)
    wait_at_once: bool = False  # the buckets stopped following each other: wait at every call


# Weak keys: a destroyed process group takes its entry with it.
_IN_FLIGHT: weakref.WeakKeyDictionary[Any, _InFlight] = weakref.WeakKeyDictionary()


def defer_to_last_bucket(
    group: dist.ProcessGroup, work: Any, bucket: dist.GradBucket, result: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """A completed future of ``result``; at the last bucket, wait for every work launched on ``group``.

    Only for hooks that DDP's reducer calls: a Python caller may read ``result`` as soon as the
    future is returned.
    """
    state = _IN_FLIGHT.get(group)
    if state is None:
        state = _IN_FLIGHT[group] = _InFlight()
    follows, last = state.order.advance(bucket)
    if not follows:
        state.wait_at_once = True
    state.works.append(work)
    if last or state.wait_at_once:
        _wait_all(state)
    if last:
        state.wait_at_once = False
    return completed_future(result)


def wait_deferred(group: dist.ProcessGroup) -> None:
    """Wait now for the works deferred on ``group``: for a last bucket that a hook handles otherwise.

    A hook that defers some buckets and returns a real future for others calls this at a last
    bucket of the second kind, so that DDP never reads a bucket whose work is still deferred.
    """
    state = _IN_FLIGHT.get(group)
    if state is None:
        return
    _wait_all(state)
    state.wait_at_once = False
    state.order = BucketOrder()


def _wait_all(state: _InFlight) -> None:
    """Wait for the group's works launched since its last wait, in launch order."""
    works, state.works = state.works, []
    for pending in works:
        pending.wait()  # a stream wait on CUDA; re-raises a failed collective's error
