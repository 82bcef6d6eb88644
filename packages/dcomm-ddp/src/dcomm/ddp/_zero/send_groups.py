"""Pieces owned by different ranks, sent back in one all-gather instead of one broadcast each.

With whole parameters per owner (``reduce_scatter=False``) each owner broadcasts its piece of a
bucket (its updated parameters there; most buckets have one owner, and DDP's settled buckets may
mix owners where gradients arrive out of parameter order). Broadcasts run one after the other, each
over the links in one direction; an all-gather of one equal piece per rank moves the same bytes
over every link in both directions at once (on 2 ranks, in about half the time). Once DDP has
settled its buckets, :func:`choose_groups` puts pieces of different owners and like sizes
together, and :func:`pack_group` lays each group's parameters out in one flat buffer, ``[rank 0's
pieces | rank 1's | ...]`` padded to the largest, so that one in-place ``all_gather_into_tensor``
returns them all. A group is kept only where it moves no more per link than its broadcasts would:
``(world - 1) * piece <= total``. Where every piece is sent at once (the fused step, without
``gather_during_forward``), :func:`merge_owners` first puts all pieces of a kind in one group, each
owner's back to back, where the owners' shares are equal enough that padding them costs at most
:data:`MAX_PADDING` of the group: one all-gather for all the parameters, and no broadcast at all.

Example::

    >>> choose_groups([(100, 0, "f32"), (90, 1, "f32"), (100, 1, "f32"), (5, 0, "f32")], world=2)
    [[0, 2], [1, 3]]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from dcomm.ddp._zero.layout import bind_views

MAX_PADDING = 0.1
"""The most padding (a fraction of the parameters' elements) a merged group may add."""


@dataclass
class SendGroup:
    """Pieces whose updated parameters travel in one all-gather of ``flat``."""

    flat: torch.Tensor  # world * piece elements; rank r's piece at [r * piece, r * piece + its numel)
    piece: int
    members: int  # pieces in the group

    def pair(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, this rank's piece)`` of the group's in-place all-gather."""
        return self.flat, self.flat[rank * self.piece : (rank + 1) * self.piece]


def choose_groups(pieces: Sequence[tuple[int, int, Hashable]], world: int) -> list[list[int]]:
    """Which pieces travel together: lists of indices into ``pieces``, each owner at most once.

    ``pieces[i]`` is a piece's ``(elements, owner rank, kind)``; only pieces of one kind (dtype
    and device) share a group. Largest first, each piece joins the first open group of its kind
    that lacks its owner, so groups hold pieces of like sizes. Groups of one piece, or that would
    move more per link than broadcasts, are dropped (those pieces stay broadcasts).
    """
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][0], i))
    groups: list[list[int]] = []
    for i in order:
        _, owner, kind = pieces[i]
        home = next(
            (
                group
                for group in groups
                if len(group) < world and pieces[group[0]][2] == kind and all(pieces[j][1] != owner for j in group)
            ),
            None,
        )
        if home is None:
            groups.append([i])
        else:
            home.append(i)
    kept = []
    for group in groups:
        sizes = [pieces[i][0] for i in group]
        if len(group) >= 2 and (world - 1) * max(sizes) <= sum(sizes):
            kept.append(sorted(group))
    return kept


def merge_owners(pieces: Sequence[tuple[int, int, Hashable]], world: int) -> list[list[int]]:
    """One group per kind of all its pieces, where the owners' shares are nearly equal.

    ``pieces`` as for :func:`choose_groups`. A kind is merged where it has at least two owners and
    padding every owner's share to the largest adds at most :data:`MAX_PADDING` of its elements;
    the pieces of any other kind are left out.

    Example::

        >>> merge_owners([(60, 0, "f32"), (40, 1, "f32"), (20, 1, "f32"), (5, 0, "f16")], world=2)
        [[0, 1, 2]]
    """
    kinds: dict[Hashable, list[int]] = {}
    for i, (_, _, kind) in enumerate(pieces):
        kinds.setdefault(kind, []).append(i)
    merged = []
    for indices in kinds.values():
        shares: Counter[int] = Counter()
        for i in indices:
            shares[pieces[i][1]] += pieces[i][0]
        total = shares.total()
        if len(shares) >= 2 and world * max(shares.values()) <= (1 + MAX_PADDING) * total:
            merged.append(indices)
    return merged


@torch.no_grad()
def pack_group(members: list[tuple[int, list[torch.Tensor]]], world: int) -> tuple[SendGroup, list[int]]:
    """One flat buffer for ``members`` (``(owner rank, its parameters)``); the parameters become views of it.

    Rank ``r``'s members lie back to back in its slot ``[r * piece, (r + 1) * piece)``, in the
    order given. Returns the group and each member's start in ``flat``.
    """
    sizes = [sum(p.numel() for p in params) for _, params in members]
    shares: Counter[int] = Counter()
    for (owner, _), size in zip(members, sizes, strict=True):
        shares[owner] += size
    piece = max(shares.values())
    first = members[0][1][0]
    flat = torch.zeros(world * piece, dtype=first.dtype, device=first.device)
    filled: Counter[int] = Counter()  # of each owner's slot, so far
    starts = []
    for (owner, params), size in zip(members, sizes, strict=True):
        start = owner * piece + filled[owner]
        bind_views(flat, params, start)
        starts.append(start)
        filled[owner] += size
    return SendGroup(flat, piece, len(members)), starts
