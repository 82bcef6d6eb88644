"""Every private torch member dcomm-core reads exists on the torch under test; a missing one is named."""

from __future__ import annotations

import re
import types

import pytest
import torch

from dcomm.core import foreach_copy_, foreach_div_, foreach_sub_, views_like
from dcomm.core.torch_private import PRIVATE_MEMBERS, PrivateMember, TorchChanged, missing_members, private_member


def test_every_private_member_exists() -> None:
    assert PRIVATE_MEMBERS
    assert missing_members(PRIVATE_MEMBERS) == [], f"torch {torch.__version__}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_foreach_div_and_copy_match_one_tensor_at_a_time(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    sources = [torch.randn(shape, generator=gen).to(dtype) for shape in [(5,), (2, 3), (1,)]]
    divisor = 3.0
    expected = [s / divisor for s in sources]
    targets = [torch.zeros_like(s) for s in sources]
    foreach_copy_(targets, sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
    foreach_div_(targets, divisor)
    assert all(torch.equal(t, e) for t, e in zip(targets, expected, strict=True))
    assert all(not torch.equal(t, s) for t, s in zip(targets, sources, strict=True)), "sources were changed"
    others = [torch.randn(s.shape, generator=gen).to(dtype) for s in sources]
    expected = [t - o for t, o in zip(targets, others, strict=True)]
    foreach_sub_(targets, others)
    assert all(torch.equal(t, e) for t, e in zip(targets, expected, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))],
)
def test_foreach_div_rounds_as_tensor_div_on_each_device(dtype: torch.dtype, device: str) -> None:
    # On CUDA, Tensor.div_ by a Python number multiplies by its reciprocal; the average must keep
    # torch's bits when its in-place tensors are divided in one kernel.
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(shape, generator=gen).to(dtype).to(device) for shape in [(4096, 33), (7,), (3, 5, 11)]]
    for divisor in (3.0, 6.0, 7.0, 12.0):
        expected = [t.clone().div_(divisor) for t in tensors]
        divided = [t.clone() for t in tensors]
        foreach_div_(divided, divisor)
        assert all(torch.equal(d, e) for d, e in zip(divided, expected, strict=True)), (dtype, device, divisor)


def test_foreach_copy_and_sub_convert_dtypes_as_one_tensor_at_a_time() -> None:
    # DiLoCo's pseudo-gradient: fp32 views of a flat buffer, then the bf16 or fp64 parameters.
    gen = torch.Generator().manual_seed(4)
    sources = [torch.randn(3, generator=gen).to(dtype) for dtype in (torch.bfloat16, torch.float32, torch.float64)]
    others = [torch.randn(3, generator=gen).to(s.dtype) for s in sources]
    targets = [torch.zeros(3) for _ in sources]
    foreach_copy_(targets, sources, non_blocking=True)
    foreach_sub_(targets, others)
    expected = [torch.zeros(3).copy_(s).sub_(o) for s, o in zip(sources, others, strict=True)]
    assert all(torch.equal(t, e) for t, e in zip(targets, expected, strict=True))


def test_a_missing_foreach_kernel_raises_torch_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_foreach_div_")
    with pytest.raises(TorchChanged, match=r"the in-place division of many tensors.*torch\._foreach_div_ is gone"):
        foreach_div_([torch.ones(2)], 2.0)


def test_a_missing_member_names_torch_the_member_and_the_supported_range() -> None:
    fake = types.SimpleNamespace(__name__="torch.distributed")
    expected = rf"^torch {re.escape(torch.__version__)} changed NCCL sums: torch.distributed._gone is gone"
    with pytest.raises(TorchChanged, match=expected):
        private_member(fake, "_gone", distribution="dcomm-core", what="NCCL sums")
    with pytest.raises(TorchChanged, match=r"dcomm-core supports torch(>=|<|,|\d|\.)*"):
        private_member(fake, "_gone", distribution="dcomm-core", what="NCCL sums")
    assert missing_members([PrivateMember(lambda: fake, "_gone", "x")]) == ["torch.distributed._gone (x)"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_views_like_are_the_flat_buffers_consecutive_pieces_shaped_like_the_tensors(dtype: torch.dtype) -> None:
    shapes = [(2, 3), (), (4,), (1, 2, 2)]
    tensors = [torch.zeros(shape, dtype=torch.bfloat16) for shape in shapes]
    flat = torch.arange(15, dtype=dtype)
    views = views_like(flat, tensors)
    expected = [piece.view(shape) for piece, shape in zip(flat.split([6, 1, 4, 4]), shapes, strict=True)]
    assert [v.shape for v in views] == [torch.Size(shape) for shape in shapes]
    assert all(v.dtype == dtype for v in views)  # the flat buffer's dtype, not the tensors'
    assert all(torch.equal(v, e) for v, e in zip(views, expected, strict=True))
    views[2].fill_(-1.0)  # views, not copies
    assert flat[7:11].tolist() == [-1.0] * 4
