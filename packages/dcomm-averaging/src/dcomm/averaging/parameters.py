"""In-place parameter averaging without a flat copy of the model: the collective behind every averager.

:func:`average_parameters` replaces each given parameter by its mean over a process group without
ever building a flat copy of the model. Parameters are grouped by ``(device, dtype)``; each group
takes one of two paths:

* **In place, zero extra memory** -- on a GPU whose backend coalesces collectives (NCCL): every
  parameter is allreduced in its own storage (fp32/fp64 with NCCL's ``AVG``; fp16/bf16 divided in
  place with ``torch._foreach_div_`` around a ``SUM``), the allreduces of up to 64 parameters /
  256 MiB issued as one coalesced NCCL group through ``torch.distributed._coalescing_manager``,
  so NCCL fuses them. Nothing is packed, copied
  or allocated.
* **Buckets, at most ``bucket_cap_mb`` extra** -- everywhere else (gloo and CPU parameters, or a
  torch whose private coalescing API is missing or refuses the group): parameters are streamed
  through a bounded staging area: pack a slice into a flat buffer, divide, allreduce (``SUM``),
  copy back into the parameters' own storage. When a group is larger than one bucket the staging
  area is split into two half-bucket buffers so that packing bucket ``i + 1`` overlaps the
  allreduce of bucket ``i``.

Either way parameters keep their storage (optimizers and views that hold them stay valid) and
their dtype (a bf16 parameter is averaged in bf16, never promoted), and the arithmetic is the
same up to the last bit: fp32/fp64 divided by the group size before the sum (or NCCL's ``AVG``),
fp16/bf16 divided partly before and partly after it.

Example::

    >>> from dcomm.averaging import average_parameters
    >>> average_parameters(model.parameters(), group, bucket_cap_mb=8)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dcomm.core import divide_factors, reduced_by_nccl, resolve_group

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "average_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Default bound, in MiB, on the extra memory one :func:`average_parameters` call allocates."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)

_COALESCE_MAX_TENSORS = 64
"""At most this many parameters per coalesced NCCL group of the in-place path."""

_COALESCE_MAX_BYTES = 256 * 2**20
"""At most this many bytes per coalesced NCCL group (a larger parameter is a group of its own)."""

_SETUP_ERRORS = (TypeError, AttributeError, RuntimeError, ValueError)
"""What entering torch's private coalescing manager may raise when it does not fit this torch."""


class _Segment(NamedTuple):
    """``length`` elements of a parameter's flat view, from ``start``."""

    flat: torch.Tensor
    start: int
    length: int

    def view(self) -> torch.Tensor:
        return self.flat.narrow(0, self.start, self.length)


def _flat_view(param: torch.Tensor) -> torch.Tensor:
    """A 1-D view of every element of ``param`` in memory order (no copy).

    Contiguous tensors and any dense permutation of one (channels-last, transposed) qualify.
    Averaging is elementwise, so memory order is as good as logical order as long as all ranks
    lay the parameter out the same way, which they do for the same model.
    """
    data = param.detach()
    if data.is_contiguous():
        return data.view(-1)
    order = sorted(range(data.dim()), key=lambda d: data.stride(d), reverse=True)
    permuted = data.permute(order)
    if permuted.is_contiguous():
        return permuted.view(-1)
    raise ValueError(
        f"params: a parameter of shape {tuple(data.shape)} and strides {data.stride()} has gaps or "
        "overlaps in memory, so it cannot be averaged in place; make it contiguous first "
        "(param.data = param.data.contiguous())"
    )


def _check_bucket_cap_mb(bucket_cap_mb: object) -> float:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
        raise ValueError(
            f"bucket_cap_mb: expected a positive number of MiB, got {bucket_cap_mb!r}; "
            f"pass e.g. {DEFAULT_BUCKET_CAP_MB:g}"
        )
    return float(bucket_cap_mb)


def _check_device(device: torch.device, group: dist.ProcessGroup) -> None:
    backend = str(dist.get_backend(group))
    if device.type == "cpu" and backend == "nccl":
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


def _divisors(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """``(pre, post)``: divide by ``pre`` before the ``SUM`` and by ``post`` after it."""
    if dtype in _LOW_PRECISION:
        # Split the division around the sum so fp16/bf16 neither overflow nor underflow.
        return divide_factors(world)
    # One division before the sum: exact for power-of-two groups, torch's own arithmetic.
    return float(world), 1.0


def _coalescing_manager() -> Callable[..., Any] | None:
    """torch's private ``dist._coalescing_manager`` if it takes ``group``, ``device``, ``async_ops``."""
    manager = getattr(dist, "_coalescing_manager", None)
    if manager is None:
        return None
    try:
        names = inspect.signature(manager).parameters
    except (TypeError, ValueError):
        return None
    return manager if {"group", "device", "async_ops"} <= names.keys() else None


def _averages_in_place(device: torch.device, group: dist.ProcessGroup) -> bool:
    """Whether parameters on ``device`` take the in-place path: a GPU backend that coalesces (NCCL).

    gloo (CPU, or CUDA tensors on a gloo group) does not coalesce (its ``allreduce_coalesced``
    would flatten into a copy anyway), so it keeps the buckets.
    """
    if device.type == "cpu" or _coalescing_manager() is None:
        return False
    try:
        backend = group._get_backend(device)
    except _SETUP_ERRORS:
        return False
    return bool(getattr(backend, "supports_coalescing", False))


def _nccl_average(group: dist.ProcessGroup, flat: torch.Tensor) -> bool:
    """Whether ``ReduceOp.AVG`` may average ``flat``: NCCL on a GPU, fp32/fp64 only.

    Never on gloo (no AVG there), never for fp16/bf16 (their pre/post divide guards the range).
    """
    return flat.dtype in (torch.float32, torch.float64) and reduced_by_nccl(group, flat)


def _overlap(flats: list[torch.Tensor]) -> bool:
    """Whether two of ``flats`` share bytes (distinct parameters aliasing one another).

    In place, shared bytes would be divided twice; the bucket path copies each parameter out and
    back, which stays right. Disjoint views of one buffer (a flattened model) do not overlap.
    """
    spans = sorted(
        (f.untyped_storage().data_ptr(), f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in flats
    )
    return any(a[0] == b[0] and b[1] < a[2] for a, b in itertools.pairwise(spans))


def _coalesced_chunks(flats: list[torch.Tensor]) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """``(index of the first, chunk)``: runs of at most 64 flats and 256 MiB (at least one flat)."""
    chunk: list[torch.Tensor] = []
    start = size = 0
    for index, flat in enumerate(flats):
        nbytes = flat.numel() * flat.element_size()
        if chunk and (len(chunk) == _COALESCE_MAX_TENSORS or size + nbytes > _COALESCE_MAX_BYTES):
            yield start, chunk
            chunk, start, size = [], index, 0
        chunk.append(flat)
        size += nbytes
    if chunk:
        yield start, chunk


def _average_in_place(
    flats: list[torch.Tensor],
    group: dist.ProcessGroup,
    world: int,
    manager_device: torch.device | None,
) -> list[torch.Tensor]:
    """Average same-device, same-dtype contiguous flat views over ``group`` in their own storage.

    Each chunk is divided in place and its allreduces issued inside torch's coalescing manager
    (``manager_device`` is passed to it: the GPU for NCCL's grouped launch, None for a backend
    that only has ``allreduce_coalesced``). Chunks are launched back to back; then, chunk by
    chunk, the current stream waits for the collective (never the host) and fp16/bf16 get their
    post-division. No memory is allocated.

    Returns the flats not averaged because the coalescing manager failed to start (nothing of
    those was touched): the caller averages them through buckets.
    """
    manager = _coalescing_manager()
    if manager is None:
        return flats
    pre, post = _divisors(flats[0].dtype, world)
    op = dist.ReduceOp.SUM
    if _nccl_average(group, flats[0]):
        # NCCL averages fp32/fp64 inside the collective: no separate division pass over the data.
        op, pre = dist.ReduceOp.AVG, 1.0
    pending = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if not isinstance(pending, dict):
        return flats
    launched: list[tuple[Any, list[torch.Tensor]]] = []
    rest: list[torch.Tensor] = []
    for start, chunk in _coalesced_chunks(flats):
        if group in pending:  # the caller is coalescing on this group already: do not nest
            rest = flats[start:]
            break
        with contextlib.ExitStack() as stack:
            try:
                cm = stack.enter_context(manager(group=group, device=manager_device, async_ops=True))
            except _SETUP_ERRORS:
                # A failed start leaves torch's (empty) op list behind; later collectives on the
                # group would only be recorded into it, so drop it.
                if pending.get(group) == []:
                    del pending[group]
                rest = flats[start:]
                break
            # The collectives launch when the manager exits, after the division on this stream.
            if pre != 1.0:
                torch._foreach_div_(chunk, pre)
            for flat in chunk:
                dist.all_reduce(flat, op=op, group=group)
        launched.append((cm, chunk))
    for cm, chunk in launched:
        cm.wait()  # on CUDA: the current stream waits for the collective, the host does not
        if post != 1.0:
            torch._foreach_div_(chunk, post)
    return rest


def _average_group(flats: list[torch.Tensor], group: dist.ProcessGroup, world: int, staging: _Staging) -> None:
    """Average same-device, same-dtype flat views over ``group`` through ``staging``."""
    dtype = flats[0].dtype
    buffers, capacity = staging.typed(dtype, flats[0].element_size())
    pre, post = _divisors(dtype, world)

    in_flight: list[tuple[dist.Work, torch.Tensor, list[_Segment]]] = []

    def finish(work: dist.Work, staged: torch.Tensor, segments: list[_Segment]) -> None:
        work.wait()  # on CUDA: the current stream waits for the collective, the host does not
        if post != 1.0:
            staged.div_(post)
        targets = [s.view() for s in segments]
        sources = list(staged.split([s.length for s in segments]))
        torch._foreach_copy_(targets, sources)

    for index, segments in enumerate(_buckets(flats, capacity)):
        if len(in_flight) == len(buffers):
            finish(*in_flight.pop(0))
        staged = buffers[index % len(buffers)].narrow(0, 0, sum(s.length for s in segments))
        if len(segments) == 1:
            staged.copy_(segments[0].view())
        else:
            torch.cat([s.view() for s in segments], out=staged)
        if pre != 1.0:
            staged.div_(pre)
        work = dist.all_reduce(staged, group=group, async_op=True)
        assert work is not None
        in_flight.append((work, staged, segments))
    while in_flight:
        finish(*in_flight.pop(0))


def average_parameters(
    params: Iterable[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Replace every parameter in ``params`` by its mean over ``process_group``, in place.

    ``process_group`` defaults to WORLD; on a rank outside it this changes nothing. Parameters may
    live on several devices and have several dtypes: each ``(device, dtype)`` group is averaged in
    its own dtype. On a GPU whose backend coalesces collectives (NCCL) the parameters are divided
    and allreduced in their own storage, up to 64 parameters / 256 MiB per coalesced NCCL group,
    with no extra memory (``bucket_cap_mb`` is then unused). Elsewhere (gloo, CPU) they go
    through buckets of at most ``bucket_cap_mb`` MiB of extra memory per device (a parameter
    larger than a bucket is split across buckets); so do GPU parameters that alias one another,
    or all of them if torch's private coalescing manager is missing or fails to start. A dense
    non-contiguous layout (channels-last) is averaged through its memory-order flat view, which is
    contiguous, on either path. fp32/fp64 are divided by the group size before the ``SUM`` (as
    torch does; on NCCL in place, ``ReduceOp.AVG`` does it inside the collective); fp16/bf16
    are divided partly before and partly after it (:func:`dcomm.core.divide_factors`). No device
    synchronize: on CUDA the current stream waits for each allreduce, so later work on that
    stream sees the averaged values.

    Every rank of the group must pass the same parameters in the same order.

    Example::

        >>> average_parameters(model.parameters(), None)  # doctest: +SKIP
    """
    _check_bucket_cap_mb(bucket_cap_mb)
    group = resolve_group(process_group)
    if dist._rank_not_in_group(group):
        return
    world = dist.get_world_size(group)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for param in params:
        if id(param) in seen or param.numel() == 0:
            continue
        seen.add(id(param))
        flat = _flat_view(param)
        by_kind.setdefault((flat.device, flat.dtype), []).append(flat)
    for device, _ in by_kind:
        _check_device(device, group)
    cap_bytes = bucket_cap_mb * 2**20
    devices = list(dict.fromkeys(device for device, _ in by_kind))
    with torch.no_grad():
        for device in devices:
            groups = [flats for (d, _), flats in by_kind.items() if d == device]
            if _averages_in_place(device, group) and not _overlap([f for flats in groups for f in flats]):
                groups = [rest for flats in groups if (rest := _average_in_place(flats, group, world, device))]
            if not groups:
                continue
            staging = _Staging(
                device,
                max(sum(f.numel() for f in flats) * flats[0].element_size() for flats in groups),
                max(flats[0].element_size() for flats in groups),
                cap_bytes,
            )
            for flats in groups:
                _average_group(flats, group, world, staging)
            del staging


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
            candidates: Iterable[torch.nn.Parameter] = [item]  # type: ignore[list-item]
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
