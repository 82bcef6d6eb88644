"""Fixtures every dcomm test suite shares: seeded per-rank data, comparisons, patches and CPU stand-ins.

Example::

    >>> x = seeded_batch(rank=1, step=0, shape=(4, 6))
    >>> assert_close([x], [x.clone()], tol=0.0, what="identity")
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

__all__ = [
    "LogMessages",
    "assert_close",
    "assert_updates_close",
    "captured_log",
    "cpu_record_stream_is_noop",
    "device_synchronize_forbidden",
    "rank_groups",
    "recorded_calls",
    "seeded_batch",
    "seeded_normal",
    "seeded_pair",
    "spread_normal",
]


def seeded_normal(
    seed: int,
    shape: Sequence[int],
    *,
    scale: float = 1.0,
    draw: torch.dtype = torch.float64,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Normal values from a fresh generator seeded with ``seed``, times ``scale``, as ``dtype``.

    The values are drawn and scaled in ``draw`` (torch's generator gives other values in float32
    than in float64), then cast to ``dtype`` (``draw`` when None).

    Example::

        >>> seeded_normal(1000 * rank + step, (6, 8), scale=rank + 1, draw=torch.float32)  # doctest: +SKIP
    """
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(*shape, generator=gen, dtype=draw) * scale
    return data if dtype is None else data.to(dtype)


def seeded_batch(
    rank: int,
    step: int,
    shape: Sequence[int],
    *,
    scale_by_rank: bool = True,
    dtype: torch.dtype = torch.float32,
    draw: torch.dtype = torch.float64,
) -> torch.Tensor:
    """A normal batch different on every rank and step (scaled by ``rank + 1`` unless told not to).

    It is :func:`seeded_normal` with the seed ``10_000 * step + rank``.

    Example::

        >>> seeded_batch(0, 0, (2,)).shape
        torch.Size([2])
    """
    scale = rank + 1 if scale_by_rank else 1
    return seeded_normal(10_000 * step + rank, shape, scale=scale, draw=draw, dtype=dtype)


def seeded_pair(
    seed: int,
    x_shape: Sequence[int],
    y_shape: Sequence[int],
    *,
    x_scale: float = 1.0,
    y_scale: float = 1.0,
    uniform_y: bool = False,
    draw: torch.dtype = torch.float32,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets drawn in turn from one generator seeded with ``seed``, each times its scale.

    ``x`` is normal; ``y`` normal too, or uniform in [0, 1) when ``uniform_y``. Drawn and scaled in
    ``draw``, then cast to ``dtype`` (``draw`` when None).

    Example::

        >>> x, y = seeded_pair(1000 * rank + step, (5, 6), (5, 3), y_scale=rank + 1, uniform_y=True)  # doctest: +SKIP
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*x_shape, generator=gen, dtype=draw) * x_scale
    y = (torch.rand if uniform_y else torch.randn)(*y_shape, generator=gen, dtype=draw) * y_scale
    return (x, y) if dtype is None else (x.to(dtype), y.to(dtype))


def spread_normal(
    seed: int,
    numel: int,
    decades: tuple[float, float],
    *,
    scale: float = 1.0,
    shuffle: bool = True,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``numel`` normal values whose magnitudes spread from ``10**decades[0]`` to ``10**decades[1]``.

    The magnitudes are shuffled (unless ``shuffle`` is False) with the same generator that then
    draws the values; everything is computed in float64 and cast to ``dtype`` at the end, so
    block-quantization tests see blocks of very different scales.

    Example::

        >>> spread_normal(seed=rank, numel=4096, decades=(-3, 1), scale=rank + 1)  # doctest: +SKIP
    """
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(decades[0], decades[1], numel, dtype=torch.float64)
    if shuffle:
        magnitudes = magnitudes[torch.randperm(numel, generator=gen)]
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * magnitudes * scale).to(dtype)


def assert_close(
    ours: Sequence[torch.Tensor],
    ref: Sequence[torch.Tensor],
    tol: float,
    what: str,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Equal tensors when ``tol`` is 0, else equal within ``tol`` relative to each reference's largest value.

    ``dtype``, when given, is the dtype every tensor of ``ours`` must have. A reference on another
    device is compared on ``ours``'s.

    Example::

        >>> assert_close([torch.ones(2)], [torch.ones(2)], 0.0, "ones")
    """
    assert len(ours) == len(ref) > 0, (what, len(ours), len(ref))
    for index, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert dtype is None or a.dtype == dtype, (what, index, a.dtype)
        if tol == 0:
            gap = (a.double() - b.double()).abs().max()
            assert torch.equal(a, b), f"{what}: tensor {index} differs: max |diff| {gap}"
            continue
        b = b.to(a.device, torch.float64)
        torch.testing.assert_close(
            a.double(), b, rtol=tol, atol=tol * b.abs().max().item(), msg=lambda m, i=index: f"{what}[{i}]: {m}"
        )


def assert_updates_close(
    ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], initial: Sequence[torch.Tensor], rtol: float, what: str
) -> None:
    """Trained parameters whose changes from ``initial`` agree within ``rtol`` of the reference's change.

    The error is measured against the largest change of each parameter tensor over the run, so
    it is the relative error of the training updates, not hidden by the initial values; a
    reference parameter that did not change fails.

    Example::

        >>> assert_updates_close(fp16_params, fp32_params, initial_params, 2.5e-3, "fp16 hook")  # doctest: +SKIP
    """
    for i, (a, b, start) in enumerate(zip(ours, ref, initial, strict=True)):
        change = (b - start.detach()).abs().max().item()
        assert change > 0, f"{what}: parameter {i} did not train"
        error = (a - b).abs().max().item() / change
        assert error <= rtol, f"{what}: parameter {i} off by {error:.2e} of its change, more than {rtol}"


def rank_groups(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """The ranks of ``group`` (WORLD when None) grouped by bit-identical ``tensors``, e.g. ``[[0, 1], [2, 3]]``.

    A collective; the ranks are group ranks, each group listed from its lowest rank.

    Example::

        >>> rank_groups(list(model.parameters())) == [list(range(world))]  # all replicas agree  # doctest: +SKIP
    """
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    groups: list[list[int]] = []
    for r, g in enumerate(gathered):
        for same in groups:
            if torch.equal(gathered[same[0]], g):
                same.append(r)
                break
        else:
            groups.append([r])
    return groups


def assert_same_on_ranks(tensors: Sequence[torch.Tensor], what: str, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` (WORLD when None) holds bit-identical ``tensors`` (a collective).

    Example::

        >>> assert_same_on_ranks(list(model.parameters()), "after averaging")  # doctest: +SKIP
    """
    for tensor in tensors:
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: replicas differ"


@contextlib.contextmanager
def device_synchronize_forbidden(what: str) -> Iterator[None]:
    """Inside the block, ``torch.cuda.synchronize`` and ``torch.accelerator.synchronize`` raise ``AssertionError``.

    For code that must never wait for the device (``what`` names it in the error); both are
    restored on leaving.

    Example::

        >>> with device_synchronize_forbidden("average_parameters"):  # doctest: +SKIP
        ...     average_parameters(params, None)
    """

    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError(f"{what} synchronized the device")

    saved = torch.cuda.synchronize, torch.accelerator.synchronize
    torch.cuda.synchronize = torch.accelerator.synchronize = forbidden  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.accelerator.synchronize = saved


@contextlib.contextmanager
def recorded_calls(owner: object, name: str, record: Callable[..., T]) -> Iterator[list[T]]:
    """Inside the block, every call of ``owner.name`` first appends ``record(*args, **kwargs)`` to the list yielded.

    The attribute is restored on leaving. For a method patched on a class, ``args`` starts with
    the instance.

    Example::

        >>> with recorded_calls(Reducer, "__call__", lambda self, out, inp: inp.dtype) as dtypes:  # doctest: +SKIP
        ...     train()
    """
    real = getattr(owner, name)
    calls: list[T] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(owner, name, spy)
    try:
        yield calls
    finally:
        setattr(owner, name, real)


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


class BucketStub:
    """What hook code reads from a ``dist.GradBucket``: its index, whether it is the last, its buffer.

    Example::

        >>> BucketStub(last=True, index=3).is_last()
        True
    """

    def __init__(self, last: bool, index: int = 0, buffer: torch.Tensor | None = None) -> None:
        self.last, self._index, self._buffer = last, index, buffer

    def is_last(self) -> bool:
        return self.last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            raise ValueError("buffer: this BucketStub was built without one; pass BucketStub(..., buffer=tensor)")
        return self._buffer


class LogMessages(logging.Handler):
    """The messages a logger emitted at INFO and above, in order (``messages``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def captured_log(name: str) -> LogMessages:
    """Collect logger ``name``'s INFO messages from now on, in a rank process (where pytest's caplog is not).

    Example::

        >>> log = captured_log("dcomm.ddp.zero_overlap")
        >>> logging.getLogger("dcomm.ddp.zero_overlap").info("chose %r", "fused")
        >>> log.messages
        ["chose 'fused'"]
    """
    handler = LogMessages()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler
