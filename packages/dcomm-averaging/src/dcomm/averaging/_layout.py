"""How a parameter's memory is read for averaging: memory-order flat views, aliasing, back-to-back runs.

Averaging is elementwise, so a dense parameter is averaged through a 1-D view of its elements in
memory order (channels-last included), and parameters that lie back to back in one storage (a
flattened model) are averaged as one tensor.

Example::

    >>> import torch
    >>> memory_order_view(torch.zeros(2, 3).t()).shape
    torch.Size([6])
"""

from __future__ import annotations

import itertools

import torch


def memory_order_view(param: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of every element of ``param`` in memory order (no copy); None where it has gaps or overlaps.

    Contiguous tensors and any dense permutation of one (channels-last, transposed) qualify.
    """
    data = param.detach()
    if data.is_contiguous():
        return data.view(-1)
    order = sorted(range(data.dim()), key=lambda d: data.stride(d), reverse=True)
    permuted = data.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def _flat_view(param: torch.Tensor) -> torch.Tensor:
    """:func:`memory_order_view`, raising where the layout has gaps or overlaps.

    Averaging is elementwise, so memory order is as good as logical order as long as all ranks
    lay the parameter out the same way, which they do for the same model.
    """
    flat = memory_order_view(param)
    if flat is not None:
        return flat
    data = param.detach()
    raise ValueError(
        f"params: a parameter of shape {tuple(data.shape)} and strides {data.stride()} has gaps or "
        "overlaps in memory, so it cannot be averaged in place; make it contiguous first "
        "(param.data = param.data.contiguous())"
    )


def _dense(param: torch.Tensor) -> torch.Tensor:
    """``param`` itself when contiguous (no new tensor), else its memory-order flat view."""
    return param if param.is_contiguous() else _flat_view(param)


def _overlap(spans: list[tuple[int, int]]) -> bool:
    """Whether two of the ``(address, bytes)`` spans of dense parameters share bytes (aliasing).

    In place, shared bytes would be divided twice; the bucket path copies each parameter out and
    back, which stays right. Disjoint views of one buffer (a flattened model) do not overlap.
    Different storages never share addresses, so comparing address ranges is enough.
    """
    ordered = sorted(spans)
    return any(b[0] < a[0] + a[1] for a, b in itertools.pairwise(ordered))


def _adjacent_runs(tensors: list[torch.Tensor], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, count)`` of each run of consecutive dense tensors that lie back to back in one storage.

    ``spans`` are the tensors' ``(address, bytes)``. Parameters carved out of one flat buffer (a
    flattened model) then cost one allreduce, at the full bandwidth of a raw allreduce of the
    same bytes, instead of one each.
    """
    runs: list[tuple[int, int]] = []
    run_end = 0
    for index, (tensor, (address, nbytes)) in enumerate(zip(tensors, spans, strict=True)):
        if runs and address == run_end and _same_storage(tensors[index - 1], tensor):
            start, count = runs[-1]
            runs[-1] = (start, count + 1)
        else:
            runs.append((index, 1))
        run_end = address + nbytes
    return runs


def _merged(tensors: list[torch.Tensor], runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """One tensor per run: the tensor itself, or one 1-D view over the run's back-to-back tensors."""
    return [_span(tensors[start : start + count]) for start, count in runs]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _span(run: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D view over the back-to-back tensors of ``run`` (the tensor itself for one)."""
    first = run[0]
    if len(run) == 1:
        return first
    numel = sum(t.numel() for t in run)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))
