"""Casts for communication: from fp32/fp64 the division before the cast, torch's order from fp16/bf16."""

from __future__ import annotations

import pytest
import torch

from dcomm.core import cast_for_communication, divide_into


def values(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(20_000, generator=generator, dtype=torch.float64) * 0.01).to(dtype)


@pytest.mark.parametrize("source", [torch.float32, torch.float64])
@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16])
def test_from_fp32_the_division_comes_before_the_cast(source: torch.dtype, target: torch.dtype) -> None:
    tensor = values(source)
    want = (tensor / 3).to(target)  # the quotient in the input's precision, then the cast
    assert torch.equal(divide_into(torch.empty_like(tensor, dtype=target), tensor, 3.0), want)
    assert torch.equal(cast_for_communication(tensor, target, 3.0), want)


@pytest.mark.parametrize(("source", "target"), [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_from_low_precision_torch_order_cast_then_divide(source: torch.dtype, target: torch.dtype) -> None:
    tensor = values(source)
    torchs = tensor.to(target).div_(3)  # torch's fp16/bf16 compress hooks
    ours = divide_into(torch.empty_like(tensor, dtype=target), tensor, 3.0)
    assert torch.equal(ours, torchs)
    assert torch.equal(cast_for_communication(tensor, target, 3.0), torchs)
    if source == torch.bfloat16:
        # One kernel would round the quotient to bf16 first: further from the exact value.
        fused = torch.div(tensor, 3.0, out=torch.empty_like(tensor, dtype=target))
        exact = tensor.double() / 3
        assert (fused.double() - exact).abs().mean() > 2 * (ours.double() - exact).abs().mean()


def test_no_division_is_a_copy() -> None:
    tensor = values(torch.bfloat16)
    assert torch.equal(divide_into(torch.empty_like(tensor, dtype=torch.float16), tensor, 1.0), tensor.half())
