"""Block quantization against an exact float64 reference: error bounds, shapes, packing, bytes."""

from __future__ import annotations

import types

import pytest
import torch

from dcomm.core import QUANTIZED_FORMATS, dequantize, payload_bytes, quantize
from dcomm.core.quantization import code_bytes, dequantize_rows, num_blocks, quantize_rows
from dcomm_testing import block_scales, quantization_half_step

BLOCK = 64


def sample(numel: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values spanning several magnitudes, so blocks get very different scales."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-6, 3, numel, dtype=torch.float64)[torch.randperm(numel, generator=gen)]
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * magnitudes).to(dtype)


def error_bound(x: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """Round-to-nearest bound: half a code step (int) or half an e4m3 ulp (fp8), plus float32 slack."""
    return quantization_half_step(x, fmt, block_size) * (1 + 1e-5) + x.double().reshape(-1).abs() * 2.0**-22


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000])
def test_round_trip_within_bound(fmt: str, numel: int) -> None:
    x = sample(numel, seed=numel)
    payload, scales = quantize(x, fmt, BLOCK)
    y = dequantize(payload, scales, fmt, numel, BLOCK)
    assert y.dtype == torch.float32
    assert y.shape == (numel,)
    err = (y.double() - x.double()).abs()
    bound = error_bound(x, fmt, BLOCK)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    torch.testing.assert_close(scales.double(), block_scales(x, fmt, BLOCK)[::BLOCK], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_block_maximum_is_kept(fmt: str) -> None:
    x = sample(4 * BLOCK, seed=3)
    y = dequantize(*quantize(x, fmt, BLOCK), fmt, x.numel(), BLOCK)
    idx = x.view(-1, BLOCK).abs().argmax(1) + torch.arange(4) * BLOCK
    torch.testing.assert_close(y[idx], x[idx], rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_shape_and_dtype(fmt: str, dtype: torch.dtype) -> None:
    x = sample(3 * 5 * 7, seed=5, dtype=dtype).view(3, 5, 7)
    payload, scales = quantize(x, fmt, BLOCK)
    assert payload.dtype == torch.uint8
    assert payload.dim() == 1
    assert payload.numel() == code_bytes(x.numel(), fmt, BLOCK)
    assert scales.dtype == torch.float32
    assert scales.shape == (num_blocks(x.numel(), BLOCK),)
    out = torch.empty(3, 5, 7, dtype=dtype)
    assert dequantize(payload, scales, fmt, x.numel(), BLOCK, out=out) is out
    err = (out.double().reshape(-1) - x.double().reshape(-1)).abs()
    # The output's own rounding adds up to half its ulp.
    own = x.double().reshape(-1).abs() * torch.finfo(dtype).eps
    assert (err <= error_bound(x, fmt, BLOCK) + own).all()


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_zeros_are_exact(fmt: str) -> None:
    x = torch.zeros(3 * BLOCK)
    x[BLOCK + 5] = -2.5  # one non-zero block between two zero blocks
    payload, scales = quantize(x, fmt, BLOCK)
    assert scales[0] == 0
    assert scales[2] == 0
    y = dequantize(payload, scales, fmt, x.numel(), BLOCK)
    assert torch.isfinite(y).all()
    assert torch.equal(y, x)


def test_empty() -> None:
    payload, scales = quantize(torch.empty(0), "int8")
    assert payload.numel() == 0
    assert scales.numel() == 0
    assert dequantize(payload, scales, "int8", 0).numel() == 0


def test_int4_packs_two_codes_per_byte_low_nibble_first() -> None:
    payload, scales = quantize(torch.tensor([7.0, -7.0, 0.0, 1.0]), "int4", block_size=4)
    assert scales.tolist() == [1.0]
    # codes + 8: [15, 1, 8, 9] -> bytes [15 | 1 << 4, 8 | 9 << 4]
    assert payload.tolist() == [15 | 1 << 4, 8 | 9 << 4]


def test_int8_codes_are_rounded_to_nearest() -> None:
    x = torch.tensor([127.0, 0.49, 0.51, -1.5, -2.5, 126.6])
    payload, scales = quantize(x, "int8", block_size=6)
    assert scales.tolist() == [1.0]
    assert payload.view(torch.int8).tolist() == [127, 0, 1, -2, -2, 127]


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_stochastic_rounding_is_unbiased(fmt: str) -> None:
    x = sample(BLOCK, seed=7)
    gen = torch.Generator().manual_seed(0)
    trials = 2000
    total = torch.zeros(BLOCK, dtype=torch.float64)
    for _ in range(trials):
        payload, scales = quantize(x, fmt, BLOCK, stochastic=True, generator=gen)
        total += dequantize(payload, scales, fmt, BLOCK, BLOCK).double()
    mean_err = (total / trials - x.double()).abs()
    nearest_err = (dequantize(*quantize(x, fmt, BLOCK), fmt, BLOCK, BLOCK).double() - x.double()).abs()
    # Each trial errs by at most one step; 2000 trials shrink the mean error by ~sqrt(2000) ≈ 45.
    assert (mean_err <= 2 * error_bound(x, fmt, BLOCK) / 10).all()
    assert mean_err.sum() < nearest_err.sum() / 4


@pytest.mark.parametrize(
    ("numel", "fmt", "block_size", "expected"),
    [
        (1024, "int8", 256, 1024 + 16),
        (1000, "int8", 256, 1024 + 16),
        (1024, "fp8", 256, 1040),
        (1024, "int4", 256, 528),
    ],
)
def test_payload_bytes(numel: int, fmt: str, block_size: int, expected: int) -> None:
    assert payload_bytes(numel, fmt, block_size) == expected
    payload, scales = quantize(torch.randn(numel), fmt, block_size)
    assert payload.numel() + 4 * scales.numel() == expected


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_eight_bit_formats_send_about_a_quarter_of_fp32(fmt: str) -> None:
    numel = 25 * 2**18
    assert payload_bytes(numel, fmt) / (4 * numel) <= 0.255


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fmt"):
        quantize(torch.ones(4), "int2")
    with pytest.raises(ValueError, match="block_size: expected an even int >= 2, got 3"):
        quantize(torch.ones(4), "int8", block_size=3)
    with pytest.raises(TypeError, match="block_size: expected an even int >= 2, got '8'"):
        quantize(torch.ones(4), "int8", block_size="8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x: expected a floating tensor"):
        quantize(torch.ones(4, dtype=torch.int32), "int8")
    payload, scales = quantize(torch.ones(8), "int8", block_size=4)
    with pytest.raises(ValueError, match="payload"):
        dequantize(payload[:4], scales, "int8", 8, block_size=4)
    with pytest.raises(ValueError, match="scales"):
        dequantize(payload, scales[:1], "int8", 8, block_size=4)
    with pytest.raises(ValueError, match="out"):
        dequantize(payload, scales, "int8", 8, block_size=4, out=torch.empty(7))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_cuda_matches_cpu(fmt: str) -> None:
    # CUDA and CPU kernels may round x / scale differently in the last bit (measured on H200:
    # not bit-identical), so a value at a rounding boundary can land one code apart. Ranks of one
    # job share a device type, so what matters is that both decode to the same values within
    # one code step of each block.
    x = sample(1000, seed=11)
    cpu = quantize(x, fmt, BLOCK)
    cuda = quantize(x.cuda(), fmt, BLOCK)
    torch.testing.assert_close(cuda[1].cpu(), cpu[1], rtol=1e-6, atol=0)
    y = dequantize(*cuda, fmt, 1000, BLOCK)
    assert y.is_cuda
    reference = dequantize(*cpu, fmt, 1000, BLOCK)
    step = cpu[1].repeat_interleave(BLOCK)[:1000] * (2.0**-3 * 448 if fmt == "fp8" else 1.0)
    assert ((y.cpu() - reference).abs() <= step + 1e-12).all()


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_rows_are_self_contained(fmt: str) -> None:
    rows = sample(4 * 2 * BLOCK, seed=13).view(4, 2 * BLOCK)
    packed = quantize_rows(rows, fmt, BLOCK)
    assert packed.shape == (4, payload_bytes(2 * BLOCK, fmt, BLOCK))
    # Each row decodes alone, equal to quantizing it by itself.
    for i in range(4):
        alone = dequantize(*quantize(rows[i], fmt, BLOCK), fmt, 2 * BLOCK, BLOCK)
        assert torch.equal(dequantize_rows(packed[i : i + 1], fmt, 2 * BLOCK, BLOCK)[0], alone)
    out = torch.empty(4, 2 * BLOCK, dtype=torch.float64)
    assert dequantize_rows(packed, fmt, 2 * BLOCK, BLOCK, out=out) is out
    assert (out.reshape(-1) - rows.double().reshape(-1)).abs().le(error_bound(rows, fmt, BLOCK)).all()
    with pytest.raises(ValueError, match="cols"):
        quantize_rows(torch.ones(2, BLOCK + 2), fmt, BLOCK)
    with pytest.raises(ValueError, match="packed"):
        dequantize_rows(packed[:, 1:], fmt, 2 * BLOCK, BLOCK)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_rows_with_scales_at_any_byte_offset(fmt: str) -> None:
    # Blocks of 2 put each row's scales at byte offsets that are not multiples of 4, also in a
    # single row (where contiguous() copies nothing).
    rows = sample(3 * 6, seed=17).view(3, 6)
    packed = quantize_rows(rows, fmt, 2)
    for i in range(3):
        alone = dequantize(*quantize(rows[i], fmt, 2), fmt, 6, 2)
        assert torch.equal(dequantize_rows(packed[i : i + 1], fmt, 6, 2)[0], alone)
        out = torch.empty(1, 6)
        quantize_rows(rows[i : i + 1], fmt, 2, out=packed[i : i + 1, :].clone())
        assert torch.equal(dequantize_rows(packed[i : i + 1], fmt, 6, 2, out=out)[0], alone)


def test_a_fused_kernel_that_fails_to_build_hands_over_to_the_torch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcomm.core import quantization

    monkeypatch.setattr(quantization, "_FUSED_FAILURE", [])
    launches: list[str] = []

    def broken() -> None:
        launches.append("broken")
        raise RuntimeError("triton: cannot build the kernel")

    with pytest.warns(UserWarning, match="torch form from now on"):
        assert not quantization._launched(broken)
    assert quantization._FUSED_FAILURE == ["RuntimeError: triton: cannot build the kernel"]
    cuda_like = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
    assert quantization._fused_kernels(cuda_like, "int8", 4) is None  # type: ignore[arg-type]  # none tried again
    assert quantization._launched(lambda: launches.append("fine"))
    assert launches == ["broken", "fine"]
