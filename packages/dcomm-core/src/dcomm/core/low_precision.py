"""Cast gradients to fp16/bf16 for communication and back, safely while a collective is in flight.

The cast and the division by the pre-divide factor are one kernel (``torch.div(..., out=...)``)
from fp32/fp64, the quotient computed in that precision; from fp16/bf16 they are torch's two steps
(:func:`divide_into`). The cast back and the post-division are one kernel. On CUDA a
low-precision buffer that a collective may still read is tied to the current stream, so the
caching allocator cannot hand its memory to another tensor before that stream's work is done. On
CPU this costs nothing.

Example::

    >>> low = cast_for_communication(grad, torch.bfloat16, divide_by=2.0)  # doctest: +SKIP
    >>> dist.all_reduce(low)  # doctest: +SKIP
    >>> copy_back(grad, low, divide_by=2.0)  # doctest: +SKIP
"""

from __future__ import annotations

import torch

__all__ = ["LOW_PRECISION_DTYPES", "cast_for_communication", "copy_back", "divide_into", "keep_until_stream_done"]

LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def cast_for_communication(tensor: torch.Tensor, dtype: torch.dtype, divide_by: float = 1.0) -> torch.Tensor:
    """Return a new ``dtype`` tensor holding ``tensor / divide_by`` (one fused kernel).

    Args:
        tensor: the values (a gradient bucket, a shard).
        dtype: the low-precision dtype to send (fp16, bf16).
        divide_by: the pre-division (1: none).

    Returns:
        A new tensor of ``dtype``.

    Example::

        >>> cast_for_communication(torch.ones(2), torch.float16, 2.0)
        tensor([0.5000, 0.5000], dtype=torch.float16)
    """
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype!r}; use the fp16 or bf16 hook")
    return divide_into(torch.empty_like(tensor, dtype=dtype), tensor, divide_by)


_WIDE_DTYPES = (torch.float32, torch.float64)


def divide_into(out: torch.Tensor, tensor: torch.Tensor, divide_by: float) -> torch.Tensor:
    """``out = tensor / divide_by`` in ``out``'s dtype; returns ``out``.

    From fp32/fp64 one kernel: the quotient is computed in the input's dtype, then cast into
    ``out``. From fp16/bf16 torch's order, a cast and then the division in ``out``'s dtype:
    one kernel would compute the quotient in the input's dtype, so a bf16 gradient sent in fp16
    would be rounded to bf16's 8 bits before it reached fp16's 11.

    Args:
        out: where to write, in its own dtype.
        tensor: the values.
        divide_by: the divisor (1: a plain cast-copy).

    Returns:
        ``out``.

    Example::

        >>> divide_into(torch.empty(1, dtype=torch.float16), torch.tensor([1.0], dtype=torch.bfloat16), 3.0)
        tensor([0.3333], dtype=torch.float16)
    """
    if divide_by == 1.0:
        return out.copy_(tensor)
    if tensor.dtype in _WIDE_DTYPES:
        return torch.div(tensor, divide_by, out=out)
    return out.copy_(tensor).div_(divide_by)


def copy_back(dst: torch.Tensor, src: torch.Tensor, divide_by: float = 1.0) -> torch.Tensor:
    """Write ``src / divide_by`` into ``dst`` in ``dst``'s own dtype (one fused kernel).

    Args:
        dst: the tensor to overwrite (a bucket or a gradient, in its own dtype).
        src: the received values (fp16 or bf16).
        divide_by: the post-division (1: none).

    Returns:
        ``dst``.

    Example::

        >>> dst = torch.zeros(2)
        >>> copy_back(dst, torch.ones(2, dtype=torch.bfloat16), 2.0)
        tensor([0.5000, 0.5000])
    """
    src = src.view_as(dst)
    if divide_by == 1.0:
        return dst.copy_(src)
    return torch.div(src, divide_by, out=dst)


def keep_until_stream_done(tensor: torch.Tensor) -> None:
    """Keep ``tensor``'s memory from reuse until the current stream's queued work is done.

    A no-op for CPU tensors.

    Args:
        tensor: a buffer a collective or kernel on the current stream may still read.

    Example::

        >>> keep_until_stream_done(low_precision_grad)  # doctest: +SKIP
    """
    if tensor.device.type == "cpu":
        return
    module = torch.get_device_module(tensor.device)
    tensor.record_stream(module.current_stream(tensor.device))
