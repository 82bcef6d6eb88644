"""In-place parameter averaging without a flat copy of the model: the collective behind every averager.

:func:`average_parameters` replaces each given parameter by its mean over a process group without
ever building a flat copy of the model. Parameters are grouped by ``(device, dtype)``; each group
takes one of two paths:

* **In place, at most ``bucket_cap_mb`` extra** -- GPU tensors on an NCCL group: every parameter
  of 1 MiB or more is allreduced in its own storage (fp32/fp64/bf16 with NCCL's ``AVG``; fp16
  divided in place with ``torch._foreach_div_`` around a ``SUM``), through the group's coalesced
  allreduce: one grouped NCCL launch for up to 1024 parameters. Parameters that lie back to back
  in one storage (a flattened model) are one allreduce. Each collective in a grouped launch
  costs a few microseconds of host and device time whatever its size, so the smaller
  parameters (norms, biases, a CNN's early convolutions, a narrow transformer's projections) are
  streamed instead through at most ``bucket_cap_mb`` of staging by a table of their addresses
  (:class:`dcomm.core.tensor_table.TensorTable`, built once): one Triton launch packs a run of
  them, one allreduce averages it, one launch copies it back, whatever the number of tensors.
  Without Triton, the small parameters (64 KiB or less) are packed into one buffer of at most
  1 MiB instead.
* **Buckets, at most ``bucket_cap_mb`` extra** -- everywhere else (gloo and CPU parameters, or
  GPU parameters that alias one another): parameters are streamed through a bounded staging
  area: pack a slice into a flat buffer, divide, allreduce (``SUM``), copy back into the
  parameters' own storage. When a group is larger than one bucket the staging area is split
  into two half-bucket buffers so that packing bucket ``i + 1`` overlaps the allreduce of
  bucket ``i``.

With ``DCOMM_CUDA_GRAPHS=1`` (opt-in, alike on every rank), a call on the in-place path that
repeats the last ones (the same parameters in the same storage, as a periodic averager passes
them) is replayed from the third call on as one CUDA graph of all its kernels and collectives
(:func:`_replayed`): its host time no longer grows with the number of parameters.

Either way parameters keep their storage (optimizers and views that hold them stay valid) and
their dtype (a bf16 parameter is averaged in bf16, never promoted), and the arithmetic is the
same up to the last bit: :func:`dcomm.core.plan_average` decides it for both paths.

Example::

    >>> from dcomm.averaging import average_parameters
    >>> average_parameters(model.parameters(), group, bucket_cap_mb=8)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dcomm.core import (
    foreach_copy_,
    foreach_div_,
    plan_average,
    reduced_by_nccl,
    resolve_group,
    start_allreduce,
    tensor_table,
)
from dcomm.core.captured_average import CapturedAverages
from dcomm.core.tensor_table import TensorTable
from dcomm.core.validation import positive_number

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "average_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Default bound, in MiB, on the extra memory one :func:`average_parameters` call allocates."""

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

_LAUNCH_MAX_TENSORS = 1024
"""At most this many tensors per grouped NCCL launch of the in-place path (one launch is fastest).

Half the 2048 operations per group that NCCL documents as its limit (up to 2.11 at least).
"""


class _Segment(NamedTuple):
    """``length`` elements of a parameter's flat view, from ``start``."""

    flat: torch.Tensor
    start: int
    length: int

    def view(self) -> torch.Tensor:
        if self.start == 0 and self.length == self.flat.numel():
            return self.flat  # the whole parameter: no new view (host time per parameter)
        return self.flat.narrow(0, self.start, self.length)


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


def _check_bucket_cap_mb(bucket_cap_mb: object) -> float:
    return positive_number("bucket_cap_mb", bucket_cap_mb, f"pass a bound in MiB, e.g. {DEFAULT_BUCKET_CAP_MB:g}")


def _check_device(device: torch.device, group: dist.ProcessGroup) -> None:
    if device.type == "cpu" and str(dist.get_backend(group)) == "nccl":
        raise ValueError(
            "params: a parameter is on the CPU but process_group uses the 'nccl' backend, which "
            "only reduces GPU tensors; move the parameters to the GPU or create the group with "
            "backend='cpu:gloo,cuda:nccl'"
        )


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


def _overlap(spans: list[tuple[int, int]]) -> bool:
    """Whether two of the ``(address, bytes)`` spans of dense parameters share bytes (aliasing).

    In place, shared bytes would be divided twice; the bucket path copies each parameter out and
    back, which stays right. Disjoint views of one buffer (a flattened model) do not overlap.
    Different storages never share addresses, so comparing address ranges is enough.
    """
    ordered = sorted(spans)
    return any(b[0] < a[0] + a[1] for a, b in itertools.pairwise(ordered))


def _dense(param: torch.Tensor) -> torch.Tensor:
    """``param`` itself when contiguous (no new tensor), else its memory-order flat view."""
    return param if param.is_contiguous() else _flat_view(param)


def _adjacent_runs(tensors: list[torch.Tensor], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, count)`` of each run of consecutive dense tensors that lie back to back in one storage.

    ``spans`` are the tensors' ``(address, bytes)``. Parameters carved out of one flat buffer (a
    flattened model) then cost one allreduce, at the full bandwidth of a raw allreduce of the
    same bytes, instead of one each.
    """
    runs: list[tuple[int, int]] = []
    run_end = 0
    for index, (tensor, (address, nbytes)) in enumerate(zip(tensors, spans, strict=True)):
        if runs and address == run_end and _same_storage(tensors[index - 1], tensor):
            start, count = runs[-1]
            runs[-1] = (start, count + 1)
        else:
            runs.append((index, 1))
        run_end = address + nbytes
    return runs


def _merged(tensors: list[torch.Tensor], runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """One tensor per run: the tensor itself, or one 1-D view over the run's back-to-back tensors."""
    return [_span(tensors[start : start + count]) for start, count in runs]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _span(run: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D view over the back-to-back tensors of ``run`` (the tensor itself for one)."""
    first = run[0]
    if len(run) == 1:
        return first
    numel = sum(t.numel() for t in run)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def _small_ones(tensors: list[torch.Tensor], pack_max_bytes: int) -> list[int]:
    """Indices of the small tensors to pack together (in order, at most ``pack_max_bytes``); none if fewer than 2."""
    small: list[int] = []
    room = pack_max_bytes
    for index, tensor in enumerate(tensors):
        if tensor.nbytes <= min(SMALL_PARAMETER_BYTES, room):
            small.append(index)
            room -= tensor.nbytes
    return small if len(small) > 1 else []


def _staged_ones(tensors: list[torch.Tensor], below_bytes: int, run_bytes: int) -> tuple[list[int], TensorTable | None]:
    """Indices of the tensors under ``below_bytes`` and their table (see :func:`_average_staged`).

    ``([], None)`` where fewer than two tensors qualify, where Triton or CUDA is missing (the small
    ones are then packed: :func:`_small_ones`), or where half the staging cap (``run_bytes``)
    cannot hold one row of the table.
    """
    staged = [index for index, tensor in enumerate(tensors) if tensor.nbytes < below_bytes]
    members = [tensors[i] for i in staged]
    if len(staged) < 2 or not tensor_table.usable(members):
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
    Then the current stream (never the host) waits for each launch, fp16 gets its post-division,
    and the packed values go back to their tensors.
    """
    # NCCL averages fp32/fp64/bf16 inside the collective (AVG: no division pass); fp16 keeps its
    # pre/post division (no pre-multiplied sums in a coalesced allreduce).
    op, pre, post = plan_average(group, tensors[0].dtype, tensors[0].device, nccl_premul=False)
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
    op, pre, post = plan_average(group, like.dtype, like.device, nccl_premul=False)
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


def _average_group(flats: list[torch.Tensor], group: dist.ProcessGroup, staging: _Staging) -> None:
    """Average same-device, same-dtype flat views over ``group`` through ``staging``."""
    dtype = flats[0].dtype
    buffers, capacity = staging.typed(dtype, flats[0].element_size())
    op, pre, post = plan_average(group, dtype, flats[0].device, nccl_premul=False)

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


class _Paths(NamedTuple):
    """How :func:`average_parameters` picks and sizes its paths (tests pass other values).

    ``in_place``: None takes the in-place path exactly where NCCL reduces (NCCL's coalesced
    allreduce reduces each tensor in its own storage; gloo's flattens into a copy, and CPU tensors
    are better served by the buckets); True or False forces it. ``on_in_place`` sees the tensors
    of every in-place call (before the small ones are staged or packed); ``pack_max_bytes`` 0
    packs none; ``stage_below_bytes`` 0 stages none (the small ones are packed, as without Triton);
    ``stage_run_bytes`` is set per call (half the cap: the most one staged run holds); ``graphs``
    False never replays a CUDA graph (see :func:`_replayed`).
    """

    in_place: bool | None = None
    launch_max_tensors: int = _LAUNCH_MAX_TENSORS
    on_in_place: Callable[[list[torch.Tensor]], None] | None = None
    pack_max_bytes: int = PACK_MAX_BYTES
    stage_below_bytes: int = STAGE_BELOW_BYTES
    stage_run_bytes: int = 0
    graphs: bool = True


def _average_integers(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average integer and bool tensors as torch does (the mean, truncated toward zero), but exactly.

    torch averages them in floating point and casts back; here their int64 sum is exact and the
    division truncates (a bool becomes True where any rank holds True, as in torch). One ``SUM``
    allreduce per device.
    """
    world = dist.get_world_size(group)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for members in by_device.values():
        total = torch.cat([t.reshape(-1).to(torch.int64) for t in members])
        dist.all_reduce(total, group=group)
        for tensor, summed in zip(members, total.split([t.numel() for t in members]), strict=True):
            mean = summed if tensor.dtype == torch.bool else torch.div(summed, world, rounding_mode="trunc")
            tensor.copy_(mean.view_as(tensor))


def _checked(param: torch.Tensor) -> None:
    """Refuse, before any collective, a parameter that cannot be averaged (its device: see _by_device)."""
    if param.layout != torch.strided:
        raise ValueError(
            f"params: a parameter of shape {tuple(param.shape)} has the {param.layout} layout; "
            "average_parameters averages dense tensors: convert it with param.data = param.data.to_dense()"
        )
    if param.device.type == "meta":
        raise ValueError(
            f"params: a parameter of shape {tuple(param.shape)} is on the meta device and holds no data; "
            "materialize the model first (model.to_empty(device=...) and load its weights)"
        )
    if param.is_complex():
        raise ValueError(
            f"params: a parameter has the complex dtype {param.dtype}; average its real view instead "
            "(torch.view_as_real(param))"
        )
    if param.is_floating_point() and not param.is_contiguous():
        # A layout with gaps or overlaps raises here, not when its device's turn comes: with
        # parameters on several devices, another device would already have been averaged.
        _flat_view(param)


def _by_device(
    params: list[torch.Tensor], group: dist.ProcessGroup
) -> tuple[dict[torch.device, list[list[int]]], list[int]]:
    """Indices of the floating-point parameters by device, then dtype, each checked; of the integer ones.

    Raises ``ValueError`` on this rank, before any collective, for an empty ``params`` (torch
    raises there too) or a parameter that cannot be averaged (sparse, meta, complex, CPU on NCCL).
    Integer and bool tensors (BatchNorm's ``num_batches_tracked``) go to :func:`_average_integers`.
    """
    if not params:
        raise ValueError(
            "params: got no parameters on this rank, so its peers would wait for it in the allreduce; "
            "pass the same non-empty parameters on every rank of the group (for param groups, only "
            "parameters with a gradient are averaged: call it after backward)"
        )
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    integers: list[int] = []
    seen: set[int] = set()
    for index, param in enumerate(params):
        _checked(param)
        if id(param) in seen or param.numel() == 0:
            continue
        seen.add(id(param))
        if not param.is_floating_point():
            integers.append(index)
            continue
        by_kind.setdefault((param.device, param.dtype), []).append(index)
    for device in {device for device, _ in by_kind} | {params[i].device for i in integers}:
        _check_device(device, group)  # once per device: a c10d query per parameter costs host time
    by_device: dict[torch.device, list[list[int]]] = {}
    for (device, _), indices in by_kind.items():
        by_device.setdefault(device, []).append(indices)
    return by_device, integers


class _DeviceRecipe(NamedTuple):
    """One device's parameters: indices per dtype; for the in-place path, per dtype, their back-to-back
    runs (None where every run is one tensor), which of the merged tensors to stage (:func:`_staged_ones`,
    with their table) or else to pack (:func:`_small_ones`, no table); whether NCCL reduces them
    (then their average may be replayed as a CUDA graph: :func:`_replayed`)."""

    device: torch.device
    groups: list[list[int]]
    in_place: bool
    runs: list[list[tuple[int, int]] | None]
    small: list[list[int]]
    tables: list[TensorTable | None]
    by_nccl: bool


class _Recipe(NamedTuple):
    """What :func:`_prepare` decided for one list of parameters: indices and staging tables, never a parameter.

    A table holds the staged parameters' addresses, which the call key pins (their ``data_ptr``).
    """

    devices: list[_DeviceRecipe]
    integers: list[int]


_RECIPES: collections.OrderedDict[int, tuple[tuple[Any, ...], _Recipe]] = collections.OrderedDict()
"""The recipes of the last calls by the hash of their key, most recent last (a periodic averager
passes the same parameters; several parameter lists, or several groups, are averaged in turn)."""

_RECIPES_KEPT = 16

_dtype_of = operator.attrgetter("dtype")


def _call_key(params: list[torch.Tensor], group: dist.ProcessGroup, paths: _Paths) -> tuple[Any, ...] | None:
    """What must not change for a recipe to hold: the parameters, their storage, dtype and size, the paths.

    Flat tuples, cheap to build and hash (a recipe depends on each parameter's address and byte
    count, not on its shape). None when a parameter has no storage address (sparse): such calls
    are prepared every time.
    """
    try:
        pointers = tuple(map(torch.Tensor.data_ptr, params))
    except RuntimeError:
        return None
    sizes = tuple(map(torch.Tensor.numel, params))
    return (id(group), paths, tuple(map(id, params)), pointers, sizes, tuple(map(_dtype_of, params)))


def _recipe_for(key: tuple[Any, ...] | None) -> tuple[int | None, _Recipe | None]:
    """The kept recipe of ``key`` (None if there is none) and the key's hash (computed once per call)."""
    if key is None:
        return None, None
    digest = hash(key)
    kept = _RECIPES.get(digest)
    return digest, (kept[1] if kept is not None and kept[0] == key else None)


def _keep(digest: int, key: tuple[Any, ...], recipe: _Recipe) -> None:
    _RECIPES[digest] = (key, recipe)
    _RECIPES.move_to_end(digest)
    while len(_RECIPES) > _RECIPES_KEPT:
        evicted, _ = _RECIPES.popitem(last=False)
        _forget_graphs(evicted)


_GRAPHS: dict[torch.device, tuple[CapturedAverages, Any]] = {}
"""Per device, the graphs of the kept recipes' in-place averages (keyed by the recipe's digest) and
the side stream they replay on."""


def _forget_graphs(digest: int) -> None:
    """Drop the graphs of ``digest``'s recipe (replaced or evicted: its tables may be freed)."""
    for graphs, _ in _GRAPHS.values():
        graphs.forget(digest)


def _replayed(digest: int | None, recipe: _DeviceRecipe, group: dist.ProcessGroup, average: Callable[[], None]) -> bool:
    """Run one device's in-place average as a CUDA graph where one is captured or due; whether it did.

    The same parameters averaged again cost the same kernels and collectives every call: on
    models of many tensors their host time is most of the call (4x H200: a ResNet-34's 110
    tensors 1.84x a raw allreduce of the same bytes, replayed 1.14x). With ``DCOMM_CUDA_GRAPHS=1``
    (opt-in, alike on every rank), from the third call with the same recipe (``digest``) the
    average is captured once and replayed; every eighth call stays eager so that the NCCL
    watchdog keeps seeing a collective (see :mod:`dcomm.core.captured_average`). The graph holds
    at most the staging of the small parameters (``bucket_cap_mb``) while its recipe is kept.
    It also holds ``group``: the call key names the group by ``id``, and a group destroyed and
    replaced by a new one at the same address would otherwise replay the old communicator.
    """
    if digest is None or not (recipe.in_place and recipe.by_nccl) or torch.cuda.is_current_stream_capturing():
        return False
    kept = _GRAPHS.get(recipe.device)
    if kept is None:
        kept = _GRAPHS[recipe.device] = (
            CapturedAverages("average_parameters", max_graphs=_RECIPES_KEPT, on_by_default=False),
            torch.cuda.Stream(recipe.device),
        )
    graphs, stream = kept
    work = graphs.replay(digest, stream, watched=True)
    if work is None and graphs.due(digest):

        def captured() -> int:
            average()
            return 0

        work = graphs.capture(digest, captured, stream, keep=(recipe, group))
    if work is None:
        return False
    work.wait()
    return True


def _prepare(
    params: list[torch.Tensor], group: dist.ProcessGroup, paths: _Paths
) -> tuple[_Recipe, dict[torch.device, list[list[torch.Tensor]]]]:
    """Check every parameter and decide each device's path (raises before any collective).

    ``paths.pack_max_bytes`` must already be bounded by the bucket cap. Also returns the dense
    views it made of the in-place devices' parameters, for this call only (the recipe, which is
    kept, holds indices).
    """
    by_device, integers = _by_device(params, group)
    devices = []
    dense: dict[torch.device, list[list[torch.Tensor]]] = {}
    for device, groups in by_device.items():
        by_nccl = reduced_by_nccl(group, device)
        in_place = by_nccl if paths.in_place is None else paths.in_place
        runs: list[list[tuple[int, int]] | None] = []
        small: list[list[int]] = []
        tables: list[TensorTable | None] = []
        if in_place:
            tensors = dense[device] = [[_dense(params[i]) for i in indices] for indices in groups]
            spans = [[(t.data_ptr(), t.nbytes) for t in ts] for ts in tensors]
            in_place = not _overlap([span for group_spans in spans for span in group_spans])
        if in_place:
            for ts, sp in zip(tensors, spans, strict=True):
                group_runs = _adjacent_runs(ts, sp)
                merged = _merged(ts, group_runs)
                runs.append(group_runs if len(merged) < len(ts) else None)
                staged, table = _staged_ones(merged, paths.stage_below_bytes, paths.stage_run_bytes)
                small.append(staged if table is not None else _small_ones(merged, paths.pack_max_bytes))
                tables.append(table)
        devices.append(_DeviceRecipe(device, groups, in_place, runs, small, tables, by_nccl))
    return _Recipe(devices, integers), dense


def _average_on_device(
    recipe: _DeviceRecipe,
    params: list[torch.Tensor],
    group: dist.ProcessGroup,
    cap_bytes: float,
    paths: _Paths,
    groups: list[list[torch.Tensor]] | None = None,
) -> None:
    """Average one device's parameters (one list per dtype) in place, or else through buckets.

    ``groups``: their dense views when :func:`_prepare` has just made them, else None.
    """
    if groups is None:
        groups = [[_dense(params[i]) for i in indices] for indices in recipe.groups]
    if recipe.in_place:
        for tensors, runs, small, table in zip(groups, recipe.runs, recipe.small, recipe.tables, strict=True):
            merged = tensors if runs is None else _merged(tensors, runs)
            if paths.on_in_place is not None:
                paths.on_in_place(merged)
            staged = None if table is None else (table, cap_bytes)
            _average_in_place(merged, group, paths.launch_max_tensors, small, staged)
        return
    flat_groups = [[t if t.dim() == 1 else t.view(-1) for t in ts] for ts in groups]
    staging = _Staging(
        recipe.device,
        max(sum(f.numel() for f in flats) * flats[0].element_size() for flats in flat_groups),
        max(flats[0].element_size() for flats in flat_groups),
        cap_bytes,
    )
    for flats in flat_groups:
        _average_group(flats, group, staging)


def _average_parameters(
    params: Iterable[torch.Tensor],
    process_group: dist.ProcessGroup | None,
    bucket_cap_mb: float,
    paths: _Paths | None = None,
) -> None:
    """:func:`average_parameters` with its paths chosen by ``paths``.

    The checks and path decisions of a call are kept (as indices) and reused while the next call
    passes the same parameters with the same storage: a periodic averager pays them once.
    """
    cap_bytes = _check_bucket_cap_mb(bucket_cap_mb) * 2**20
    group = resolve_group(process_group)
    if dist.get_rank(group) < 0:  # not a member: nothing to average here
        return
    paths = paths or _Paths()
    # Never more than a bucket; a staged tensor fits half of one (the two pipelined buffers).
    paths = paths._replace(
        pack_max_bytes=min(paths.pack_max_bytes, int(cap_bytes)), stage_run_bytes=int(cap_bytes // 2)
    )
    params = list(params)
    key = _call_key(params, group, paths)
    digest, recipe = _recipe_for(key)
    dense: dict[torch.device, list[list[torch.Tensor]]] = {}
    if recipe is None:
        recipe, dense = _prepare(params, group, paths)
        if digest is not None:
            _forget_graphs(digest)  # a graph of another recipe with this digest touches other memory
    if key is not None and digest is not None:
        _keep(digest, key, recipe)
    graph_key = digest if paths.graphs else None
    with torch.no_grad():
        for device_recipe in recipe.devices:
            average = functools.partial(
                _average_on_device, device_recipe, params, group, cap_bytes, paths, dense.get(device_recipe.device)
            )
            if not _replayed(graph_key, device_recipe, group, average):
                average()
        if recipe.integers:
            _average_integers([params[i].detach() for i in recipe.integers], group)


def average_parameters(
    params: Iterable[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Replace every parameter in ``params`` by its mean over ``process_group``, in place.

    ``process_group`` defaults to WORLD; on a rank outside it this changes nothing. Parameters may
    live on several devices and have several dtypes: each ``(device, dtype)`` group is averaged in
    its own dtype. GPU parameters on an NCCL group are divided and allreduced in their own
    storage: one grouped NCCL launch for up to 1024 parameters of 1 MiB or more, one allreduce for
    parameters that lie back to back in one storage; the smaller ones are streamed through at
    most ``bucket_cap_mb`` of staging, a few allreduces in all (with Triton; without it the ones
    of 64 KiB or less are packed into at most 1 MiB). Elsewhere
    (gloo, CPU) they go through buckets of at most ``bucket_cap_mb`` MiB of extra memory per
    device (a parameter larger than a bucket is split across buckets); so do GPU parameters that
    alias one another. A dense non-contiguous layout (channels-last) is averaged through its
    memory-order flat view, which is contiguous, on either path. The reduce op and divisions come
    from :func:`dcomm.core.plan_average`: fp32/fp64 are divided by the group size before the
    ``SUM`` (as torch does), fp16 partly before and partly after it, bf16 after it; on NCCL,
    ``ReduceOp.AVG`` averages fp32/fp64/bf16 inside the collective. Integer and bool tensors
    (BatchNorm's ``num_batches_tracked``) get their mean truncated toward zero, as torch gives
    them (torch computes it in floating point; here the sum is exact). No device synchronize: on
    CUDA the current stream waits for each allreduce, so later work on that stream sees the
    averaged values.

    Every rank of the group must pass the same parameters in the same order, laid out alike (views
    of one buffer on one rank are views of one buffer on every rank, as the same model code gives).
    Everything is checked before the first collective, so a bad parameter raises with nothing
    averaged: an empty ``params`` (torch raises too; the peers would otherwise wait for this rank),
    a sparse, meta or complex tensor, a CPU tensor on an NCCL group.

    With ``DCOMM_CUDA_GRAPHS=1`` set alike on every rank (opt-in), on NCCL, from the third call
    with the same parameters in the same storage, the in-place average is captured once as a CUDA
    graph and replayed (every eighth call stays eager, so that the NCCL watchdog keeps timing a
    collective); the graph keeps the small parameters' staging (at most ``bucket_cap_mb``)
    reserved while it lives, and is released before ``destroy_process_group``.

    Example::

        >>> average_parameters(model.parameters(), None)  # doctest: +SKIP
    """
    _average_parameters(params, process_group, bucket_cap_mb)


def get_params_to_average(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
) -> list[torch.nn.Parameter]:
    """The parameters in ``params`` that have a gradient, in order.

    ``params`` is a module's parameters or an optimizer's param groups (dicts with ``"params"``);
    parameters whose ``.grad`` is None (frozen, or unused this step) are skipped.

    Example::

        >>> get_params_to_average(optimizer.param_groups)  # doctest: +SKIP
    """
    chosen: list[torch.nn.Parameter] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            candidates: Iterable[torch.nn.Parameter] = [item]
        elif isinstance(item, dict) and "params" in item:
            candidates = item["params"]
        else:
            raise NotImplementedError(
                f"params: an item of type {type(item).__name__} is neither a parameter nor a param "
                "group; pass model.parameters() or optimizer.param_groups"
            )
        chosen.extend(p for p in candidates if p.grad is not None)
    return chosen


def average_parameters_or_parameter_groups(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
    process_group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Average a module's parameters or an optimizer's param groups that have a gradient.

    Example::

        >>> average_parameters_or_parameter_groups(optimizer.param_groups, None)  # doctest: +SKIP
    """
    average_parameters(get_params_to_average(params), process_group, bucket_cap_mb=bucket_cap_mb)
