"""How a parameter's memory is read for averaging: memory-order flat views, aliasing, back-to-back runs.

Averaging is elementwise, so a dense parameter is averaged through a 1-D view of its elements in
memory order (channels-last included), and parameters that lie back to back in one storage (a
flattened model), or on CUDA in one device allocation, are averaged as one tensor.

Example::

    >>> import torch
    >>> memory_order_view(torch.zeros(2, 3).t()).shape
    torch.Size([6])
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence

import torch

from dcomm.averaging._allocations import allocation_bases, span_over


def memory_order_view(param: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of every element of ``param`` in memory order (no copy); None where it has gaps or overlaps.

    Contiguous tensors and any dense permutation of one (channels-last, transposed) qualify.
    """
    data = param.detach()
    if data.is_contiguous():
        return data.view(-1)
    order = sorted(range(data.dim()), key=lambda d: data.stride(d), reverse=True)
    permuted = data.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def _flat_view(param: torch.Tensor) -> torch.Tensor:
    """:func:`memory_order_view`, raising where the layout has gaps or overlaps.

    Averaging is elementwise, so memory order is as good as logical order as long as all ranks
    lay the parameter out the same way, which they do for the same model.
    """
    flat = memory_order_view(param)
    if flat is not None:
        return flat
    data = param.detach()
    raise ValueError(
        f"params: a parameter of shape {tuple(data.shape)} and strides {data.stride()} has gaps or "
        "overlaps in memory, so it cannot be averaged in place; make it contiguous first "
        "(param.data = param.data.contiguous())"
    )


def _dense(param: torch.Tensor) -> torch.Tensor:
    """``param`` itself when contiguous (no new tensor), else its memory-order flat view."""
    return param if param.is_contiguous() else _flat_view(param)


def _overlap(spans: list[tuple[int, int]]) -> bool:
    """Whether two of the ``(address, bytes)`` spans of dense parameters share bytes (aliasing).

    In place, shared bytes would be divided twice; the bucket path copies each parameter out and
    back, which stays right. Disjoint views of one buffer (a flattened model) do not overlap.
    Different storages never share addresses, so comparing address ranges is enough.
    """
    ordered = sorted(spans)
    return any(b[0] < a[0] + a[1] for a, b in itertools.pairwise(ordered))


def successors(spans: list[tuple[int, int]], regions: Sequence[Hashable]) -> list[int]:
    """For each tensor, the index of the one that starts where it ends in the same region, else -1.

    ``spans`` are the tensors' ``(address, bytes)`` (disjoint: see :func:`_overlap`); ``regions[i]``
    names the memory tensor ``i`` lies in, and a link never crosses from one region into another.
    A region is a storage (parameters carved out of one flat buffer, a flattened model) or, on
    CUDA, a device allocation (:func:`memory_regions`): separate parameters that the caching
    allocator placed back to back. Linked tensors are averaged as one (:func:`chains`).
    """
    located = list(zip(spans, regions, strict=True))
    starts = {(region, address): index for index, ((address, _), region) in enumerate(located)}
    return [starts.get((region, address + nbytes), -1) for (address, nbytes), region in located]


def chains(successor: Sequence[int]) -> list[list[int]]:
    """The tensors joined along ``successor`` links (:func:`successors`), each chain in memory order.

    Chains come in the order of their first tensor's index; a tensor with no link is a chain of
    one. Each chain costs one allreduce, at the bandwidth of a raw allreduce of its bytes,
    instead of one per tensor.

    Example::

        >>> chains([-1, 0, -1, 2])  # 1 ends where 0 starts, 3 where 2 starts
        [[1, 0], [3, 2]]
    """
    linked = {s for s in successor if s >= 0}
    joined = []
    for head in range(len(successor)):
        if head in linked:
            continue
        chain = [head]
        while successor[chain[-1]] >= 0:
            chain.append(successor[chain[-1]])
        joined.append(chain)
    return joined


def storage_regions(tensors: list[torch.Tensor]) -> list[tuple[str, int]]:
    """Each tensor's storage as its region for :func:`successors` (views of one buffer join, nothing else)."""
    return [("storage", _storage(tensor)) for tensor in tensors]


def memory_regions(tensors: list[torch.Tensor]) -> list[tuple[str, int]]:
    """Each tensor's region for :func:`successors`: its CUDA allocation where the driver says, else its storage."""
    bases = allocation_bases(tensors)
    return [
        ("allocation", base) if base is not None else storage
        for base, storage in zip(bases, storage_regions(tensors), strict=True)
    ]


def _merged(
    tensors: list[torch.Tensor], joined: list[list[int]], standing_in: Mapping[int, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """One tensor per chain (:func:`chains`): the tensor itself, or one 1-D view over its back-to-back tensors.

    ``standing_in`` maps a chain's index to the tensor to use instead (a buffer for a chain whose
    tensors are no longer back to back).
    """
    standing_in = standing_in or {}
    return [
        standing_in[index] if index in standing_in else _span([tensors[i] for i in chain])
        for index, chain in enumerate(joined)
    ]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _span(run: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D view over the back-to-back tensors of ``run``, in memory order (the tensor itself for one).

    Within one storage, a view of it; across storages (one CUDA allocation), a tensor over the
    run's bytes that owns nothing (:func:`dcomm.averaging._allocations.span_over`).
    """
    first = run[0]
    if len(run) == 1:
        return first
    numel = sum(t.numel() for t in run)
    if all(_storage(t) == _storage(first) for t in run):
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))
    return span_over(first, numel * first.element_size())
