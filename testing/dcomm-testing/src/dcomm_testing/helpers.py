"""Fixtures every dcomm test suite shares: seeded per-rank data, comparisons and CPU stand-ins.

Example::

    >>> x = seeded_batch(rank=1, step=0, shape=(4, 6))
    >>> assert_close([x], [x.clone()], tol=0.0, what="identity")
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["assert_close", "cpu_record_stream_is_noop", "seeded_batch"]


def seeded_batch(
    rank: int, step: int, shape: Sequence[int], *, scale_by_rank: bool = True, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A normal batch different on every rank and step (scaled by ``rank + 1`` unless told not to).

    Example::

        >>> seeded_batch(0, 0, (2,)).shape
        torch.Size([2])
    """
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    data = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if scale_by_rank:
        data = data * (rank + 1)
    return data.to(dtype)


def assert_close(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], tol: float, what: str) -> None:
    """Equal tensors when ``tol`` is 0, else equal within ``tol`` relative to each reference's largest value.

    Example::

        >>> assert_close([torch.ones(2)], [torch.ones(2)], 0.0, "ones")
    """
    assert len(ours) == len(ref) > 0, (what, len(ours), len(ref))
    for index, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if tol == 0:
            gap = (a.double() - b.double()).abs().max()
            assert torch.equal(a, b), f"{what}: tensor {index} differs: max |diff| {gap}"
            continue
        b = b.to(torch.float64)
        torch.testing.assert_close(
            a.double(), b, rtol=tol, atol=tol * b.abs().max().item(), msg=lambda m, i=index: f"{what}[{i}]: {m}"
        )


def assert_same_on_ranks(tensors: Sequence[torch.Tensor], what: str, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` (WORLD when None) holds bit-identical ``tensors`` (a collective).

    Example::

        >>> assert_same_on_ranks(list(model.parameters()), "after averaging")  # doctest: +SKIP
    """
    for tensor in tensors:
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: replicas differ"


def cpu_record_stream_is_noop() -> contextlib.AbstractContextManager[None]:
    """Make ``Tensor.record_stream`` a no-op for CPU tensors; leaving the returned context restores it.

    torch's own fp16/bf16 FSDP hooks call it with a CPU stream and crash on CPU tensors ("unknown
    parameter type"); on GPUs nothing changes. Call it inside a rank function (plainly, for the
    rest of the process, or as ``with cpu_record_stream_is_noop():``), never in pytest's process.

    Example::

        >>> with cpu_record_stream_is_noop():  # doctest: +SKIP
        ...     train_with_torch_fp16_hook()
    """
    original = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: torch.Stream) -> None:
        if self.device.type != "cpu":
            original(self, stream)

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]

    @contextlib.contextmanager
    def restored_on_exit() -> Iterator[None]:
        try:
            yield
        finally:
            torch.Tensor.record_stream = original  # type: ignore[method-assign]

    return restored_on_exit()
