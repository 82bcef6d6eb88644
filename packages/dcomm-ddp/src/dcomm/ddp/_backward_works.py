"""Hook results DDP can read at once: the collectives of a backward pass are waited for at its last bucket.

DDP's reducer reads the future of every bucket only after the last bucket's hook has returned
(in its finalize step, on the stream of that last call). So a hook called by the reducer may
return a future that is already complete, holding the tensor the collective writes, provided
that at the last bucket it orders the current stream (CUDA: a stream wait, the host does not
block) or the host (gloo) after every collective launched since. DDP then reads the same values
it would through the collectives' own futures, and no bucket pays for a ``Future.then``
callback: on CUDA each one records events, waits on streams and re-enters Python, on the
autograd thread that also launches the backward kernels.

Waiting for more than needed is harmless, so works are kept per process group: two models that
share a group and run their backward passes one after the other each wait at their own last
bucket.

Example::

    >>> work = start_allreduce(buffer, group)  # doctest: +SKIP
    >>> return defer_to_last_bucket(group, work, bucket, buffer)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import completed_future

__all__ = ["defer_to_last_bucket"]

# Process group -> the works launched by hooks since the last bucket of a backward pass.
_IN_FLIGHT: dict[Any, list[Any]] = {}


def defer_to_last_bucket(
    group: dist.ProcessGroup, work: Any, bucket: dist.GradBucket, result: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """A completed future of ``result``; at the last bucket, wait for every work launched on ``group``.

    Only for hooks that DDP's reducer calls: a Python caller may read ``result`` as soon as the
    future is returned.
    """
    works = _IN_FLIGHT.setdefault(group, [])
    works.append(work)
    if bucket.is_last():
        del _IN_FLIGHT[group]
        for pending in works:
            pending.wait()  # a stream wait on CUDA; re-raises a failed collective's error
    return completed_future(result)
