"""Every private torch member dcomm-core reads, the accessors that read them, and the way to read one.

dcomm relies on a few private torch names. Each package lists the ones it reads in one accessor
module (this one for dcomm-core, ``dcomm.ddp._torch_private``, ``dcomm.fsdp._torch_private``) as
a :class:`PrivateMember` per name, and reads them only through :func:`private_member`, so a
rename raises :class:`TorchChanged` ("torch 2.16 changed X; dcomm-fsdp supports
torch>=2.11,<2.15") instead of silently switching a guard off, and one test per package asserts
that every listed member exists on the torch under test (:func:`missing_members`).

The other dcomm packages use the many-tensor kernels through :func:`dcomm.core.foreach_div_`,
:func:`dcomm.core.foreach_copy_`, :func:`dcomm.core.foreach_sub_` and
:func:`dcomm.core.views_like`, so each member is listed and read once.

Example::

    >>> import torch.distributed as dist
    >>> make = private_member(dist, "_make_nccl_premul_sum", distribution="dcomm-core", what="NCCL premul sums")
    >>> foreach_div_([torch.ones(2)], 2.0)
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "PRIVATE_MEMBERS",
    "PrivateMember",
    "TorchChanged",
    "allgather_base",
    "allgather_options",
    "foreach_copy_",
    "foreach_div_",
    "foreach_sub_",
    "make_nccl_premul_sum",
    "missing_members",
    "private_member",
    "reduce_scatter_base",
    "supported_torch",
    "views_like",
]


class TorchChanged(RuntimeError):
    """A private torch member that dcomm relies on is gone from the installed torch."""


class PrivateMember(NamedTuple):
    """A private torch member: where it lives (``owner()``), its name, and what dcomm uses it for."""

    owner: Callable[[], Any]
    name: str
    what: str


def supported_torch(distribution: str) -> str:
    """The torch requirement of the installed ``distribution`` (``"torch>=2.11,<2.15"``), or ``"torch"``.

    Example::

        >>> supported_torch("dcomm-core")  # doctest: +SKIP
        'torch>=2.11,<2.15'
    """
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return "torch"
    return next((r.replace(" ", "") for r in requirements if r.split(";")[0].strip().startswith("torch")), "torch")


def _changed(owner: Any, name: str, distribution: str, what: str) -> TorchChanged:
    where = getattr(owner, "__name__", type(owner).__name__)
    return TorchChanged(
        f"torch {torch.__version__} changed {what}: {where}.{name} is gone; {distribution} supports "
        f"{supported_torch(distribution)}: install a torch in that range, or a dcomm release that supports this torch"
    )


def private_member(owner: Any, name: str, *, distribution: str, what: str) -> Any:
    """``owner.<name>``, or :class:`TorchChanged` naming the torch version, the member and the supported range.

    Example::

        >>> div = private_member(torch, "_foreach_div_", distribution="dcomm-averaging", what="foreach division")
    """
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _changed(owner, name, distribution, what) from None


def missing_members(members: list[PrivateMember]) -> list[str]:
    """The ``owner.name`` of every member in ``members`` absent from the installed torch (for tests).

    Example::

        >>> missing_members(PRIVATE_MEMBERS)  # doctest: +SKIP
        []
    """
    missing = []
    for member in members:
        owner = member.owner()
        if not hasattr(owner, member.name):
            missing.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{member.name} ({member.what})")
    return missing


_PREMUL_SUM = PrivateMember(lambda: dist, "_make_nccl_premul_sum", "NCCL's pre-multiplied sum (fp16 averaging on NCCL)")
_FOREACH_DIV = PrivateMember(lambda: torch, "_foreach_div_", "the in-place division of many tensors in one kernel")
_FOREACH_COPY = PrivateMember(lambda: torch, "_foreach_copy_", "the copy of many tensors in one kernel")
_FOREACH_SUB = PrivateMember(lambda: torch, "_foreach_sub_", "the in-place subtraction of many tensors in one kernel")
_UNFLATTEN = PrivateMember(
    lambda: torch._C._nn, "unflatten_dense_tensors", "the views of a flat buffer shaped like many tensors"
)
_ALLGATHER_OPTIONS = PrivateMember(
    lambda: torch._C._distributed_c10d, "AllgatherOptions", "the options of a process group's flat all-gather"
)
_REDUCE_SCATTER_BASE = PrivateMember(
    lambda: dist.ProcessGroup, "_reduce_scatter_base", "a process group's flat reduce-scatter, called directly"
)
_ALLGATHER_BASE = PrivateMember(
    lambda: dist.ProcessGroup, "_allgather_base", "a process group's flat all-gather, called directly"
)
PRIVATE_MEMBERS = [
    _PREMUL_SUM,
    _FOREACH_DIV,
    _FOREACH_COPY,
    _FOREACH_SUB,
    _UNFLATTEN,
    _ALLGATHER_OPTIONS,
    _REDUCE_SCATTER_BASE,
    _ALLGATHER_BASE,
]


def _read(member: PrivateMember) -> Any:
    return private_member(member.owner(), member.name, distribution="dcomm-core", what=member.what)


def make_nccl_premul_sum(factor: float) -> Any:
    """NCCL's ``SUM`` of the inputs multiplied by ``factor`` (a reduce op; NCCL only).

    Never for bf16 tensors: torch hands NCCL the factor as a float32 that NCCL reads as a bf16
    (a factor near zero). :func:`dcomm.core.plan_average` only picks it where it is exact.
    """
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


def allgather_options() -> Any:
    """New default options for :func:`allgather_base` (build them once, reuse them for every call)."""
    return _read(_ALLGATHER_OPTIONS)()


def reduce_scatter_base(group: dist.ProcessGroup, output: torch.Tensor, tensor: torch.Tensor, options: Any) -> Any:
    """``group._reduce_scatter_base(output, tensor, options)``: the flat reduce-scatter without ``dist``'s checks.

    Example::

        >>> options = dist.ReduceScatterOptions()
        >>> reduce_scatter_base(dist.group.WORLD, shard, flat, options).wait()  # doctest: +SKIP
    """
    return _read(_REDUCE_SCATTER_BASE)(group, output, tensor, options)


def allgather_base(group: dist.ProcessGroup, output: torch.Tensor, tensor: torch.Tensor, options: Any) -> Any:
    """``group._allgather_base(output, tensor, options)``: the flat all-gather without ``dist``'s checks.

    Example::

        >>> allgather_base(dist.group.WORLD, flat, shard, allgather_options()).wait()  # doctest: +SKIP
    """
    return _read(_ALLGATHER_BASE)(group, output, tensor, options)
