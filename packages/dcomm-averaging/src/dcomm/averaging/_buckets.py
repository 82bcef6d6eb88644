"""How :func:`dcomm.averaging.average_parameters` moves one device's parameters: in place or through buckets.

A :class:`DevicePlan` is made once per parameter list and holds indices only. Parameters of the
computation dtype that fill at least :data:`IN_PLACE_BYTES` of memory (alone, or as views lying
back to back in one storage, as :func:`dcomm.averaging.flatten_parameters` makes them) are
averaged in their own storage: one grouped launch on NCCL, one allreduce each elsewhere. Every
other parameter is copied, in list order, into staging buckets of at most ``bucket_cap_mb`` in
all, averaged there and copied back; the copies are one multi-tensor kernel per bucket each way.
When the staged parameters do not fit in one bucket, two buffers of half the cap alternate, so
that bucket ``i + 1`` is packed while bucket ``i`` is on the wire. The staging of the last list
averaged on a device is kept for its next call (:class:`Staging`).

Example::

    >>> plan = plan_device(params, list(range(len(params))), torch.float32, 2**20, grouped=False)  # doctest: +SKIP
    >>> average_device(plan, params, group, AveragePlan(dist.ReduceOp.SUM, 2.0, 1.0))  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from dcomm.core import AveragePlan, foreach_copy_, foreach_div_, start_allreduce, views_like

__all__ = ["IN_PLACE_BYTES", "MAX_GROUPED_TENSORS", "DevicePlan", "Piece", "Staging", "average_device", "plan_device"]

IN_PLACE_BYTES = 2**20
"""Parameters (or back-to-back runs of them) of at least this many bytes are averaged in their own storage.

Smaller ones cost more as a collective of their own (even inside a grouped launch) than as a copy
into a bucket and back. A bucket cap below twice this value lowers it to half the cap."""

MAX_GROUPED_TENSORS = 1024
"""At most this many tensors per grouped NCCL launch (half the 2048 operations NCCL allows in a group)."""


class Piece(NamedTuple):
    """``length`` elements of parameter ``param``'s memory from element ``start`` (-1: the parameter itself)."""

    param: int
    start: int
    length: int


class DevicePlan(NamedTuple):
    """What one call does with one device's floating-point parameters (indices into the call's list).

    ``dtype``: the dtype the average is computed in (the parameters' dtype, or, for a list of
    several floating dtypes, their promotion, as ``torch.cat`` in torch's ``average_parameters``);
    ``in_place``: the pieces averaged in their own storage; ``buckets``: the staged pieces, bucket
    by bucket, and ``bucket_numels`` their element counts; ``buffer_numel`` and ``buffers``: the
    staging buffers (one, or two that alternate); ``grouped``: the in-place pieces go in one
    grouped launch (NCCL); ``op`` and ``divisor``: the reduce op, and what every value is divided
    by before it (torch's arithmetic: the group size; 1 where NCCL's ``AVG`` gives the same bits).
    """

    device: torch.device
    dtype: torch.dtype
    in_place: tuple[Piece, ...]
    buckets: tuple[tuple[Piece, ...], ...]
    bucket_numels: tuple[int, ...]
    buffer_numel: int
    buffers: int
    grouped: bool
    op: dist.ReduceOp
    divisor: float


def _runs(params: list[torch.Tensor], indices: list[int]) -> list[list[int]]:
    """``indices`` split into runs of parameters lying back to back in one storage, each in memory order.

    Runs come in the order of their first parameter in ``indices``; a parameter with no neighbour
    is a run of one. The parameters must be dense (:func:`memory_order_view`) and not overlap.
    """
    start_of = {i: params[i].storage_offset() for i in indices}
    storage_of = {i: params[i].untyped_storage().data_ptr() for i in indices}
    following = {(storage_of[i], start_of[i]): i for i in indices}
    successor = {i: following.get((storage_of[i], start_of[i] + params[i].numel())) for i in indices}
    has_predecessor = {s for s in successor.values() if s is not None}
    runs = []
    for head in indices:
        if head in has_predecessor:
            continue
        run = [head]
        while (after := successor[run[-1]]) is not None:
            run.append(after)
        runs.append(run)
    return runs


def _overlapping(params: list[torch.Tensor], indices: list[int]) -> bool:
    """Whether two of the parameters at ``indices`` share memory (aliasing views of one tensor)."""
    spans = sorted(
        (params[i].untyped_storage().data_ptr(), params[i].storage_offset(), params[i].numel())
        for i in indices
        if params[i].numel()
    )
    return any(a[0] == b[0] and b[1] < a[1] + a[2] for a, b in itertools.pairwise(spans))


def plan_device(
    params: list[torch.Tensor],
    indices: list[int],
    dtype: torch.dtype,
    cap_bytes: float,
    grouped: bool,
    average: AveragePlan,
) -> DevicePlan:
    """Decide which of one device's parameters are averaged in place and how the others are bucketed.

    Args:
        params: the call's parameters (dense; checked by the caller).
        indices: the positions in ``params`` of this device's floating-point parameters, in order.
        dtype: the dtype the average is computed in.
        cap_bytes: the staging bound (``bucket_cap_mb`` in bytes).
        grouped: whether the in-place parameters go in one grouped launch (NCCL).
        average: the reduce op and divisors for ``dtype`` on this device (no post-division).

    Returns:
        The :class:`DevicePlan`.

    Example::

        >>> plan_device(params, [0, 1], torch.float32, 25 * 2**20, False, plan).in_place  # doctest: +SKIP
        (Piece(param=0, start=0, length=-1),)
    """
    itemsize = dtype.itemsize
    in_place_bytes = min(IN_PLACE_BYTES, cap_bytes / 2)
    # Parameters sharing memory are copied out and back (each written with its own average).
    own_dtype = [] if _overlapping(params, indices) else [i for i in indices if params[i].dtype == dtype]
    in_place: list[Piece] = []
    placed: set[int] = set()
    for run in _runs(params, own_dtype):
        numel = sum(params[i].numel() for i in run)
        if numel * itemsize < in_place_bytes:
            continue
        placed.update(run)
        alone = len(run) == 1 and params[run[0]].is_contiguous()
        in_place.append(Piece(run[0], 0, -1 if alone else numel))
    staged = [i for i in indices if i not in placed]
    staged_numel = sum(params[i].numel() for i in staged)
    if staged_numel * itemsize <= cap_bytes:
        buffer_numel, buffers = staged_numel, 1
    else:
        buffer_numel, buffers = max(1, int(cap_bytes // 2) // itemsize), 2
    buckets: list[tuple[Piece, ...]] = []
    numels: list[int] = []
    bucket: list[Piece] = []
    room = buffer_numel
    for i in staged:
        numel, start = params[i].numel(), 0
        while start < numel:
            if room == 0:
                buckets.append(tuple(bucket))
                numels.append(buffer_numel)
                bucket, room = [], buffer_numel
            length = min(room, numel - start)
            bucket.append(Piece(i, 0, -1) if length == numel else Piece(i, start, length))
            start += length
            room -= length
    if bucket:
        buckets.append(tuple(bucket))
        numels.append(buffer_numel - room)
    return DevicePlan(
        params[indices[0]].device, dtype, tuple(in_place), tuple(buckets), tuple(numels), buffer_numel, buffers,
        grouped, average.op, average.pre,
    )  # fmt: skip


def _tensor(params: list[torch.Tensor], piece: Piece) -> torch.Tensor:
    """The tensor a piece names: the parameter itself, or a 1-D view of part of its memory."""
    param = params[piece.param]
    if piece.length < 0:
        return param
    return param.as_strided((piece.length,), (1,), param.storage_offset() + piece.start)


def _launch_in_place(plan: DevicePlan, tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[dist.Work]:
    """Start the allreduce of ``tensors`` in their own storage: grouped launches on NCCL, one each elsewhere."""
    op = plan.op
    if not plan.grouped:
        return [start_allreduce(t, group, op) for t in tensors]
    options = dist.AllreduceCoalescedOptions()
    options.reduceOp = op
    if hasattr(options, "asyncOp"):
        options.asyncOp = True
    return [
        group.allreduce_coalesced(tensors[start : start + MAX_GROUPED_TENSORS], options)
        for start in range(0, len(tensors), MAX_GROUPED_TENSORS)
    ]


class Staging(NamedTuple):
    """One plan's staging on its device: per bucket, its stretch of the buffers and the views of that
    stretch shaped like the bucket's tensors (made once: making them costs more host time than
    the copies through them)."""

    plan: DevicePlan
    flats: list[torch.Tensor]
    views: list[list[torch.Tensor]]


_KEPT: dict[torch.device, Staging] = {}
"""Per device, the staging of the last plan that staged there (at most ``bucket_cap_mb``), reused
while the same parameter list is averaged again; another plan's call replaces it."""


def _staging(plan: DevicePlan, params: list[torch.Tensor]) -> Staging:
    """``plan``'s staging: the kept one if it is this plan's, else new (the old one is released first)."""
    kept = _KEPT.get(plan.device)
    if kept is not None and kept.plan is plan:
        return kept
    _KEPT.pop(plan.device, None)
    memory = torch.empty(plan.buffer_numel * plan.buffers, dtype=plan.dtype, device=plan.device)
    buffers = memory.split(plan.buffer_numel)
    flats = [buffers[index % plan.buffers][:numel] for index, numel in enumerate(plan.bucket_numels)]
    views = [views_like(flat, _tensors(params, bucket)) for flat, bucket in zip(flats, plan.buckets, strict=True)]
    staging = _KEPT[plan.device] = Staging(plan, flats, views)
    return staging


def _tensors(params: list[torch.Tensor], pieces: tuple[Piece, ...]) -> list[torch.Tensor]:
    return [params[piece.param] if piece.length < 0 else _tensor(params, piece) for piece in pieces]


def average_device(plan: DevicePlan, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average one device's parameters over ``group`` as ``plan`` says, in place.

    Divides by ``plan.divisor`` with ``Tensor.div_``'s rounding (the in-place tensors in one
    ``torch._foreach_div_``, which rounds alike), so the bits match torch's
    ``average_parameters``, then reduces with ``plan.op``. On CUDA nothing waits on the host:
    the current stream waits for each collective.

    Args:
        plan: from :func:`plan_device`, for this list of parameters.
        params: the call's parameters.
        group: the process group (this rank is a member).

    Example::

        >>> average_device(plan, params, dist.group.WORLD)  # doctest: +SKIP
    """
    op, pre = plan.op, plan.divisor
    in_place = _tensors(params, plan.in_place)
    if pre != 1.0 and in_place:
        foreach_div_(in_place, pre)  # rounds as ``Tensor.div_`` does, on CPU and CUDA alike
    works = _launch_in_place(plan, in_place, group) if in_place else []
    if plan.buckets:
        staging = _staging(plan, params)
        in_flight: deque[tuple[dist.Work, list[torch.Tensor], list[torch.Tensor]]] = deque()
        for bucket, flat, views in zip(plan.buckets, staging.flats, staging.views, strict=True):
            if len(in_flight) == plan.buffers:
                _unpack(*in_flight.popleft())
            tensors = _tensors(params, bucket)
            foreach_copy_(views, tensors)
            if pre != 1.0:
                flat.div_(pre)
            in_flight.append((start_allreduce(flat, group, op), tensors, views))
        while in_flight:
            _unpack(*in_flight.popleft())
    for work in works:
        work.wait()  # on CUDA: the current stream waits for the collective, the host does not


def _unpack(work: dist.Work, tensors: list[torch.Tensor], views: list[torch.Tensor]) -> None:
    """Wait for a bucket's allreduce and copy its averaged values back into its parameters."""
    work.wait()
    foreach_copy_(tensors, views)
