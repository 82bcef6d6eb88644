"""The fused Triton kernels against the torch form of row quantization (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from dcomm.core import _quantization_kernels as kernels
from dcomm.core import quantization

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton (the GPU suite runs it)"
)

FORMATS = ("int8", "fp8")


def spread_rows(n: int, cols: int, block: int, seed: int) -> torch.Tensor:
    """Rows whose blocks span 1e-30 to 1e4 in magnitude (fp8 subnormals included), one block of zeros."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-30, 4, n * cols // block, dtype=torch.float64)
    x = torch.randn(n, cols, generator=g, dtype=torch.float64) * scales.repeat_interleave(block).view(n, cols)
    x[0, :block] = 0.0
    return x.float().cuda()


def torch_rows(rows: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """The torch form, with the kernels switched off."""
    saved = kernels.usable
    kernels.usable = lambda *args: False  # type: ignore[assignment]
    try:
        return quantization.quantize_rows(rows, fmt, block)
    finally:
        kernels.usable = saved  # type: ignore[assignment]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "cols", "block"), [(4, 4096, 256), (3, 64, 16), (1, 256 * 1031, 256)])
def test_quantize_matches_torch(fmt: str, n: int, cols: int, block: int) -> None:
    rows = spread_rows(n, cols, block, seed=n + cols)
    ours = torch.empty(n, quantization.payload_bytes(cols, fmt, block), dtype=torch.uint8, device="cuda")
    kernels.quantize_rows_into(rows, fmt, block, ours, quantization.max_code(fmt))
    theirs = torch_rows(rows, fmt, block)
    codes = quantization.code_bytes(cols, fmt, block)
    assert torch.equal(ours[:, codes:], theirs[:, codes:]), "the block scales differ"
    # Codes: the same, or (a value on a rounding boundary, divided in another order) one code apart.
    ours_values = quantization.dequantize_rows(ours, fmt, cols, block)
    theirs_values = quantization.dequantize_rows(theirs, fmt, cols, block)
    scales = theirs[:, codes:].contiguous().view(torch.float32).repeat_interleave(block, dim=1)
    step = scales * (2.0**-3 * 448 if fmt == "fp8" else 1.0)
    assert ((ours_values - theirs_values).abs() <= step).all()
    differing = int((ours[:, :codes] != theirs[:, :codes]).sum())
    assert differing <= ours.numel() // 1000, f"{differing} of {ours.numel()} codes differ"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_torch(fmt: str, dtype: torch.dtype) -> None:
    n, cols, block = 4, 2048, 256
    packed = torch_rows(spread_rows(n, cols, block, seed=5), fmt, block)
    ours = torch.empty(n, cols, dtype=dtype, device="cuda")
    kernels.dequantize_rows_into(packed, fmt, cols, block, ours)
    saved = kernels.usable
    kernels.usable = lambda *args: False  # type: ignore[assignment]
    try:
        theirs = quantization.dequantize_rows(packed, fmt, cols, block).to(dtype)
    finally:
        kernels.usable = saved  # type: ignore[assignment]
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_blocks_stay_non_finite(fmt: str) -> None:
    rows = spread_rows(2, 512, 256, seed=9)
    rows[0, 3] = float("nan")
    rows[1, 300] = float("inf")
    packed = torch.empty(2, quantization.payload_bytes(512, fmt, 256), dtype=torch.uint8, device="cuda")
    kernels.quantize_rows_into(rows, fmt, 256, packed, quantization.max_code(fmt))
    values = torch.empty(2, 512, device="cuda")
    kernels.dequantize_rows_into(packed, fmt, 512, 256, values)
    assert not values[0, :256].isfinite().all()
    assert not values[1, 256:].isfinite().all()
    assert values[0, 256:].isfinite().all()
    assert values[1, :256].isfinite().all()


def test_public_functions_use_the_kernels_on_cuda() -> None:
    calls: list[str] = []
    saved = kernels.quantize_rows_into, kernels.dequantize_rows_into

    def quantize_spy(*args: object) -> torch.Tensor:
        calls.append("quantize")
        return saved[0](*args)  # type: ignore[arg-type]

    def dequantize_spy(*args: object) -> torch.Tensor:
        calls.append("dequantize")
        return saved[1](*args)  # type: ignore[arg-type]

    kernels.quantize_rows_into, kernels.dequantize_rows_into = quantize_spy, dequantize_spy  # type: ignore[assignment]
    try:
        rows = spread_rows(2, 512, 256, seed=1)
        packed = quantization.quantize_rows(rows, "int8", 256)
        quantization.dequantize_rows(packed, "int8", 512, 256)
    finally:
        kernels.quantize_rows_into, kernels.dequantize_rows_into = saved  # type: ignore[assignment]
    assert calls == ["quantize", "dequantize"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("numel", "block"), [(256 * 40 - 100, 256), (37, 16)])
def test_quantize_with_error_is_the_three_steps_bit_for_bit(
    fmt: str, dtype: torch.dtype, numel: int, block: int
) -> None:
    rows = -(-numel // block)
    values = spread_rows(1, rows * block, block, seed=numel).view(-1)[:numel].to(dtype).clone()
    values[5] = float("nan") if numel > 100 else values[5]  # a NaN block: NaN scale, its error kept
    error = spread_rows(1, rows * block, block, seed=numel + 1).view(-1).mul_(1e-3)
    error[-3:] = -0.0  # the padded tail: never updated
    payload = quantization.payload_bytes(block, fmt, block)
    fused_error, fused_out = error.clone(), torch.zeros(rows, payload, dtype=torch.uint8, device="cuda")
    assert quantization.fused_quantize_with_error(values, fused_error, fmt, block, fused_out)
    steps_error, steps_out = error.clone(), torch.zeros_like(fused_out)
    steps_error[:numel].add_(values)
    quantization.quantize_rows(steps_error.view(rows, block), fmt, block, out=steps_out)
    steps_error[:numel].sub_(quantization.dequantize_rows(steps_out, fmt, block, block).view(-1)[:numel])
    steps_error = torch.where(torch.isfinite(steps_error), steps_error, error)  # a bad block keeps its error
    assert torch.equal(fused_out, steps_out)
    assert torch.isfinite(fused_error).all(), "a NaN block poisoned the error memory"
    nan = steps_error.isnan()
    assert torch.equal(fused_error.isnan(), nan)
    assert torch.equal(fused_error[~nan].view(torch.int32), steps_error[~nan].view(torch.int32))  # -0.0 too


def test_quantize_with_error_declines_what_it_cannot_fuse() -> None:
    values, error = torch.ones(64, device="cuda"), torch.zeros(64, device="cuda")
    out = torch.zeros(4, quantization.payload_bytes(16, "int8", 16), dtype=torch.uint8, device="cuda")
    assert not quantization.fused_quantize_with_error(values.cpu(), error.cpu(), "int8", 16, out.cpu())
    assert not quantization.fused_quantize_with_error(values, error[:60], "int8", 16, out)  # not padded
    assert not quantization.fused_quantize_with_error(values, error.double(), "int8", 16, out)
    assert not quantization.fused_quantize_with_error(values, error, "int4", 16, out)
    assert not quantization.fused_quantize_with_error(values, error, "bf16", 16, out)  # QuantizedAverage's bf16
    assert torch.equal(error, torch.zeros_like(error))


def average_steps(received: torch.Tensor, world: int, fmt: str, block: int, error: torch.Tensor | None) -> torch.Tensor:
    """The two-shot middle step in torch steps (QuantizedAverage's form without the fused kernel)."""
    n = received.shape[0] // world
    average = quantization.dequantize_rows(received, fmt, block, block).view(world, n * block).sum(0).div_(world)
    if error is not None:
        average.add_(error)
    row = quantization.quantize_rows(average.view(n, block), fmt, block)
    if error is not None:
        updated = torch.sub(average, quantization.dequantize_rows(row, fmt, block, block).view(-1))
        error.copy_(torch.where(torch.isfinite(updated), updated, error))  # a bad block keeps its error
    return row


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("with_error", [False, True])
def test_average_rows_is_the_torch_steps(fmt: str, world: int, with_error: bool) -> None:
    block, n = 256, 37
    received = quantization.quantize_rows(spread_rows(world * n, block, block, seed=world).mul_(0.5), fmt, block)
    received[3 * n + 1 if world > 3 else n + 1, :block] = 0  # a zero block from one rank
    bad = spread_rows(1, block, block, seed=7)
    bad[0, 9] = float("nan")
    received[n + 2] = quantization.quantize_rows(bad, fmt, block)[0]  # a NaN block from rank 1
    error = spread_rows(1, n * block, block, seed=world + 1).view(-1).mul_(1e-3) if with_error else None
    fused_error = None if error is None else error.clone()
    steps_error = None if error is None else error.clone()
    fused_row = torch.zeros(n, received.shape[1], dtype=torch.uint8, device="cuda")
    assert quantization.fused_average_rows(received, world, fmt, block, fused_row, fused_error)
    steps_row = average_steps(received, world, fmt, block, steps_error)
    fused_values = quantization.dequantize_rows(fused_row, fmt, block, block)
    steps_values = quantization.dequantize_rows(steps_row, fmt, block, block)
    assert fused_values[2].isnan().all()
    assert steps_values[2].isnan().all()
    if fused_error is not None:
        assert torch.isfinite(fused_error).all(), "the NaN block poisoned the shard error"
    if world <= 4:  # torch sums four or fewer chunks in rank order: bit for bit
        assert torch.equal(fused_row, steps_row)
        if error is not None:
            assert fused_error is not None
            assert steps_error is not None
            nan = steps_error.isnan()
            assert torch.equal(fused_error.isnan(), nan)
            assert torch.equal(fused_error[~nan].view(torch.int32), steps_error[~nan].view(torch.int32))
    else:  # the order of the sum may differ: the means agree to within one code
        ok = ~steps_values.isnan()
        largest = steps_values.abs().amax(dim=1, keepdim=True).expand_as(steps_values)
        step = largest / (127 if fmt == "int8" else 8)  # int8: the scale; e4m3: 3 mantissa bits
        assert ((fused_values - steps_values).abs()[ok] <= 1.01 * step[ok]).all()


def test_average_rows_declines_what_it_cannot_fuse() -> None:
    block, n, world = 16, 4, 2
    payload = quantization.payload_bytes(block, "int8", block)
    received = torch.zeros(world * n, payload, dtype=torch.uint8, device="cuda")
    row = torch.zeros(n, payload, dtype=torch.uint8, device="cuda")
    error = torch.zeros(n * block, device="cuda")
    assert not quantization.fused_average_rows(received.cpu(), world, "int8", block, row.cpu(), None)
    assert not quantization.fused_average_rows(received, 3, "int8", block, row, None)  # not world chunks
    assert not quantization.fused_average_rows(received, world, "int8", block, row, error[:-1])
    assert not quantization.fused_average_rows(received, world, "int8", block, row, error.double())
    assert not quantization.fused_average_rows(received, world, "bf16", block, row, None)
    assert not quantization.fused_average_rows(received, world, "int4", block, row, None)
    assert torch.equal(row, torch.zeros_like(row))
