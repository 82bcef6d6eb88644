"""Fused CUDA kernels (Triton) for int8/fp8 row quantization: one launch each way.

The torch form of :func:`dcomm.core.quantization.quantize_rows` takes about ten kernels (|x|,
block max, divisions, rounding, clamping, the casts and the packing copies) and as many
launches of host time; a gradient hook pays that per bucket on the autograd thread. Here one
Triton program quantizes a group of blocks and writes codes and scales straight into the packed
rows, and one decodes them. The arithmetic is the torch form's on CUDA, operation for operation
(the scale times the reciprocal of the largest code, as torch divides by a scalar; IEEE division
by the scale; round half to even; the same clamps and casts); a test compares them on CUDA.

:func:`usable` says when they apply: CUDA tensors, int8 or fp8, Triton importable.

Example::

    >>> if usable(rows, "int8", 256):  # doctest: +SKIP
    ...     quantize_rows_into(rows, "int8", 256, packed, 127.0)
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

__all__ = ["average_rows_into", "dequantize_rows_into", "quantize_rows_into", "quantize_with_error_into", "usable"]

_GROUP = 8  # blocks per program
_FORMATS = ("int8", "fp8")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


try:
    import triton  # type: ignore[import-not-found]
    import triton.language as tl  # type: ignore[import-not-found]
    from triton.language.extra import libdevice  # type: ignore[import-not-found]
except ImportError:  # CPU-only installs: the torch form is used
    triton = None

if triton is not None:

    @triton.jit
    def _blocks_of_program(n_blocks, blocks_per_row, BLOCK: tl.constexpr, GROUP: tl.constexpr):  # type: ignore[no-untyped-def]
        """This program's GROUP blocks: which exist, their row, their index in it, their columns."""
        blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
        block = blocks % blocks_per_row
        return blocks < n_blocks, blocks // blocks_per_row, block, block[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]

    @triton.jit
    def _encode(source, LIMIT: tl.constexpr, INV_LIMIT: tl.constexpr, FP8: tl.constexpr):  # type: ignore[no-untyped-def]
        """Each row's scale (NaN if the row holds one) and its codes, as int8 or fp8 values."""
        scale = tl.max(tl.abs(source), axis=1) * INV_LIMIT  # torch's CUDA division by a scalar
        # A NaN anywhere in the block gives a NaN scale, as torch's amax does (+0.0 otherwise).
        scale = scale + tl.sum(tl.where(source != source, source, tl.zeros_like(source)), axis=1)
        safe = tl.where(scale > 0, scale, tl.full(scale.shape, 1.0, tl.float32))
        y = tl.math.div_rn(source, safe[:, None])
        if FP8:
            small = tl.minimum(tl.maximum(y, -LIMIT), LIMIT).to(tl.float8e4nv)
        else:
            small = tl.minimum(tl.maximum(libdevice.rint(y), -LIMIT), LIMIT).to(tl.int8)
        return scale, small

    @triton.jit
    def _code_values(raw, FP8: tl.constexpr):  # type: ignore[no-untyped-def]
        """The float32 values of uint8 code bytes (int8 or fp8 e4m3), before their scale."""
        if FP8:
            values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            values = raw.to(tl.int8, bitcast=True).to(tl.float32)
        return values

    @triton.jit
    def _finite_or(updated, previous):  # type: ignore[no-untyped-def]
        """``updated`` where finite, else ``previous``: an overflowed block keeps its carried error."""
        return tl.where(tl.abs(updated) <= 3.4028234663852886e38, updated, previous)  # False for NaN, inf

    @triton.jit
    def _quantize(  # type: ignore[no-untyped-def]
        x_ptr, codes_ptr, scales_ptr, n_blocks, blocks_per_row, cols, row_bytes, row_words,
        LIMIT: tl.constexpr, INV_LIMIT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        valid, row, block, column = _blocks_of_program(n_blocks, blocks_per_row, BLOCK, GROUP)
        x = tl.load(x_ptr + row[:, None].to(tl.int64) * cols + column, mask=valid[:, None], other=0.0)
        scale, small = _encode(x.to(tl.float32), LIMIT, INV_LIMIT, FP8)
        codes = small.to(tl.uint8, bitcast=True)
        tl.store(codes_ptr + row[:, None].to(tl.int64) * row_bytes + column, codes, mask=valid[:, None])
        tl.store(scales_ptr + row.to(tl.int64) * row_words + cols // 4 + block, scale, mask=valid)

    @triton.jit
    def _quantize_with_error(  # type: ignore[no-untyped-def]
        x_ptr, error_ptr, codes_ptr, scales_ptr, numel, n_blocks, row_bytes, row_words,
        LIMIT: tl.constexpr, INV_LIMIT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        # One block per row. source = error + x over the first numel values (the error alone
        # past them); codes and scales of source; error = source - decoded codes there.
        valid, row, block, column = _blocks_of_program(n_blocks, 1, BLOCK, GROUP)
        flat = row[:, None].to(tl.int64) * BLOCK + column
        error = tl.load(error_ptr + flat, mask=valid[:, None], other=0.0)
        inside = valid[:, None] & (flat < numel)
        x = tl.load(x_ptr + flat, mask=inside, other=0.0).to(tl.float32)
        source = tl.where(inside, error + x, error)
        scale, small = _encode(source, LIMIT, INV_LIMIT, FP8)
        codes = small.to(tl.uint8, bitcast=True)
        decoded = small.to(tl.float32)
        tl.store(codes_ptr + row[:, None].to(tl.int64) * row_bytes + column, codes, mask=valid[:, None])
        tl.store(scales_ptr + row.to(tl.int64) * row_words + BLOCK // 4 + block, scale, mask=valid)
        # mul_rn: the product rounds on its own, as the separate decoding does (no fused multiply-add).
        product = libdevice.mul_rn(decoded, tl.broadcast_to(scale[:, None], decoded.shape))
        tl.store(error_ptr + flat, _finite_or(source - product, error), mask=inside)

    @triton.jit
    def _average_rows(  # type: ignore[no-untyped-def]
        received_ptr, received_words_ptr, error_ptr, row_ptr, row_words_ptr, n_rows, world, row_bytes, row_words,
        INV_WORLD: tl.constexpr, LIMIT: tl.constexpr, INV_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
        GROUP: tl.constexpr, FP8: tl.constexpr, ERROR: tl.constexpr,
    ):  # fmt: skip
        # One block per row. Row r of the result encodes (sum over w of decoded row w * n_rows + r)
        # / world (+ error); error keeps what that encoding lost.
        valid, row, _, column = _blocks_of_program(n_rows, 1, BLOCK, GROUP)
        total = tl.zeros((GROUP, BLOCK), tl.float32)
        for w in range(0, world):
            source = (w * n_rows + row).to(tl.int64)
            raw = tl.load(received_ptr + source[:, None] * row_bytes + column, mask=valid[:, None], other=0)
            values = _code_values(raw, FP8)
            scale = tl.load(received_words_ptr + source * row_words + BLOCK // 4, mask=valid, other=1.0)
            # mul_rn: each decoded value rounds on its own before the sum (no fused multiply-add).
            total += libdevice.mul_rn(values, tl.broadcast_to(scale[:, None], values.shape))
        average = libdevice.mul_rn(total, tl.full(total.shape, INV_WORLD, tl.float32))
        flat = row[:, None].to(tl.int64) * BLOCK + column
        carried = tl.zeros((GROUP, BLOCK), tl.float32)
        if ERROR:
            carried = tl.load(error_ptr + flat, mask=valid[:, None], other=0.0)
            average += carried
        scale, small = _encode(average, LIMIT, INV_LIMIT, FP8)
        tl.store(
            row_ptr + row[:, None].to(tl.int64) * row_bytes + column,
            small.to(tl.uint8, bitcast=True),
            mask=valid[:, None],
        )
        tl.store(row_words_ptr + row.to(tl.int64) * row_words + BLOCK // 4, scale, mask=valid)
        if ERROR:
            decoded = libdevice.mul_rn(small.to(tl.float32), tl.broadcast_to(scale[:, None], average.shape))
            tl.store(error_ptr + flat, _finite_or(average - decoded, carried), mask=valid[:, None])

    @triton.jit
    def _dequantize(  # type: ignore[no-untyped-def]
        codes_ptr, scales_ptr, out_ptr, n_blocks, blocks_per_row, cols, row_bytes, row_words,
        BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        valid, row, block, column = _blocks_of_program(n_blocks, blocks_per_row, BLOCK, GROUP)
        raw = tl.load(codes_ptr + row[:, None].to(tl.int64) * row_bytes + column, mask=valid[:, None], other=0)
        values = _code_values(raw, FP8)
        scale = tl.load(scales_ptr + row.to(tl.int64) * row_words + cols // 4 + block, mask=valid, other=1.0)
        out = (values * scale[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row[:, None].to(tl.int64) * cols + column, out, mask=valid[:, None])


def usable(tensor: torch.Tensor, fmt: str, block_size: int) -> bool:
    """Whether the fused kernels take ``tensor`` (CUDA, int8/fp8, a float dtype, Triton present).

    ``block_size`` must be a power of two of at least 4 (scales then start on a 4-byte boundary).
    """
    power_of_two = block_size >= 4 and block_size & (block_size - 1) == 0
    usable_here = tensor.is_cuda and fmt in _FORMATS and tensor.dtype in _FLOATS and power_of_two
    return usable_here and triton is not None


def _launch_device(tensor: torch.Tensor) -> Any:
    """A context in which a Triton launch runs on ``tensor``'s GPU (Triton uses the current device)."""
    if tensor.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)


@functools.cache
def _float32_reciprocal(n: int) -> float:
    """``1 / n`` rounded to float32, as torch's CUDA division by a scalar multiplies by it."""
    return (torch.tensor(1.0, dtype=torch.float32) / n).item()


def _grid(n_blocks: int) -> tuple[int]:
    return (-(-n_blocks // _GROUP),)


def quantize_rows_into(rows: torch.Tensor, fmt: str, block_size: int, out: torch.Tensor, limit: float) -> torch.Tensor:
    """Quantize contiguous ``[n, cols]`` rows into ``out`` (``[n, payload]`` uint8) in one launch."""
    n, cols = rows.shape
    rows = rows.contiguous()
    n_blocks = n * (cols // block_size)
    row_bytes = out.stride(0)
    with _launch_device(out):
        _quantize[_grid(n_blocks)](
            rows, out, out.view(torch.float32), n_blocks, cols // block_size, cols, row_bytes, row_bytes // 4,
            LIMIT=limit, INV_LIMIT=1.0 / limit, BLOCK=block_size, GROUP=_GROUP, FP8=fmt == "fp8",
        )  # fmt: skip
    return out


def quantize_with_error_into(
    values: torch.Tensor, error: torch.Tensor, fmt: str, block_size: int, out: torch.Tensor, limit: float
) -> None:
    """Error feedback and quantization in one launch: the fused form of three steps.

    ``error`` (float32, one row of ``block_size`` per row of ``out``) gets the flat ``values``
    added over their length; that sum is quantized into ``out`` (``[rows, payload]`` uint8,
    one block per row); then ``error`` keeps, over the same length, what the codes lost, or its
    previous value where that is not finite. The same arithmetic, bit for bit, as
    ``error[:n].add_(values)``, :func:`quantize_rows_into`, ``error[:n].sub_(decoded)`` and
    that last rule.
    """
    n_blocks = out.shape[0]
    row_bytes = out.stride(0)
    with _launch_device(out):
        _quantize_with_error[_grid(n_blocks)](
            values, error, out, out.view(torch.float32), values.numel(), n_blocks, row_bytes, row_bytes // 4,
            LIMIT=limit, INV_LIMIT=1.0 / limit, BLOCK=block_size, GROUP=_GROUP, FP8=fmt == "fp8",
        )  # fmt: skip


def average_rows_into(
    received: torch.Tensor,
    world: int,
    fmt: str,
    block_size: int,
    out: torch.Tensor,
    error: torch.Tensor | None,
    limit: float,
) -> None:
    """The middle step of a two-shot average in one launch: decode, sum, average, re-encode.

    ``received`` holds ``world`` chunks of ``n`` rows (``[world * n, payload]`` uint8, one block
    per row); row ``r`` of ``out`` (``[n, payload]``) encodes the mean of the ``world`` decoded
    rows ``w * n + r``, plus ``error`` (float32, ``n * block_size``) when given, which then keeps
    what the encoding lost (its previous value where that is not finite). The same arithmetic,
    bit for bit, as decoding, summing the chunks in order, multiplying by the float32 reciprocal
    of ``world`` (torch's division by a scalar), adding the error, :func:`quantize_rows_into`
    and subtracting the decoded codes.
    """
    n_rows = out.shape[0]
    row_bytes = out.stride(0)
    with _launch_device(out):
        _average_rows[_grid(n_rows)](
            received, received.view(torch.float32), out if error is None else error, out, out.view(torch.float32),
            n_rows, world, row_bytes, row_bytes // 4,
            INV_WORLD=_float32_reciprocal(world), LIMIT=limit, INV_LIMIT=1.0 / limit, BLOCK=block_size, GROUP=_GROUP,
            FP8=fmt == "fp8", ERROR=error is not None,
        )  # fmt: skip


def dequantize_rows_into(packed: torch.Tensor, fmt: str, cols: int, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """Decode ``[n, payload]`` packed rows into contiguous ``[n, cols]`` ``out`` in one launch."""
    n = packed.shape[0]
    n_blocks = n * (cols // block_size)
    row_bytes = packed.stride(0)
    with _launch_device(out):
        _dequantize[_grid(n_blocks)](
            packed, packed.view(torch.float32), out, n_blocks, cols // block_size, cols, row_bytes, row_bytes // 4,
            BLOCK=block_size, GROUP=_GROUP, FP8=fmt == "fp8",
        )  # fmt: skip
    return out
