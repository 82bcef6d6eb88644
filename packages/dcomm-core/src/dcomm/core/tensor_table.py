"""Many same-dtype CUDA tensors copied into and out of one flat buffer, one kernel launch per copy.

Packing hundreds of tensors into a buffer with torch costs host time per tensor on every call
(a view or a list entry each, about a microsecond or two): on a model of 581 tensors that is more
than the allreduce of the buffer takes. A :class:`TensorTable` is built once for a list of
tensors: a device table with one row per block of up to ``BLOCK`` elements (its address, its
length and its place in the flat layout). A copy is then one Triton launch over any run of rows,
whatever the number of tensors, and a run of rows can stop in the middle of a tensor, so the
tensors stream through a buffer of any size.

Each tensor starts at a multiple of 16 bytes in the flat layout (the gap is padding, never copied
back), so the loads and stores are vectorised when the tensors' own addresses are 16-byte
aligned, as the caching allocator's always are.

Example::

    >>> table = TensorTable.build(tensors)  # doctest: +SKIP
    >>> flat = torch.empty(table.numel, dtype=tensors[0].dtype, device="cuda")  # doctest: +SKIP
    >>> table.pack(flat, 0, table.rows)  # doctest: +SKIP
    >>> table.unpack(flat, 0, table.rows)  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from dcomm.core._triton import ENV_SWITCH, launch_device, triton_enabled

__all__ = ["BLOCK", "TensorTable", "usable"]

BLOCK = 2048
"""Elements per row of the table: what one Triton program copies."""

_ALIGN_BYTES = 16

try:
    import triton  # type: ignore[import-not-found]
    import triton.language as tl  # type: ignore[import-not-found]
except ImportError:  # CPU-only installs: callers take their torch path
    triton = None

if triton is not None:

    @triton.jit
    def _copy_rows(  # type: ignore[no-untyped-def]
        table_ptr, flat_ptr, flat_index, first_element, TO_FLAT: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Copy one row's elements between its tensor and ``flat`` (which starts at ``first_element``).

        A row is (the element index of its first element in the address space, its length, its
        place in the flat layout); ``flat_index`` is ``flat``'s own element index, so the tensor's
        elements are ``flat_ptr`` plus their distance from it.
        """
        row = tl.program_id(0).to(tl.int64)
        source = tl.load(table_ptr + 3 * row) - flat_index
        count = tl.load(table_ptr + 3 * row + 1)
        place = tl.load(table_ptr + 3 * row + 2) - first_element
        source = tl.multiple_of(source, ALIGN)
        place = tl.multiple_of(place, ALIGN)
        cols = tl.arange(0, BLOCK)
        tensor_ptrs = flat_ptr + source + cols
        flat_ptrs = flat_ptr + place + cols
        if count == BLOCK:
            if TO_FLAT:
                tl.store(flat_ptrs, tl.load(tensor_ptrs))
            else:
                tl.store(tensor_ptrs, tl.load(flat_ptrs))
        else:
            mask = cols < count
            if TO_FLAT:
                tl.store(flat_ptrs, tl.load(tensor_ptrs, mask=mask), mask=mask)
            else:
                tl.store(tensor_ptrs, tl.load(flat_ptrs, mask=mask), mask=mask)


def usable(tensors: list[torch.Tensor]) -> bool:
    """Whether a :class:`TensorTable` can copy ``tensors``: contiguous CUDA tensors of one dtype, Triton present."""
    if triton is None or not tensors or not triton_enabled():
        return False
    first = tensors[0]
    itemsize = first.element_size()
    return first.is_cuda and all(
        t.is_contiguous() and t.device == first.device and t.dtype == first.dtype and t.data_ptr() % itemsize == 0
        for t in tensors
    )


@dataclass(frozen=True)
class TensorTable:
    """The rows of a list of tensors: build once, then pack and unpack any run of rows by one launch each.

    The table holds the tensors' addresses, not the tensors: rebuild it whenever one of them may
    have moved (a caller keys it on their ``data_ptr()``), and keep the tensors alive while it is used.
    """

    table: torch.Tensor
    """``[rows, 3]`` int64 on the tensors' device: element address, length, flat position."""
    starts: list[int]
    """Each row's flat position (host copy, ascending)."""
    ends: list[int]
    """The flat position just past each row (host copy, ascending)."""
    numel: int
    """Elements of the flat layout, padding included."""
    aligned: bool
    """Whether every tensor starts on a 16-byte boundary (the copies are then vectorised)."""

    @property
    def rows(self) -> int:
        return len(self.ends)

    @classmethod
    def build(cls, tensors: list[torch.Tensor]) -> TensorTable:
        """The table of ``tensors`` (see :func:`usable`), each placed at a 16-byte multiple of the flat layout."""
        itemsize = tensors[0].element_size()
        align = max(1, _ALIGN_BYTES // itemsize)
        numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
        addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        padded = (numels + align - 1) // align * align
        starts = torch.cumsum(padded, 0) - padded
        blocks = (numels + BLOCK - 1) // BLOCK
        owner = torch.repeat_interleave(torch.arange(len(tensors)), blocks)
        within = torch.arange(int(blocks.sum())) - (torch.cumsum(blocks, 0) - blocks)[owner]
        lengths = torch.clamp(numels[owner] - within * BLOCK, max=BLOCK)
        places = starts[owner] + within * BLOCK
        table = torch.stack([addresses[owner] // itemsize + within * BLOCK, lengths, places], dim=1)
        return cls(
            table=table.to(tensors[0].device),
            starts=places.tolist(),
            ends=(places + lengths).tolist(),
            numel=int(padded.sum()),
            aligned=bool((addresses % _ALIGN_BYTES == 0).all()),
        )

    def check(self, flat_dtype: torch.dtype) -> None:
        """Compile and run both copies once on the first row (a scratch copy: no tensor changes).

        Raises ``RuntimeError`` naming the switch when Triton cannot build or launch them, before
        the caller has started any collective.
        """
        scratch = torch.empty(self.ends[0] - self.starts[0], dtype=flat_dtype, device=self.table.device)
        try:
            self.pack(scratch, 0, 1)
            self.unpack(scratch, 0, 1)  # writes back the values just read
        except Exception as exc:
            raise RuntimeError(
                f"dcomm's Triton copy kernels failed to build or run ({type(exc).__name__}: {exc}); "
                f"set {ENV_SWITCH}=0 on every rank to average without them"
            ) from exc

    def runs(self, capacity: int) -> list[tuple[int, int]]:
        """``(first row, stop row)`` of consecutive runs spanning at most ``capacity`` flat elements each.

        A run always holds at least one row, so ``capacity`` should be at least ``BLOCK``.
        """
        runs: list[tuple[int, int]] = []
        row = 0
        while row < self.rows:
            stop = bisect.bisect_right(self.ends, self.starts[row] + capacity, lo=row + 1)
            runs.append((row, stop))
            row = stop
        return runs

    def span(self, first: int, stop: int) -> int:
        """Flat elements from row ``first``'s position to the end of row ``stop - 1``."""
        return self.ends[stop - 1] - self.starts[first]

    def pack(self, flat: torch.Tensor, first: int, stop: int) -> None:
        """Copy rows ``first..stop`` into ``flat``, which starts at row ``first``'s position (one launch)."""
        self._launch(flat, first, stop, to_flat=True)

    def unpack(self, flat: torch.Tensor, first: int, stop: int) -> None:
        """Copy rows ``first..stop`` from ``flat``, laid out as :meth:`pack` left it, into their tensors."""
        self._launch(flat, first, stop, to_flat=False)

    def _launch(self, flat: torch.Tensor, first: int, stop: int, to_flat: bool) -> None:
        if stop <= first:
            return
        itemsize = flat.element_size()
        aligned = self.aligned and flat.data_ptr() % _ALIGN_BYTES == 0
        with launch_device(flat):
            _copy_rows[(stop - first,)](
                self.table[first:stop],
                flat,
                flat.data_ptr() // itemsize,
                self.starts[first],
                TO_FLAT=to_flat,
                ALIGN=max(1, _ALIGN_BYTES // itemsize) if aligned else 1,
                BLOCK=BLOCK,
                num_warps=4,
            )
