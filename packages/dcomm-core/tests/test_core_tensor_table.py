"""TensorTable: the rows it lays out (any device) and its Triton copies (CUDA only)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dcomm.core import tensor_table
from dcomm.core.tensor_table import BLOCK, TensorTable

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or tensor_table.triton is None, reason="needs CUDA and Triton (the GPU suite runs it)"
)


def test_rows_cover_each_tensor_once_at_aligned_places() -> None:
    tensors = [torch.zeros(5), torch.zeros(BLOCK + 1), torch.zeros(2, 3), torch.zeros(2 * BLOCK)]
    table = TensorTable.build(tensors)
    rows = table.table.tolist()
    # (element address, length, flat place) per block; fp32 tensors start on 4-element (16-byte) places.
    lengths = [length for _, length, _ in rows]
    assert lengths == [5, BLOCK, 1, 6, BLOCK, BLOCK]
    places = [place for _, _, place in rows]
    assert places == [0, 8, 8 + BLOCK, 8 + BLOCK + 4, 8 + BLOCK + 12, 8 + 2 * BLOCK + 12]
    assert all(place % 4 == 0 for place in places)
    assert rows[2][0] == tensors[1].data_ptr() // 4 + BLOCK  # the second block of the second tensor
    assert table.numel == 8 + (BLOCK + 4) + 8 + 2 * BLOCK
    assert table.starts == places
    assert table.ends == [p + n for p, n in zip(places, lengths, strict=True)]


def test_runs_stay_within_capacity_and_cover_every_row() -> None:
    tensors = [torch.zeros(n) for n in (3, BLOCK * 3 + 7, 100, BLOCK, 1, 5000)]
    table = TensorTable.build(tensors)
    for capacity in (BLOCK, BLOCK + 100, 3 * BLOCK, 10**9):
        runs = table.runs(capacity)
        assert runs[0][0] == 0
        assert runs[-1][1] == table.rows
        assert all(stop == first for (_, stop), (first, _) in itertools.pairwise(runs))
        assert all(table.span(first, stop) <= capacity for first, stop in runs)
    assert table.runs(10**9) == [(0, table.rows)]


def test_usable_needs_cuda_one_dtype_and_contiguity() -> None:
    assert not tensor_table.usable([torch.zeros(3)])  # CPU
    assert not tensor_table.usable([])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8])
def test_pack_then_unpack_round_trips(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    sizes = [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK - 5, 64, 100_003]
    tensors = [(torch.rand(n, generator=g, device="cuda") * 100).to(dtype) for n in sizes]
    tensors.append((torch.rand(6, 5, generator=g, device="cuda") * 100).to(dtype))
    table = TensorTable.build(tensors)
    assert table.aligned
    flat = torch.full((table.numel,), -1, dtype=dtype, device="cuda")
    table.pack(flat, 0, table.rows)
    for tensor, (start, stop) in zip(tensors, _spans(table, tensors), strict=True):
        assert torch.equal(flat[start:stop], tensor.view(-1))
    originals = [t.clone() for t in tensors]
    for tensor in tensors:
        tensor.zero_()
    # Unpack in runs through a small buffer, as averaging streams them.
    for first, stop in table.runs(2 * BLOCK + 64):
        part = torch.empty(table.span(first, stop), dtype=dtype, device="cuda")
        part.copy_(flat[table.starts[first] : table.ends[stop - 1]])
        table.unpack(part, first, stop)
    assert all(torch.equal(a, b) for a, b in zip(tensors, originals, strict=True))


@needs_cuda
def test_unaligned_views_copy_right() -> None:
    base = torch.arange(10 * BLOCK, dtype=torch.float32, device="cuda")
    tensors = [base[1 : 1 + BLOCK + 3], base[BLOCK * 3 + 2 : BLOCK * 5], base[9 * BLOCK + 1 : 9 * BLOCK + 6]]
    table = TensorTable.build(tensors)
    assert not table.aligned
    flat = torch.zeros(table.numel, device="cuda")
    table.pack(flat, 0, table.rows)
    for tensor, (start, stop) in zip(tensors, _spans(table, tensors), strict=True):
        assert torch.equal(flat[start:stop], tensor)
    flat.neg_()
    expected = base.clone()
    for tensor in tensors:
        expected[tensor.storage_offset() : tensor.storage_offset() + tensor.numel()] *= -1
    table.unpack(flat, 0, table.rows)
    assert torch.equal(base, expected)


def _spans(table: TensorTable, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each tensor's (start, stop) in the flat layout: its first row's place, plus its size."""
    spans, row = [], 0
    for tensor in tensors:
        start = table.starts[row]
        spans.append((start, start + tensor.numel()))
        row += -(-tensor.numel() // BLOCK)
    return spans


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcomm.core._triton import ENV_SWITCH, triton_enabled

    assert triton_enabled()
    for value in ("0", "off", " False "):
        monkeypatch.setenv(ENV_SWITCH, value)
        assert not triton_enabled()
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert triton_enabled()


@needs_cuda
def test_switch_off_turns_the_table_away(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.zeros(3, device="cuda"), torch.zeros(5, device="cuda")]
    assert tensor_table.usable(tensors)
    monkeypatch.setenv("DCOMM_TRITON", "0")
    assert not tensor_table.usable(tensors)


@needs_cuda
def test_check_names_the_switch_when_the_kernel_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.arange(5.0, device="cuda"), torch.arange(3.0, device="cuda")]
    table = TensorTable.build(tensors)
    table.check(torch.float32)  # builds and runs: nothing changes
    assert torch.equal(tensors[0], torch.arange(5.0, device="cuda"))

    class Broken:
        def __getitem__(self, grid: object) -> object:
            raise RuntimeError("no ptxas")

    monkeypatch.setattr(tensor_table, "_copy_rows", Broken())
    with pytest.raises(RuntimeError, match="DCOMM_TRITON=0 on every rank"):
        table.check(torch.float32)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copies_run_on_the_tensors_gpu_not_the_current_one() -> None:
    tensors = [torch.arange(7.0, device="cuda:1"), torch.arange(3000.0, device="cuda:1")]
    table = TensorTable.build(tensors)
    flat = torch.zeros(table.numel, device="cuda:1")
    with torch.cuda.device(0):
        table.pack(flat, 0, table.rows)
        flat.mul_(2)
        table.unpack(flat, 0, table.rows)
    assert torch.equal(tensors[0], torch.arange(7.0, device="cuda:1") * 2)
    assert torch.equal(tensors[1], torch.arange(3000.0, device="cuda:1") * 2)
