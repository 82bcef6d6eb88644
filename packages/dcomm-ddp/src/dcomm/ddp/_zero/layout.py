"""DDP's settled bucket layout, predicted once, and who owns what in it.

DDP fixes its buckets only after the first iteration (two with ``static_graph=True``), but ZeRO
overlap must know each parameter's owner from the first step. :func:`expected_buckets` predicts
the settled buckets with DDP's own assignment (gradients ready in reverse parameter order, DDP's
byte caps). Ownership is then either per parameter (:func:`partition`: whole buckets, or each
bucket cut at parameter boundaries) or element-wise (:func:`pack_shards`: every bucket packed
into one flat buffer cut into ``world`` equal slices, for ``reduce_scatter=True``).

Example::

    >>> buckets = expected_buckets(ddp, list(ddp.parameters()))  # doctest: +SKIP
    >>> per_rank = partition(buckets, world=4, shard_buckets=True)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

import dcomm.ddp._torch_private as private


def expected_buckets(ddp: DistributedDataParallel, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """DDP's settled buckets, in bucket-index order, assuming gradients arrive in reverse order."""
    tensors = list(reversed(params))
    return [[tensors[i] for i in bucket] for bucket in private.bucket_assignment(tensors, private.bucket_caps(ddp))]


def _numel(params: list[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _cut(bucket: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    """Contiguous pieces of about ``bucket / world`` elements, cut at parameter boundaries."""
    total = max(_numel(bucket), 1)
    cut: list[list[torch.Tensor]] = [[] for _ in range(world)]
    start = 0
    for p in bucket:
        middle = start + p.numel() / 2
        cut[min(world - 1, int(middle * world / total))].append(p)
        start += p.numel()
    return sorted((c for c in cut if c), key=lambda c: -_numel(c))


def partition(buckets: list[list[torch.Tensor]], world: int, shard_buckets: bool) -> list[list[torch.Tensor]]:
    """The parameters each rank owns: every bucket whole, or cut into ``world`` pieces.

    Largest bucket first, its pieces go to the least-loaded ranks (by elements), at most one piece
    of a bucket per rank: every rank steps about as many elements, even where a model's largest
    tensors (an embedding, an LM head) come last in bucket order. Each rank's parameters stay in
    bucket order.

    Example::

        >>> sizes = [1, 1, 1, 3]  # a large embedding in the last bucket
        >>> buckets = [[torch.zeros(n)] for n in sizes]
        >>> [sum(p.numel() for p in owned) for owned in partition(buckets, world=2, shard_buckets=False)]
        [3, 3]
    """
    owned: list[list[tuple[int, list[torch.Tensor]]]] = [[] for _ in range(world)]
    loads = [0] * world
    for index in sorted(range(len(buckets)), key=lambda i: (-_numel(buckets[i]), i)):
        bucket = buckets[index]
        taken: set[int] = set()
        for piece in _cut(bucket, world) if shard_buckets else [bucket]:
            rank = min((r for r in range(world) if r not in taken), key=lambda r: (loads[r], r))
            taken.add(rank)
            owned[rank].append((index, piece))
            loads[rank] += _numel(piece)
    return [[p for _, piece in sorted(pieces, key=lambda item: item[0]) for p in piece] for pieces in owned]


@dataclass
class Shard:
    """One expected bucket packed into a flat buffer, and this rank's slice of it."""

    index: int
    params: list[torch.Tensor]  # in DDP's bucket order; views of ``flat``
    offsets: list[int]  # of each parameter in ``flat`` (= in DDP's bucket buffer)
    numel: int
    chunk: int  # elements per slice
    flat: torch.Tensor  # world * chunk elements
    slice: torch.Tensor  # flat[rank * chunk : (rank + 1) * chunk]: the local optimizer's parameter
    grad: torch.Tensor  # chunk elements, the parameters' dtype: ``slice.grad``
    send: torch.Tensor  # world * chunk elements, communication dtype
    recv: torch.Tensor  # chunk elements, communication dtype (is ``grad`` when dtypes agree)
    seen: int = 0  # parameters whose averaged gradient arrived this backward (fallback path)

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self.params)


def bind_views(flat: torch.Tensor, params: list[torch.Tensor], start: int = 0) -> list[int]:
    """Copy ``params`` into ``flat`` back to back from ``start`` and make them views of it; their offsets."""
    offsets, offset = [], start
    for p in params:
        view = flat[offset : offset + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        offsets.append(offset)
        offset += p.numel()
    return offsets


def _packed(params: list[torch.Tensor], size: int) -> tuple[torch.Tensor, list[int]]:
    """A zero buffer of ``size`` elements that ``params`` become views of, back to back."""
    first = params[0]
    flat = torch.zeros(size, dtype=first.dtype, device=first.device)
    return flat, bind_views(flat, params)


@torch.no_grad()
def pack_shards(
    buckets: list[list[torch.Tensor]], rank: int, world: int, reduce_dtype: torch.dtype | None
) -> list[Shard]:
    """Element-wise ownership: rank ``r`` owns slice ``r`` of every bucket's flat buffer."""
    shards = []
    for index, params in enumerate(buckets):
        numel = _numel(params)
        chunk = max(1, math.ceil(numel / world))
        flat, offsets = _packed(params, world * chunk)
        piece = flat[rank * chunk : (rank + 1) * chunk]
        piece.grad = grad = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        dtype = flat.dtype if reduce_dtype is None else reduce_dtype
        send = torch.zeros(world * chunk, dtype=dtype, device=flat.device)
        recv = grad if dtype == flat.dtype else torch.zeros(chunk, dtype=dtype, device=flat.device)
        shards.append(Shard(index, params, offsets, numel, chunk, flat, piece, grad, send, recv))
    return shards
