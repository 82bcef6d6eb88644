"""The bucket path of :func:`dcomm.averaging.average_parameters`: bounded staging, pack, allreduce, copy back.

Taken on gloo, for CPU parameters, and for GPU parameters that alias one another. At most
``bucket_cap_mb`` of extra memory per device (:class:`_Staging`); two half-size buffers
alternate when a dtype group exceeds one bucket, so packing bucket ``i + 1`` overlaps the
allreduce of bucket ``i``.

Example::

    >>> [len(b) for b in _buckets([torch.zeros(5), torch.zeros(3)], capacity=4)]
    [1, 2]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from dcomm.core import (
    AveragePlan,
    foreach_copy_,
    plan_average,
    start_allreduce,
)


def parameter_plan(group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> AveragePlan:
    """How parameters of ``dtype`` are averaged over ``group``, on either path.

    fp32/fp64 (and fp16) are divided by the group size before the ``SUM``, torch's arithmetic: the
    sum of the divided values never exceeds the largest of them, so an fp16 sum cannot overflow
    (dividing only partly first, by ``divide_factors``, let a mean above 65504 * pre / world, about
    43,700 at 3 ranks, become inf). bf16 (float32's range) is divided after the ``SUM``; on NCCL,
    ``ReduceOp.AVG`` averages fp32/fp64/bf16 inside the collective.

    Example::

        >>> parameter_plan(group, torch.float16, torch.device("cpu"))  # world 3  # doctest: +SKIP
        AveragePlan(op=<RedOpType.SUM: 0>, pre=3.0, post=1.0)
    """
    arithmetic = "predivide" if dtype == torch.float16 else None
    return plan_average(group, dtype, device, arithmetic=arithmetic, nccl_premul=False)


class _Segment(NamedTuple):
    """``length`` elements of a parameter's flat view, from ``start``."""

    flat: torch.Tensor
    start: int
    length: int

    def view(self) -> torch.Tensor:
        if self.start == 0 and self.length == self.flat.numel():
            return self.flat  # the whole parameter: no new view (host time per parameter)
        return self.flat.narrow(0, self.start, self.length)


def _buckets(flats: list[torch.Tensor], capacity: int) -> Iterator[list[_Segment]]:
    """Split the concatenation of ``flats`` into consecutive runs of at most ``capacity`` elements."""
    bucket: list[_Segment] = []
    room = capacity
    for flat in flats:
        start, numel = 0, flat.numel()
        while start < numel:
            length = min(room, numel - start)
            bucket.append(_Segment(flat, start, length))
            start += length
            room -= length
            if room == 0:
                yield bucket
                bucket, room = [], capacity
    if bucket:
        yield bucket


_ALIGN = 16  # bytes: every dtype's view of a staging buffer starts aligned


class _Staging:
    """The extra memory of one call on one device, shared by every dtype there.

    When the largest dtype group fits in ``cap_bytes`` it is one buffer of that size (one
    allreduce per dtype); otherwise two buffers of half the cap each, so that packing bucket
    ``i + 1`` overlaps the allreduce of bucket ``i``. Reusing raw bytes across dtypes keeps the
    total within the cap however many dtypes there are (at least one element per buffer).
    """

    def __init__(self, device: torch.device, largest_group_bytes: int, max_itemsize: int, cap_bytes: float) -> None:
        if largest_group_bytes <= cap_bytes:
            size = -(-largest_group_bytes // _ALIGN) * _ALIGN
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=device)]
        else:
            half = max(int(cap_bytes // 2) // _ALIGN * _ALIGN, -(-max_itemsize // _ALIGN) * _ALIGN)
            self.buffers = list(torch.empty(2 * half, dtype=torch.uint8, device=device).split(half))

    def typed(self, dtype: torch.dtype, itemsize: int) -> tuple[list[torch.Tensor], int]:
        """The buffers as ``dtype`` and how many elements each holds."""
        capacity = self.buffers[0].numel() // itemsize
        return [b.narrow(0, 0, capacity * itemsize).view(dtype) for b in self.buffers], capacity


def _average_group(flats: list[torch.Tensor], group: dist.ProcessGroup, staging: _Staging) -> None:
    """Average same-device, same-dtype flat views over ``group`` through ``staging``."""
    dtype = flats[0].dtype
    buffers, capacity = staging.typed(dtype, flats[0].element_size())
    op, pre, post = parameter_plan(group, dtype, flats[0].device)

    # (work, staged bucket, its parameters' views, their lengths): each view is made once per call.
    in_flight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor], list[int]]] = []

    def finish(work: dist.Work, staged: torch.Tensor, views: list[torch.Tensor], lengths: list[int]) -> None:
        work.wait()  # on CUDA: the current stream waits for the collective, the host does not
        if post != 1.0:
            staged.div_(post)
        foreach_copy_(views, list(torch.split_with_sizes(staged, lengths)))

    for index, segments in enumerate(_buckets(flats, capacity)):
        if len(in_flight) == len(buffers):
            finish(*in_flight.pop(0))
        views = [s.view() for s in segments]
        lengths = [s.length for s in segments]
        staged = buffers[index % len(buffers)].narrow(0, 0, sum(lengths))
        if len(views) == 1:
            staged.copy_(views[0])
        else:
            torch.cat(views, out=staged)
        if pre != 1.0:
            staged.div_(pre)
        work = start_allreduce(staged, group, op)
        in_flight.append((work, staged, views, lengths))
    while in_flight:
        finish(*in_flight.pop(0))
