"""CUDA memory that separate parameters share: which allocation an address lies in, and one tensor over a span.

PyTorch's caching allocator carves many tensors out of one device allocation (a segment), back
to back when their sizes are multiples of its 512-byte rounding, as most parameters' are. Such
parameters can be averaged as one span, one allreduce instead of one each, though each has its
own storage. :func:`allocation_bases` asks the CUDA driver (``cuMemGetAddressRange``, through
ctypes) where each tensor's allocation begins, so that a span never crosses from one allocation
into another; where the driver cannot be asked, the answers are None and nothing is joined.

Example::

    >>> allocation_bases([torch.zeros(3)])  # CPU memory has no CUDA allocation
    [None]
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from dcomm.core import storage_at

__all__ = ["allocation_bases", "span_over"]


@functools.cache
def _address_range() -> Callable[..., int] | None:
    """The driver's ``cuMemGetAddressRange_v2``, or None where there is no CUDA driver to load."""
    try:
        function = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    function.restype = ctypes.c_int
    return function


def allocation_bases(tensors: list[torch.Tensor]) -> list[int | None]:
    """The address of the device allocation each tensor's data lies in (None where unknown: CPU, no driver).

    The tensors must share one device. Two tensors with the same base lie in one ``cudaMalloc``.
    """
    address_range = _address_range() if tensors and tensors[0].device.type == "cuda" else None
    if address_range is None:  # no CUDA tensors (the driver is not even loaded), or no driver
        return [None] * len(tensors)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    bases: list[int | None] = []
    with torch.cuda.device(tensors[0].device):  # the driver answers for the current context
        for tensor in tensors:
            found = address_range(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()) == 0
            bases.append(base.value if found else None)
    return bases


def span_over(first: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A 1-D tensor of ``first``'s dtype over the ``nbytes`` bytes that start at ``first``'s data.

    For CUDA tensors that lie back to back in one allocation (see :func:`allocation_bases`). It
    owns no memory (a storage with no deleter: nothing for NCCL's watchdog thread to release
    later): use it only while the tensors it covers live.
    """
    storage = storage_at(first.data_ptr(), first.device, nbytes)
    return first.new_empty(0).set_(storage, 0, (nbytes // first.element_size(),), (1,))
