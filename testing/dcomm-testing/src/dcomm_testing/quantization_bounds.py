"""Float64 references for block-quantization tests: per-value block scales and rounding bounds.

Example::

    >>> from dcomm_testing import quantization_half_step
    >>> quantization_half_step(torch.tensor([1.0, -0.5]), "int8", 2)  # doctest: +SKIP
    tensor([0.0039, 0.0039], dtype=torch.float64)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dcomm.core.quantization import max_code


def block_scales(values: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """Per value (flattened): its block's absolute maximum over ``fmt``'s largest code, in float64."""
    flat = values.double().reshape(-1)
    n = flat.numel()
    padded = F.pad(flat, (0, -n % block_size)).view(-1, block_size)
    return (padded.abs().amax(1) / max_code(fmt)).repeat_interleave(block_size)[:n]


def quantization_half_step(values: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """Per value (flattened): the round-to-nearest error bound of block-quantizing ``values``.

    Half a code step for int8/int4; for fp8 (e4m3, 3 mantissa bits) half an ulp, 2^-4 of the
    value, or 2^-10 of the block scale for subnormals.
    """
    scale = block_scales(values, fmt, block_size)
    if fmt == "fp8":
        return torch.maximum(values.double().reshape(-1).abs() * 2.0**-4, scale * 2.0**-10)
    return scale / 2
