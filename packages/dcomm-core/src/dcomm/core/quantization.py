"""Block-wise quantization of floating tensors to int8, fp8 (e4m3) or int4 codes for the wire.

A tensor is flattened and cut into blocks of ``block_size`` values (the last block padded with
zeros). Each block keeps one float32 scale, its absolute maximum divided by the format's largest
code, so the block's largest value is represented exactly up to rounding and an all-zero block
stays zero. Codes travel as bytes (``uint8``) on every backend; int4 packs two codes per byte
(the even element in the low nibble). Everything runs as tensor kernels: no host
synchronisation on CUDA.

Example::

    >>> x = torch.randn(1000)
    >>> payload, scales = quantize(x, "int8")
    >>> payload.dtype, payload.numel(), scales.numel()
    (torch.uint8, 1024, 4)
    >>> y = dequantize(payload, scales, "int8", x.numel())
    >>> bool(((y - x).abs() <= scales.repeat_interleave(256)[:1000] / 2 + 1e-6).all())
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dcomm.core.log import warn_once
from dcomm.core.validation import even_int

__all__ = [
    "QUANTIZED_FORMATS",
    "code_bytes",
    "dequantize",
    "dequantize_rows",
    "fused_average_rows",
    "fused_quantize_with_error",
    "max_code",
    "num_blocks",
    "payload_bytes",
    "quantize",
    "quantize_rows",
]

QUANTIZED_FORMATS = ("int8", "fp8", "int4")

# The largest code magnitude of each format: the value a block's absolute maximum maps to.
_MAX_CODE = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
# float32 mantissa bits that e4m3 drops (23 - 3): stochastic fp8 rounding randomises these.
_FP8_DROPPED_BITS = 20
_FP8_MIN_NORMAL = 2.0**-6
_FP8_SUBNORMAL_STEPS = 2.0**9  # codes per unit below the smallest normal


def _check_format(fmt: str, block_size: int) -> None:
    if fmt not in QUANTIZED_FORMATS:
        raise ValueError(f"fmt: expected one of {QUANTIZED_FORMATS}, got {fmt!r}")
    even_int("block_size", block_size, 2, "the default is 256")


def max_code(fmt: str) -> float:
    """The largest code magnitude of ``fmt`` (127 for int8, 448 for fp8 e4m3, 7 for int4).

    Args:
        fmt: ``"int8"``, ``"fp8"`` or ``"int4"``.

    Returns:
        The largest code magnitude, as a float.

    Raises:
        ValueError: an unknown ``fmt`` or a ``block_size`` that is not an even int >= 2.

    Example::

        >>> max_code("fp8")
        448.0
    """
    _check_format(fmt, 256)
    return _MAX_CODE[fmt]


def num_blocks(numel: int, block_size: int = 256) -> int:
    """Number of blocks holding ``numel`` values (the last one padded).

    Args:
        numel: the number of values.
        block_size: values per block.

    Returns:
        ``ceil(numel / block_size)``.

    Example::

        >>> num_blocks(1000)
        4
    """
    return -(-numel // block_size)


def code_bytes(numel: int, fmt: str, block_size: int = 256) -> int:
    """Bytes of the packed codes (no scales) for ``numel`` values, padded to whole blocks.

    Args:
        numel: the number of values.
        fmt: ``"int8"``, ``"fp8"`` (e4m3) or ``"int4"`` (two codes per byte).
        block_size: values per block (one scale each); an even int, 256 by default.

    Returns:
        The bytes of the codes.

    Raises:
        ValueError: an unknown ``fmt`` or a ``block_size`` that is not an even int >= 2.

    Example::

        >>> code_bytes(1000, "int4")
        512
    """
    _check_format(fmt, block_size)
    padded = num_blocks(numel, block_size) * block_size
    return padded // 2 if fmt == "int4" else padded


def payload_bytes(numel: int, fmt: str, block_size: int = 256) -> int:
    """Bytes on the wire for ``numel`` quantized values: the codes plus one float32 scale per block.

    Args:
        numel: the number of values.
        fmt: ``"int8"``, ``"fp8"`` (e4m3) or ``"int4"`` (two codes per byte).
        block_size: values per block (one scale each); an even int, 256 by default.

    Returns:
        The bytes of the codes and the scales.

    Raises:
        ValueError: an unknown ``fmt`` or a ``block_size`` that is not an even int >= 2.

    Example::

        >>> payload_bytes(1024, "int8")  # 1024 codes + 4 scales
        1040
    """
    return code_bytes(numel, fmt, block_size) + 4 * num_blocks(numel, block_size)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` as float32 ``[n_blocks, block_size]``, zero-padded (a copy, never a view of ``x``)."""
    flat = x.reshape(-1)
    n_blocks = num_blocks(flat.numel(), block_size)
    blocks = torch.zeros(n_blocks * block_size, dtype=torch.float32, device=x.device)
    blocks[: flat.numel()].copy_(flat)
    return blocks.view(n_blocks, block_size)


def _stochastic_fp8(scaled: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Round float32 values to e4m3 values stochastically (unbiased).

    Normal values: add uniform noise below e4m3's 3 mantissa bits, then truncate them. Subnormal
    values (below 2^-6, a fixed step of 2^-9): add uniform noise in code steps, then floor.
    """
    bits = scaled.view(torch.int32)
    noise = torch.randint(
        0, 1 << _FP8_DROPPED_BITS, bits.shape, dtype=torch.int32, device=bits.device, generator=generator
    )
    normal = ((bits + noise) & ~((1 << _FP8_DROPPED_BITS) - 1)).view(torch.float32)
    steps = noise.to(torch.float32).div_(1 << _FP8_DROPPED_BITS)
    subnormal = (scaled * _FP8_SUBNORMAL_STEPS).add_(steps).floor_().div_(_FP8_SUBNORMAL_STEPS)
    return torch.where(scaled.abs() < _FP8_MIN_NORMAL, subnormal, normal)


def _float32_view(raw: torch.Tensor) -> torch.Tensor | None:
    """The ``uint8`` ``raw`` read as float32 in place, or None where its offset or strides forbid it."""
    try:
        return raw.view(torch.float32)
    except RuntimeError:  # an offset or row stride that is not a multiple of 4 bytes
        return None


def _encode(
    blocks: torch.Tensor,
    fmt: str,
    scales: torch.Tensor,
    codes: torch.Tensor,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> None:
    """Quantize float32 ``blocks`` ``[..., block_size]`` (left unchanged) into ``scales`` and ``codes``.

    ``scales`` (float32 ``[...]``) and ``codes`` (``uint8`` ``[..., code bytes per block]``) may
    be strided views into a packed buffer: every kernel writes its result straight into them.
    """
    limit = _MAX_CODE[fmt]
    # |x| max of each block in one kernel (no |x| temporary); exact, and NaN stays NaN.
    torch.linalg.vector_norm(blocks, float("inf"), dim=-1, out=scales)
    scales.div_(limit)
    safe = torch.where(scales > 0, scales, 1.0)
    scaled = torch.div(blocks, safe.unsqueeze(-1))
    if fmt == "fp8":
        if stochastic:
            scaled = _stochastic_fp8(scaled, generator)
        codes.view(torch.float8_e4m3fn).copy_(scaled.clamp_(-limit, limit))
        return
    if stochastic:
        noise = torch.rand(scaled.shape, dtype=torch.float32, device=scaled.device, generator=generator)
        scaled = scaled.add_(noise).floor_()
    else:
        scaled = scaled.round_()
    # A subnormal block maximum loses precision in ``/ limit``, so a quotient can pass the limit.
    scaled = scaled.clamp_(-limit, limit)
    if fmt == "int8":
        codes.view(torch.int8).copy_(scaled)
        return
    nibbles = (scaled.to(torch.int8) + 8).to(torch.uint8).unflatten(-1, (-1, 2))
    torch.bitwise_or(nibbles[..., 0], nibbles[..., 1] << 4, out=codes)


def _decode(codes: torch.Tensor, scales: torch.Tensor, fmt: str, out: torch.Tensor) -> None:
    """Write the values of ``codes`` ``[..., code bytes per block]`` times ``scales`` ``[...]`` into ``out``.

    ``out`` is ``[..., block_size]`` of any floating dtype; the product is taken in float32 and
    rounded once into ``out``'s dtype. Inputs and ``out`` may be strided views.
    """
    scale = scales.unsqueeze(-1)
    if fmt == "int8":
        torch.mul(codes.view(torch.int8), scale, out=out)  # int8 x float32 computes in float32
        return
    if fmt == "fp8":
        values = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        low = (codes & 0x0F).to(torch.float32)
        high = (codes >> 4).to(torch.float32)
        values = torch.stack((low, high), dim=-1).flatten(-2).sub_(8.0)
    torch.mul(values, scale, out=out)


def quantize(
    x: torch.Tensor,
    fmt: str,
    block_size: int = 256,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` block by block; return ``(payload, scales)``.

    ``payload`` is a 1-D ``uint8`` tensor of the packed codes for ``x`` flattened and padded to
    whole blocks (``code_bytes`` long); ``scales`` is float32 ``[n_blocks]``. Rounding is to the
    nearest code; ``stochastic=True`` rounds up or down with probability given by the distance
    (unbiased, drawing from ``generator``). Non-finite inputs give non-finite results.

    Args:
        x: a floating tensor (any shape; flattened).
        fmt: ``"int8"``, ``"fp8"`` (e4m3) or ``"int4"`` (two codes per byte).
        block_size: values per block (one scale each); an even int, 256 by default.
        stochastic: round up or down at random (unbiased) instead of to the nearest code.
        generator: the random generator of stochastic rounding.

    Returns:
        ``(payload, scales)``.

    Raises:
        TypeError: ``x`` is not floating.
        ValueError: an unknown ``fmt`` or a bad ``block_size``.

    Example::

        >>> payload, scales = quantize(torch.tensor([1.0, -0.5, 0.0, 0.25]), "int4", block_size=4)
        >>> payload.numel(), scales
        (2, tensor([0.1429]))
    """
    _check_format(fmt, block_size)
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating tensor, got dtype {x.dtype}; convert it with x.float()")
    blocks = _blocks(x, block_size)
    n_blocks = blocks.shape[0]
    scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    payload = torch.empty(code_bytes(x.numel(), fmt, block_size), dtype=torch.uint8, device=x.device)
    _encode(blocks, fmt, scales, payload.view(n_blocks, code_bytes(block_size, fmt, block_size)), stochastic, generator)
    return payload, scales


def dequantize(
    payload: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    numel: int,
    block_size: int = 256,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``quantize``'s ``(payload, scales)`` into ``numel`` float32 values.

    Returns a new 1-D float32 tensor, or, when ``out`` (``numel`` elements, any floating dtype)
    is given, writes the values into it and returns ``out``.

    Args:
        payload: the codes from :func:`quantize`.
        scales: the block scales from :func:`quantize`.
        fmt: ``"int8"``, ``"fp8"`` (e4m3) or ``"int4"`` (two codes per byte).
        block_size: values per block (one scale each); an even int, 256 by default.
        numel: how many values to decode (the padding is dropped).
        out: where to write them, or None for a new float32 tensor.

    Returns:
        The decoded values (``out`` when given).

    Raises:
        ValueError: sizes of ``payload``, ``scales`` or ``out`` that do not fit ``numel``, or a bad
            ``fmt`` or ``block_size``.

    Example::

        >>> payload, scales = quantize(torch.tensor([2.0, -1.0]), "int8", block_size=2)
        >>> dequantize(payload, scales, "int8", 2, block_size=2)  # -1 is 63.5 steps of 2/127: rounded
        tensor([ 2.0000, -1.0079])
    """
    _check_format(fmt, block_size)
    n_blocks = num_blocks(numel, block_size)
    expected = code_bytes(numel, fmt, block_size)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise ValueError(
            f"payload: expected {expected} uint8 codes for numel={numel}, fmt={fmt!r}, block_size={block_size}; "
            f"got {payload.numel()} of dtype {payload.dtype}"
        )
    if scales.numel() != n_blocks:
        raise ValueError(f"scales: expected {n_blocks} block scales for numel={numel}, got {scales.numel()}")
    if out is not None and out.numel() != numel:
        raise ValueError(f"out: expected {numel} elements, got {out.numel()}")
    codes = payload.reshape(n_blocks, code_bytes(block_size, fmt, block_size))
    scales = scales.to(torch.float32).reshape(n_blocks)
    if out is not None and numel == n_blocks * block_size and out.is_contiguous():
        _decode(codes, scales, fmt, out.view(n_blocks, block_size))
        return out
    values = torch.empty(n_blocks * block_size, dtype=torch.float32, device=payload.device)
    _decode(codes, scales, fmt, values.view(n_blocks, block_size))
    if out is None:
        return values[:numel]
    out.view(-1).copy_(values[:numel])
    return out


def _word_aligned_rows(packed: torch.Tensor) -> bool:
    """Whether the fused kernels can read ``packed``'s scales as float32 words (rows 4-byte aligned)."""
    return packed.stride(1) == 1 and packed.stride(0) % 4 == 0 and packed.storage_offset() % 4 == 0


_FUSED_FAILURE: list[str] = []
"""The first failure of a fused kernel in this process (a Triton that cannot build or launch it):
from then on every call takes the torch form, which gives the same bits."""


def _fused_kernels(tensor: torch.Tensor, fmt: str, block_size: int) -> Any:
    """The fused Triton kernels when they take ``tensor`` (CUDA, int8/fp8), else None."""
    if not tensor.is_cuda or _FUSED_FAILURE:
        return None
    import dcomm.core._quantization_kernels as kernels  # Triton is imported on first use only

    return kernels if kernels.usable(tensor, fmt, block_size) else None


def _launched(launch: Callable[[], object]) -> bool:
    """Run one fused-kernel launch; False, with one warning, where Triton fails to build or launch it."""
    try:
        launch()
    except Exception as exc:  # any build or launch failure: the torch form computes the same bits
        _FUSED_FAILURE.append(f"{type(exc).__name__}: {exc}")
        warn_once(
            ("dcomm.core.quantization", "fused kernels"),
            f"the fused int8/fp8 Triton kernels failed ({_FUSED_FAILURE[0][:300]}); dcomm uses the torch "
            "form from now on, with the same results and more kernels: install a triton that matches "
            "your torch, or report this message",
        )
        return False
    return True


def fused_quantize_with_error(
    values: torch.Tensor, error: torch.Tensor, fmt: str, block_size: int, out: torch.Tensor
) -> bool:
    """Error feedback and quantization in one CUDA launch, where the fused kernels apply.

    ``error[:n] += values``, ``out`` = :func:`quantize_rows` of ``error`` viewed as one block per
    row, then ``error[:n] -=`` what the codes decode to (``n = values.numel()``): bit for bit the
    three steps, one pass over the memory. Returns False (nothing done) where the kernels do not
    apply: off CUDA, without Triton, for formats other than int8 and fp8, or for other layouts.

    Args:
        values: the new values (``n`` of them).
        error: the float32 error memory (at least ``n`` values), updated in place.
        fmt: ``"int8"`` or ``"fp8"``.
        block_size: values per block (one block per row).
        out: the uint8 rows to write.

    Returns:
        Whether the fused kernel ran.

    Example::

        >>> fused_quantize_with_error(grad, error, "int8", 256, packed)  # doctest: +SKIP
        True
    """
    fused = _fused_kernels(values, fmt, block_size)
    if (
        fused is None
        or not values.is_contiguous()
        or error.dtype != torch.float32
        or not error.is_contiguous()
        or error.numel() != out.shape[0] * block_size
        or out.shape[1] != payload_bytes(block_size, fmt, block_size)
        or not _word_aligned_rows(out)
    ):
        return False
    return _launched(
        lambda: fused.quantize_with_error_into(values.view(-1), error, fmt, block_size, out, _MAX_CODE[fmt])
    )


def fused_average_rows(
    received: torch.Tensor, world: int, fmt: str, block_size: int, out: torch.Tensor, error: torch.Tensor | None
) -> bool:
    """A two-shot average's middle step in one CUDA launch, where the fused kernels apply.

    ``received`` is ``world`` chunks of :func:`quantize_rows` rows (one block per row, ``n`` rows
    each, stacked); ``out`` (``n`` rows) gets the encoded mean of the chunks, plus ``error``
    (float32, ``n * block_size`` values, or None), which then keeps what that encoding lost. Bit
    for bit the torch steps (decode, sum in rank order, divide by ``world``, add the error,
    encode, subtract the decoded codes) up to 4 ranks; beyond, the sum's order may differ from
    torch's by rounding. Returns False (nothing done) off CUDA, without Triton, for formats other
    than int8 and fp8, or for other layouts.

    Args:
        received: ``world`` stacked chunks of rows.
        world: the number of chunks (ranks).
        fmt: ``"int8"`` or ``"fp8"``.
        block_size: values per block (one block per row).
        out: the uint8 rows of the encoded mean.
        error: the float32 error memory of this rank's chunk, or None.

    Returns:
        Whether the fused kernel ran.

    Example::

        >>> fused_average_rows(received, 4, "int8", 256, row, shard_error)  # doctest: +SKIP
        True
    """
    if fmt not in ("int8", "fp8"):
        return False
    payload = payload_bytes(block_size, fmt, block_size)
    n = out.shape[0]
    if (
        not received.is_cuda
        or received.shape != (world * n, payload)
        or out.shape[1] != payload
        or not _word_aligned_rows(received)
        or not _word_aligned_rows(out)
    ):
        return False
    if error is not None and (
        error.dtype != torch.float32 or not error.is_contiguous() or error.numel() != n * block_size
    ):
        return False
    fused = _fused_kernels(out.view(torch.float32), fmt, block_size)  # a float view: the kernels' dtype check
    if fused is None:
        return False
    return _launched(lambda: fused.average_rows_into(received, world, fmt, block_size, out, error, _MAX_CODE[fmt]))


def _check_rows(cols: int, block_size: int) -> None:
    if cols % block_size:
        raise ValueError(
            f"cols: a row of {cols} values is not a whole number of blocks of {block_size}; pad rows to a "
            f"multiple of block_size"
        )


def _split_rows(packed: torch.Tensor, cols: int, fmt: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of packed rows ``[n, payload_bytes(cols)]``: codes ``[n, blocks, bytes per block]`` and
    the scales' bytes ``[n, 4 * blocks]``."""
    n_codes = code_bytes(cols, fmt, block_size)
    codes = packed[:, :n_codes].unflatten(1, (cols // block_size, -1))
    return codes, packed[:, n_codes:]


def quantize_rows(rows: torch.Tensor, fmt: str, block_size: int = 256, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize each row of a 2-D ``[n, cols]`` tensor into one self-contained ``uint8`` row.

    ``cols`` must be a multiple of ``block_size``. Row ``i`` of the result holds the codes of row
    ``i`` followed by its block scales (float32 bytes): ``payload_bytes(cols)`` bytes, ready to
    send to one peer (an all-to-all) or to gather. ``rows`` is left unchanged; with ``out`` (a
    ``uint8`` ``[n, payload_bytes(cols)]`` tensor, e.g. rows of a larger send buffer) the codes
    and scales are written straight into it.

    Args:
        rows: a floating ``[n, cols]`` tensor.
        fmt: ``"int8"``, ``"fp8"`` (e4m3) or ``"int4"`` (two codes per byte).
        block_size: values per block (one scale each); an even int, 256 by default.
        out: the uint8 ``[n, payload_bytes(cols)]`` rows to write, or None for new ones.

    Returns:
        The encoded rows (``out`` when given).

    Raises:
        TypeError: ``rows`` is not floating.
        ValueError: ``cols`` not a multiple of ``block_size``, a bad ``out``, ``fmt`` or ``block_size``.

    Example::

        >>> quantize_rows(torch.randn(4, 512), "int8").shape  # 512 codes + 2 scales of 4 bytes
        torch.Size([4, 520])
    """
    _check_format(fmt, block_size)
    if not rows.is_floating_point():
        raise TypeError(f"rows: expected a floating tensor, got dtype {rows.dtype}; convert it with rows.float()")
    n, cols = rows.shape
    _check_rows(cols, block_size)
    shape = (n, payload_bytes(cols, fmt, block_size))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=rows.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != shape:
        raise ValueError(f"out: expected uint8 of shape {shape}, got {tuple(out.shape)} of {out.dtype}")
    fused = _fused_kernels(rows, fmt, block_size)
    if (
        fused is not None
        and _word_aligned_rows(out)
        and _launched(lambda: fused.quantize_rows_into(rows, fmt, block_size, out, _MAX_CODE[fmt]))
    ):
        return out
    blocks = rows.to(torch.float32).unflatten(1, (cols // block_size, block_size))
    codes, scale_bytes = _split_rows(out, cols, fmt, block_size)
    scales = _float32_view(scale_bytes)
    if scales is not None:
        _encode(blocks, fmt, scales, codes)
        return out
    scales = torch.empty(n, cols // block_size, dtype=torch.float32, device=rows.device)
    _encode(blocks, fmt, scales, codes)
    scale_bytes.copy_(scales.view(torch.uint8))
    return out


def dequantize_rows(
    packed: torch.Tensor, fmt: str, cols: int, block_size: int = 256, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode :func:`quantize_rows`' ``[n, payload_bytes(cols)]`` rows into float32 ``[n, cols]``.

    With ``out`` (``[n, cols]`` of any floating dtype, e.g. a view of the destination) the values
    are written straight into it and ``out`` is returned.

    Args:
        packed: the rows from :func:`quantize_rows`.
        fmt: ``"int8"``, ``"fp8"`` (e4m3) or ``"int4"`` (two codes per byte).
        block_size: values per block (one scale each); an even int, 256 by default.
        cols: the values per row.
        out: where to write ``[n, cols]`` values, or None for a new float32 tensor.

    Returns:
        The decoded rows (``out`` when given).

    Raises:
        ValueError: ``cols`` not a multiple of ``block_size``, a bad ``fmt`` or ``block_size``.

    Example::

        >>> x = torch.randn(3, 256)
        >>> y = dequantize_rows(quantize_rows(x, "fp8"), "fp8", 256)
        >>> y.shape, bool(((y - x).abs() <= x.abs() / 16 + 1e-3).all())
        (torch.Size([3, 256]), True)
    """
    _check_format(fmt, block_size)
    _check_rows(cols, block_size)
    n = packed.shape[0]
    if packed.dtype != torch.uint8 or packed.shape != (n, payload_bytes(cols, fmt, block_size)):
        raise ValueError(
            f"packed: expected uint8 rows of {payload_bytes(cols, fmt, block_size)} bytes for cols={cols}, "
            f"fmt={fmt!r}; got {tuple(packed.shape)} of {packed.dtype}"
        )
    if out is None:
        out = torch.empty(n, cols, dtype=torch.float32, device=packed.device)
    elif out.numel() != n * cols or not out.is_floating_point():
        raise ValueError(f"out: expected a floating tensor of {n}x{cols} values, got {tuple(out.shape)} of {out.dtype}")
    target = out if out.shape == (n, cols) else out.view(n, cols)
    if packed.is_cuda and _word_aligned_rows(packed) and target.is_contiguous():
        fused = _fused_kernels(target, fmt, block_size)
        if fused is not None and _launched(lambda: fused.dequantize_rows_into(packed, fmt, cols, block_size, target)):
            return out
    codes, scale_bytes = _split_rows(packed, cols, fmt, block_size)
    scales = _float32_view(scale_bytes)
    if scales is None:  # a fresh copy starts at offset 0 (``contiguous()`` of one row may not copy)
        scales = scale_bytes.clone(memory_format=torch.contiguous_format).view(torch.float32)
    _decode(codes, scales, fmt, target.unflatten(1, (cols // block_size, block_size)))
    return out
