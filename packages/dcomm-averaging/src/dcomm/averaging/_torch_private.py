"""Every private torch member dcomm-averaging reads, and the accessors that read them.

Example::

    >>> foreach_div_([torch.ones(2)], 2.0)  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from dcomm.core.torch_private import PrivateMember, private_member

_FOREACH_DIV = PrivateMember(lambda: torch, "_foreach_div_", "the in-place division of many tensors in one kernel")
_FOREACH_COPY = PrivateMember(lambda: torch, "_foreach_copy_", "the copy of many tensors in one kernel")
PRIVATE_MEMBERS = [_FOREACH_DIV, _FOREACH_COPY]


def _read(member: PrivateMember) -> object:
    return private_member(member.owner(), member.name, distribution="dcomm-averaging", what=member.what)


def foreach_div_(tensors: list[torch.Tensor], divisor: float) -> None:
    """Divide every tensor in ``tensors`` by ``divisor`` in place (one kernel per device and dtype)."""
    _read(_FOREACH_DIV)(tensors, divisor)  # type: ignore[operator]


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target (one kernel per device and dtype)."""
    _read(_FOREACH_COPY)(targets, sources)  # type: ignore[operator]
