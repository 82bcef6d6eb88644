"""Named access to private torch members, failing loudly when a torch release renames one.

dcomm relies on a few private torch names. Each package lists the ones it reads in its own
``_torch_private`` module (a :class:`PrivateMember` per name) and reads them only through
:func:`private_member`, so a rename raises :class:`TorchChanged` ("torch 2.16 changed X; dcomm-fsdp
supports torch>=2.11,<2.15") instead of silently switching a guard off, and one test per package
asserts that every listed member exists on the torch under test.

Example::

    >>> import torch.distributed as dist
    >>> make = private_member(dist, "_make_nccl_premul_sum", distribution="dcomm-core", what="NCCL premul sums")
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["PrivateMember", "TorchChanged", "missing_members", "private_member", "supported_torch"]


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
