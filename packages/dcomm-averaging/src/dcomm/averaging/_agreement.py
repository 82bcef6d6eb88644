"""Which back-to-back parameters every rank joins into one allreduce, agreed once per call signature.

Joined tensors are one allreduce, so every rank must join the same ones, yet where memory lies
differs between ranks. On NCCL the ranks agree in one small collective (:func:`agreed_links`) the
first time a group sees a call's :class:`Signature`: the paths and the parameters' sizes and
dtypes, which every rank passes alike. Every call looks its signature up in its group's
agreements (:func:`lookup`), so the ranks agree at the same calls whatever each one's kept
recipes (one rank's recipe may be remade alone: its parameters got new storage, or a new model
reused the old one's addresses on some ranks only). Agreements belong to the process group
object: a group created anew (after ``destroy_process_group``, with fresh processes among its
members, say) starts with none on every rank. A rank whose memory no longer lies as agreed
keeps the agreed chains and averages a broken one through a buffer of its own
(:func:`broken_chains`).

Example::

    >>> key = Signature((), (4, 4), (torch.float32, torch.float32))
    >>> lookup(dist.group.WORLD, key) is None  # before the first call with these sizes  # doctest: +SKIP
    True
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dcomm.averaging._layout import memory_regions, storage_regions, successors

__all__ = [
    "Agreement",
    "Signature",
    "agreed_links",
    "broken_chains",
    "keep",
    "links_for",
    "local_links",
    "lookup",
]

ALLOCATOR_BLOCK_BYTES = 512
"""PyTorch's CUDA caching allocator rounds every block to a multiple of this many bytes."""

KEPT = 64
"""At most this many agreements are kept per group, the least recently used dropped first (on every rank alike)."""


class Agreement(NamedTuple):
    """The links the ranks agreed on, one entry per in-place (device, dtype) group of the call, in order.

    An entry is every tensor's agreed successor (:func:`dcomm.averaging._layout.successors`), or
    None where the ranks did not agree on memory (off NCCL, during a CUDA-graph capture, no byte
    count a multiple of 512): then views of one storage alone join, laid out alike on every rank.
    """

    links: list[list[int] | None]


_AGREEMENTS: weakref.WeakKeyDictionary[dist.ProcessGroup, collections.OrderedDict[Signature, Agreement]] = (
    weakref.WeakKeyDictionary()
)
"""Per process group (gone with it), its agreements by signature, most recently used last."""


class Signature:
    """What names a call alike on every rank of its group: the paths, the parameters' sizes and dtypes.

    Hashed once: every call looks its signature up (a recipe keeps the one it was made under),
    and a tuple of a large model's sizes and dtypes would be hashed anew each time.
    """

    __slots__ = ("_hash", "parts")

    def __init__(self, paths: Hashable, sizes: tuple[int, ...], dtypes: tuple[Any, ...]) -> None:
        self.parts = (paths, sizes, dtypes)
        self._hash = hash(self.parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return isinstance(other, Signature) and self._hash == other._hash and self.parts == other.parts


def lookup(group: dist.ProcessGroup, key: Signature) -> Agreement | None:
    """``group``'s agreement for signature ``key`` (marked most recent), or None: then the ranks agree anew.

    Called once per call on every rank, so the kept agreements, and what drops out of them, stay
    the same on every rank.
    """
    kept = _AGREEMENTS.get(group)
    if kept is None:
        return None
    found = kept.get(key)
    if found is not None:
        kept.move_to_end(key)
    return found


def keep(group: dist.ProcessGroup, key: Signature, agreement: Agreement) -> None:
    """Keep ``agreement`` as ``group``'s most recent for signature ``key``, within :data:`KEPT`."""
    kept = _AGREEMENTS.setdefault(group, collections.OrderedDict())
    kept[key] = agreement
    kept.move_to_end(key)
    while len(kept) > KEPT:
        kept.popitem(last=False)


def agreed_links(
    tensors: list[torch.Tensor], spans: list[tuple[int, int]], group: dist.ProcessGroup, by_nccl: bool
) -> list[int] | None:
    """The links every rank has (one MIN allreduce of 16 bytes per tensor), or None where none is asked.

    On NCCL, separate tensors back to back in one CUDA allocation join; where they lie depends on
    each rank's allocations, so the ranks keep only the links that all of them have: one allreduce
    and one device-to-host copy. None (views of one storage alone join) off NCCL, while a CUDA
    graph is being captured, and where no tensor's byte count is a multiple of the caching
    allocator's 512-byte blocks (nothing can follow it in its allocation); each is alike on every rank.
    """
    may_follow = len(tensors) > 1 and any(t.nbytes % ALLOCATOR_BLOCK_BYTES == 0 for t in tensors)
    if not (by_nccl and may_follow) or (tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    mine = successors(spans, memory_regions(tensors))
    # One MIN gives every link's smallest value and its largest, negated: the ranks agree where they are equal.
    bounds = torch.tensor(mine + [-link for link in mine], dtype=torch.int64, device=tensors[0].device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MIN, group=group)
    agreed = bounds.tolist()
    low, negated_high = agreed[: len(tensors)], agreed[len(tensors) :]
    return [link if link == -high else -1 for link, high in zip(low, negated_high, strict=True)]


def links_for(links: Sequence[list[int] | None], position: int, count: int) -> list[int] | None:
    """The agreed links of the ``position``-th in-place group, if they were agreed for ``count`` tensors.

    None (views of one storage alone join) where the agreement has no such group: it was made
    when these parameters took another path (they aliased each other then, say).
    """
    agreed = links[position] if position < len(links) else None
    return agreed if agreed is not None and len(agreed) == count else None


def local_links(tensors: list[torch.Tensor], spans: list[tuple[int, int]], agreed: list[int] | None) -> list[int]:
    """The links to join along: the agreed ones, or, where there are none, views of one storage."""
    return successors(spans, storage_regions(tensors)) if agreed is None else agreed


def broken_chains(tensors: list[torch.Tensor], spans: list[tuple[int, int]], joined: Sequence[list[int]]) -> list[int]:
    """The indices of the chains in ``joined`` whose tensors no longer lie back to back on this rank.

    Such a chain still costs one allreduce of all its elements, as on the other ranks, through a
    buffer (see ``_DeviceRecipe.rejoined``).
    """
    long = [index for index, chain in enumerate(joined) if len(chain) > 1]
    if not long:
        return []
    here = successors(spans, memory_regions(tensors))
    return [i for i in long if any(here[a] != b for a, b in zip(joined[i], joined[i][1:], strict=False))]
