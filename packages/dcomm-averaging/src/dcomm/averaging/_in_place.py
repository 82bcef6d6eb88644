"""The in-place path of :func:`dcomm.averaging.average_parameters` on NCCL.

Parameters of 1 MiB or more are allreduced in their own storage through the group's coalesced
allreduce (one grouped NCCL launch); the smaller ones are streamed through bounded staging by a
table of their addresses (:class:`dcomm.core.tensor_table.TensorTable`: one Triton launch each
way per run), or, without Triton, packed into one buffer of at most 1 MiB.

Example::

    >>> _small_ones([torch.zeros(4), torch.zeros(2**20), torch.zeros(8)], pack_max_bytes=2**20, min_tensors=2)
    [0, 2]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dcomm.averaging._buckets import _Staging, parameter_plan
from dcomm.core import (
    foreach_copy_,
    foreach_div_,
    start_allreduce,
    tensor_table,
)
from dcomm.core.tensor_table import TensorTable

SMALL_PARAMETER_BYTES = 64 * 2**10
"""Parameters of at most this many bytes are packed together on the in-place path."""

PACK_MAX_BYTES = 2**20
"""Without Triton, the in-place path packs small parameters into at most this much extra memory per (device, dtype)."""

STAGE_BELOW_BYTES = 2**20
"""With Triton, the in-place path streams parameters smaller than this through at most ``bucket_cap_mb``.

Each run through the staging costs about 0.2 ms of host time (two launches and an allreduce), as
much as a grouped launch spends on some 50 parameters: below 1 MiB staging wins (2x H200: a
581-tensor model 3.2x -> 1.6x a raw allreduce of the same bytes; staging up to 4 MiB made more
runs: 4.9x at the default cap, 2.4x at 64 MiB)."""

SMALL_MIN_TENSORS = 8
"""Fewer small parameters than this are neither staged nor packed: they join the grouped launch.

A staging run costs about 0.2 ms of host time eagerly and up to ``bucket_cap_mb`` of memory
(held by a replayed graph); in a grouped launch a parameter costs a few microseconds and no
memory. A model whose small parameters lie back to back (joined into a few tensors) then
averages with no extra memory at all."""

_LAUNCH_MAX_TENSORS = 1024
"""At most this many tensors per grouped NCCL launch of the in-place path (one launch is fastest).

Half the 2048 operations per group that NCCL documents as its limit (up to 2.11 at least).
"""


def _small_ones(tensors: list[torch.Tensor], pack_max_bytes: int, min_tensors: int = SMALL_MIN_TENSORS) -> list[int]:
    """Indices of the small tensors to pack together (in order, at most ``pack_max_bytes``).

    None where fewer than ``min_tensors`` (and two) qualify: they stay in the grouped launch.
    """
    small: list[int] = []
    room = pack_max_bytes
    for index, tensor in enumerate(tensors):
        if tensor.nbytes <= min(SMALL_PARAMETER_BYTES, room):
            small.append(index)
            room -= tensor.nbytes
    return small if len(small) >= max(2, min_tensors) else []


def _staged_ones(
    tensors: list[torch.Tensor], below_bytes: int, run_bytes: int, min_tensors: int = SMALL_MIN_TENSORS
) -> tuple[list[int], TensorTable | None]:
    """Indices of the tensors under ``below_bytes`` and their table (see :func:`_average_staged`).

    ``([], None)`` where fewer than ``min_tensors`` (and two) qualify, where Triton or CUDA is missing (the small
    ones are then packed: :func:`_small_ones`), or where half the staging cap (``run_bytes``)
    cannot hold one row of the table.
    """
    staged = [index for index, tensor in enumerate(tensors) if tensor.nbytes < below_bytes]
    members = [tensors[i] for i in staged]
    if len(staged) < max(2, min_tensors) or not tensor_table.usable(members):
        return [], None
    if run_bytes < (tensor_table.BLOCK + 16) * members[0].element_size():
        return [], None
    table = TensorTable.build(members)
    table.check(members[0].dtype)  # before any collective: a Triton that cannot build raises here
    return staged, table


def _average_in_place(
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup,
    launch_max_tensors: int = _LAUNCH_MAX_TENSORS,
    small: Sequence[int] = (),
    staged: tuple[TensorTable, float] | None = None,
) -> None:
    """Average same-device, same-dtype dense tensors over ``group`` in their own storage.

    Divide in place, then one coalesced allreduce of the large ones (NCCL: one grouped launch of
    in-place allreduces, at most 1024 per launch; ``AVG`` for fp32/fp64/bf16, so no division pass).
    One launch beats several smaller ones: NCCL spreads the grouped allreduces over its channels
    and reaches the bandwidth of one flat message. The tensors at the indices ``small`` (see
    :func:`_small_ones`) are packed into one buffer and allreduced on their own, after that launch:
    packing them costs host time that the large launch then hides, and a tiny allreduce inside a
    grouped launch slows the whole launch down (4x H200: 1.12x one flat allreduce of a GPT's 149
    tensors with the packed ones in the launch, 1.02x without). With ``staged`` (a table and the
    cap), the tensors at ``small`` are streamed through the staging instead (:func:`_average_staged`).
    Then the current stream (never the host) waits for each launch, any post-division is applied,
    and the packed values go back to their tensors.
    """
    # NCCL averages fp32/fp64/bf16 inside the collective (AVG: no division pass); fp16 is divided
    # by the group size first (no pre-multiplied sums in a coalesced allreduce).
    op, pre, post = parameter_plan(group, tensors[0].dtype, tensors[0].device)
    options = dist.AllreduceCoalescedOptions()
    options.reduceOp = op
    if hasattr(options, "asyncOp"):
        options.asyncOp = True
    packed_at = set(small)
    large = [t for i, t in enumerate(tensors) if i not in packed_at] if small else tensors
    launched: list[tuple[dist.Work, list[torch.Tensor]]] = []
    for start in range(0, len(large), launch_max_tensors):
        chunk = large[start : start + launch_max_tensors]
        if pre != 1.0:
            foreach_div_(chunk, pre)
        launched.append((group.allreduce_coalesced(chunk, options), chunk))
    if staged is not None:
        _average_staged(staged[0], group, tensors[small[0]], staged[1])
    to_pack = small if staged is None else ()  # the small ones: packed here unless staged
    if to_pack:
        flats = [tensors[i].view(-1) for i in to_pack]
        packed = torch.cat(flats)
        if pre != 1.0:
            packed.div_(pre)
        launched.append((start_allreduce(packed, group, op), [packed]))
    for work, chunk in launched:
        work.wait()  # on CUDA: the current stream waits for the collective, the host does not
        if post != 1.0:
            foreach_div_(chunk, post)
    if to_pack:
        foreach_copy_(flats, list(packed.split([f.numel() for f in flats])))


def _average_staged(table: TensorTable, group: dist.ProcessGroup, like: torch.Tensor, cap_bytes: float) -> None:
    """Average the tensors of ``table`` through at most ``cap_bytes`` of staging, a few allreduces in all.

    Each run of the table's rows is packed by one launch, averaged, and unpacked by one launch:
    the host time is per run, not per tensor. When the tensors exceed the cap, two half-cap
    buffers alternate so that run ``i + 1`` is packed while run ``i`` is on the wire. ``like``:
    one of the tensors (device and dtype).
    """
    op, pre, post = parameter_plan(group, like.dtype, like.device)
    itemsize = like.element_size()
    staging = _Staging(like.device, table.numel * itemsize, itemsize, cap_bytes)
    buffers, capacity = staging.typed(like.dtype, itemsize)
    in_flight: list[tuple[dist.Work, torch.Tensor, int, int]] = []

    def finish(work: dist.Work, flat: torch.Tensor, first: int, stop: int) -> None:
        work.wait()  # on CUDA: the current stream waits for the collective, the host does not
        if post != 1.0:
            flat.div_(post)
        table.unpack(flat, first, stop)

    for index, (first, stop) in enumerate(table.runs(capacity)):
        if len(in_flight) == len(buffers):
            finish(*in_flight.pop(0))
        flat = buffers[index % len(buffers)].narrow(0, 0, table.span(first, stop))
        table.pack(flat, first, stop)
        if pre != 1.0:
            flat.div_(pre)
        in_flight.append((start_allreduce(flat, group, op), flat, first, stop))
    while in_flight:
        finish(*in_flight.pop(0))
