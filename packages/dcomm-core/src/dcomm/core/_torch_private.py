"""Every private torch member dcomm-core reads, and the accessors that read them.

The other dcomm packages use the many-tensor kernels through :func:`dcomm.core.foreach_div_`,
:func:`dcomm.core.foreach_copy_`, :func:`dcomm.core.foreach_sub_` and
:func:`dcomm.core.views_like`, so each member is listed and read once.

Example::

    >>> premul = make_nccl_premul_sum(0.25)  # doctest: +SKIP
    >>> foreach_div_([torch.ones(2)], 2.0)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dcomm.core.torch_private import PrivateMember, private_member

_PREMUL_SUM = PrivateMember(lambda: dist, "_make_nccl_premul_sum", "NCCL's pre-multiplied sum (fp16 averaging on NCCL)")
_FOREACH_DIV = PrivateMember(lambda: torch, "_foreach_div_", "the in-place division of many tensors in one kernel")
_FOREACH_COPY = PrivateMember(lambda: torch, "_foreach_copy_", "the copy of many tensors in one kernel")
_FOREACH_SUB = PrivateMember(lambda: torch, "_foreach_sub_", "the in-place subtraction of many tensors in one kernel")
_UNFLATTEN = PrivateMember(
    lambda: torch._C._nn, "unflatten_dense_tensors", "the views of a flat buffer shaped like many tensors"
)
_STORAGE_AT = PrivateMember(
    lambda: torch._C, "_construct_storage_from_data_pointer", "a storage over device memory that owns nothing"
)
PRIVATE_MEMBERS = [_PREMUL_SUM, _FOREACH_DIV, _FOREACH_COPY, _FOREACH_SUB, _UNFLATTEN, _STORAGE_AT]


def _read(member: PrivateMember) -> Any:
    return private_member(member.owner(), member.name, distribution="dcomm-core", what=member.what)


def make_nccl_premul_sum(factor: float) -> Any:
    """NCCL's ``SUM`` of the inputs multiplied by ``factor`` (a reduce op; NCCL only)."""
    return _read(_PREMUL_SUM)(factor)


def foreach_div_(tensors: list[torch.Tensor], divisor: float) -> None:
    """Divide every tensor in ``tensors`` by ``divisor`` in place (one kernel per device and dtype).

    Example::

        >>> tensors = [torch.full((2,), 6.0), torch.full((1,), 9.0)]
        >>> foreach_div_(tensors, 3.0)
        >>> tensors
        [tensor([2., 2.]), tensor([3.])]
    """
    _read(_FOREACH_DIV)(tensors, divisor)


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor], non_blocking: bool = False) -> None:
    """Copy each tensor of ``sources`` into the tensor of ``targets`` at its index (one kernel per device and dtype).

    ``non_blocking`` as in ``Tensor.copy_``: a copy between pinned CPU memory and a GPU is queued
    on the current stream and the host does not wait for it.

    Example::

        >>> targets = [torch.zeros(2)]
        >>> foreach_copy_(targets, [torch.ones(2)])
        >>> targets
        [tensor([1., 1.])]
    """
    _read(_FOREACH_COPY)(targets, sources, non_blocking=non_blocking)


def foreach_sub_(targets: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """Subtract each tensor of ``others`` from the tensor of ``targets`` at its index, in place (one kernel
    per device and dtype; the same values as ``target.sub_(other)``).

    Example::

        >>> targets = [torch.full((2,), 5.0)]
        >>> foreach_sub_(targets, [torch.ones(2)])
        >>> targets
        [tensor([4., 4.])]
    """
    _read(_FOREACH_SUB)(targets, others)


def views_like(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of the 1-D ``flat``, one per tensor of ``tensors`` with its shape (made in C++).

    ``flat`` keeps its dtype; it must hold at least the tensors' total number of elements.

    Example::

        >>> views = views_like(torch.arange(5.0), [torch.zeros(2, 2), torch.zeros(1)])
        >>> [tuple(v.shape) for v in views], views[1]
        ([(2, 2), (1,)], tensor([4.]))
    """
    return list(_read(_UNFLATTEN)(flat, tensors))


def storage_at(address: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """A storage over the ``nbytes`` bytes at ``address`` on ``device`` that owns nothing (no deleter).

    It neither frees the memory nor keeps it alive: use it only while the memory's owner lives.

    Example::

        >>> owner = torch.arange(4.0)
        >>> torch.empty(0).set_(storage_at(owner.data_ptr(), owner.device, 8), 0, (2,), (1,))
        tensor([0., 1.])
    """
    return _read(_STORAGE_AT)(address, device, nbytes)
