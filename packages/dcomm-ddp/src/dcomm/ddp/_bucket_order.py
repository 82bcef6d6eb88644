"""Whether DDP is handing a hook its buckets one after the other, as it normally does.

Normally a backward pass calls the hook for buckets 0, 1, ..., n - 1, the last one marked
``is_last()``. In its first iteration a ``static_graph=True`` DDP instead launches every bucket
at once from its post-backward callback, all with index 0 and none last, and two models sharing
a group interleave their buckets. Anything keyed by bucket index, or waiting for the last
bucket, must notice.

Example::

    >>> order = BucketOrder()
    >>> order.follows(bucket)  # True for bucket 0 of a new backward pass  # doctest: +SKIP
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["BucketOrder"]


class BucketOrder:
    """The index of the previous bucket of the current backward pass (-1 after a last one)."""

    __slots__ = ("last_index",)

    def __init__(self) -> None:
        self.last_index = -1

    def follows(self, bucket: dist.GradBucket) -> bool:
        """Whether ``bucket`` comes after the previous one; remembers it (or, if last, the end)."""
        return self.advance(bucket)[0]

    def advance(self, bucket: dist.GradBucket) -> tuple[bool, bool]:
        """:meth:`follows`, and whether ``bucket`` is the last one (one call of each bucket method)."""
        index = bucket.index()
        follows = index > self.last_index
        last = bucket.is_last()
        self.last_index = -1 if last else index
        return follows, last
