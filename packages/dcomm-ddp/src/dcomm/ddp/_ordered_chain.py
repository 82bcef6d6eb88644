"""Issue each bucket's dependent collectives in bucket order, so every rank issues them alike.

A hook whose second collective depends on its first (PowerSGD's Q on P, a two-shot quantized
reduction's all-gather on its all-to-all) must launch it from a future's callback. On NCCL those
callbacks run at once, in the hook; on gloo they run on gloo's worker threads as collectives
finish, so with several buckets in flight two ranks could launch the same collectives in
different orders, which gloo matches by order: wrong data or a crash. An :class:`OrderedChain`
runs a bucket's collectives only after the previous bucket's have all completed.

Example::

    >>> chain = OrderedChain()
    >>> fut = chain.run(lambda: dist.all_reduce(p, async_op=True).get_future(), finish)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from dcomm.core import reduced_by_nccl

__all__ = ["OrderedChain", "drains_here"]

T = TypeVar("T")


def drains_here(bucket: dist.GradBucket, group: dist.ProcessGroup) -> bool:
    """Whether a hook must :meth:`OrderedChain.drain` at this bucket: DDP's last, off NCCL.

    There DDP's reducer issues its own collectives on the group right after the hook returns
    (with ``find_unused_parameters=True``, the allreduce of which parameters were used); gloo
    matches collectives by order, so the chain's must all be issued first, on every rank alike.
    """
    return bucket.is_last() and not reduced_by_nccl(group, bucket.buffer())


def _waited(fut: torch.futures.Future) -> torch.futures.Future:
    fut.wait()
    return fut


class OrderedChain:
    """Runs ``first`` (launches a collective, returns its future) then ``rest`` (the callback that
    launches and waits for the following collectives) after the previous :meth:`run`'s chain.

    When nothing is pending, ``first`` runs at once in the caller (the DDP hook) and ``rest``
    runs when it completes, exactly as a plain ``first().then(rest)``; otherwise both run in the
    callback of the previous chain, one after the other.

    Example::

        >>> fut = state.chain.run(launch_first, finish)  # doctest: +SKIP
    """

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail: torch.futures.Future | None = None

    def run(
        self,
        first: Callable[[], torch.futures.Future],
        rest: Callable[[torch.futures.Future], T],
        *,
        drain: bool = False,
    ) -> torch.futures.Future[T]:
        """Chain ``first`` then ``rest`` after the previous runs; ``drain``: then wait for them all."""
        tail = self._tail
        # Nothing pending: launch now, as a plain hook would; else after the previous chain.
        if tail is not None and not tail.done():
            fut = tail.then(lambda _: rest(_waited(first())))
        else:
            fut = first().then(rest)
        self._tail = fut
        if drain:
            self.drain()
        return fut

    def drain(self) -> None:
        """Wait (the host) until every chain run so far has completed, its collectives included.

        A hook calls this where :func:`drains_here` says so, at DDP's last bucket on gloo.

        Example::

            >>> state._chain.drain()  # doctest: +SKIP
        """
        if self._tail is not None:
            self._tail.wait()
