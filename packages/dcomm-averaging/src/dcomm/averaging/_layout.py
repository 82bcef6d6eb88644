"""How a parameter's memory is read for averaging: one 1-D view of its elements in memory order.

Averaging is elementwise, so a parameter whose elements fill one block of memory without gaps
(contiguous, channels-last, any permutation of a contiguous tensor) can be averaged through a 1-D
view of that block, in place. A layout with gaps or overlaps (a strided slice) cannot.

Example::

    >>> import torch
    >>> memory_order_view(torch.zeros(2, 3).t()).shape
    torch.Size([6])
    >>> memory_order_view(torch.zeros(4, 4)[:, ::2]) is None
    True
"""

from __future__ import annotations

import torch

__all__ = ["memory_order_view"]


def memory_order_view(param: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of every element of ``param`` in memory order (no copy), or None where it has gaps or overlaps.

    Args:
        param: a strided tensor (a parameter, or any view).

    Returns:
        ``param``'s elements as one 1-D tensor over the same memory, or None when they do not
        fill one block of memory.

    Example::

        >>> x = torch.arange(6.0).view(2, 3).t()
        >>> memory_order_view(x)
        tensor([0., 1., 2., 3., 4., 5.])
    """
    data = param.detach()
    if data.is_contiguous():
        return data.view(-1)
    order = sorted(range(data.dim()), key=lambda d: data.stride(d), reverse=True)
    if not data.permute(order).is_contiguous():
        return None
    return data.as_strided((data.numel(),), (1,))
