"""Pieces owned by different ranks, sent back in one all-gather instead of one broadcast each.

With whole parameters per owner (``reduce_scatter=False``) each owner broadcasts its piece of a
bucket (its updated parameters there; most buckets have one owner, and DDP's settled buckets may
mix owners where gradients arrive out of parameter order). Broadcasts run one after the other, each
over the links in one direction; an all-gather of one equal piece per rank moves the same bytes
over every link in both directions at once (on 2 ranks, in about half the time). Once DDP has
settled its buckets, :func:`choose_groups` puts pieces of different owners and like sizes
together, and :func:`pack_group` lays each group's parameters out in one flat buffer, ``[rank 0's
piece | rank 1's | ...]`` padded to the largest, so that one in-place ``all_gather_into_tensor``
returns them all. A group is kept only where it moves no more per link than its broadcasts would:
``(world - 1) * piece <= total``.

Example::

    >>> choose_groups([(100, 0, "f32"), (90, 1, "f32"), (100, 1, "f32"), (5, 0, "f32")], world=2)
    [[0, 2], [1, 3]]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from dcomm.ddp._zero.layout import bind_views


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


@torch.no_grad()
def pack_group(members: list[tuple[int, list[torch.Tensor]]], world: int) -> tuple[SendGroup, list[int]]:
    """One flat buffer for ``members`` (``(owner rank, its parameters)``); the parameters become views of it.

    Returns the group and each member's start in ``flat``.
    """
    piece = max(sum(p.numel() for p in params) for _, params in members)
    first = members[0][1][0]
    flat = torch.zeros(world * piece, dtype=first.dtype, device=first.device)
    for owner, params in members:
        bind_views(flat, params, owner * piece)
    return SendGroup(flat, piece, len(members)), [owner * piece for owner, _ in members]
