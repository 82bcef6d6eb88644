"""In-place, bucketed parameter averaging: the collective behind every averager.

:func:`average_parameters` replaces each given parameter by its mean over a process group without
ever building a flat copy of the model. Parameters are grouped by ``(device, dtype)`` and streamed
through a bounded staging area: pack a slice of parameters into a flat buffer, divide, allreduce
(``SUM``), copy back into the parameters' own storage. When a group is larger than one bucket the
staging area is split into two half-bucket buffers so that packing bucket ``i + 1`` overlaps the
allreduce of bucket ``i``; either way the extra memory is at most ``bucket_cap_mb``. Parameters
keep their storage (optimizers and views that hold them stay valid) and their dtype (a bf16
parameter is averaged in bf16, never promoted).

Example::

    >>> from dcomm.averaging import average_parameters
    >>> average_parameters(model.parameters(), group, bucket_cap_mb=8)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from dcomm.core import divide_factors, resolve_group

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "average_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Default bound, in MiB, on the extra memory one :func:`average_parameters` call allocates."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)


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


def _average_group(flats: list[torch.Tensor], group: dist.ProcessGroup, world: int, staging: _Staging) -> None:
    """Average same-device, same-dtype flat views over ``group`` through ``staging``."""
    dtype = flats[0].dtype
    buffers, capacity = staging.typed(dtype, flats[0].element_size())
    if dtype in _LOW_PRECISION:
        # Split the division around the sum so fp16/bf16 neither overflow nor underflow.
        pre, post = divide_factors(world)
    else:
        # One division before the sum: exact for power-of-two groups, torch's own arithmetic.
        pre, post = float(world), 1.0

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
    its own dtype through buckets of at most ``bucket_cap_mb`` MiB of extra memory per device (a
    parameter larger than a bucket is split across buckets). fp32/fp64 are divided by the group
    size before the ``SUM`` (as torch does); fp16/bf16 are divided partly before and partly after
    it (:func:`dcomm.core.divide_factors`). No device synchronize: on CUDA the current stream waits
    for each allreduce, so later work on that stream sees the averaged values.

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
