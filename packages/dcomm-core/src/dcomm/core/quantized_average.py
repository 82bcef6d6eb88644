"""Averaging a flat tensor over a process group with block-quantized codes on the wire.

The tensor is cut into blocks of ``block_size`` values, each quantized with its own float32
scale (:mod:`dcomm.core.quantization`; ``"bf16"`` sends bfloat16 values instead). Codes travel
as ``uint8`` rows, one block each, so fp8 also runs on gloo. Two patterns, one argument apart:

- ``"two_shot"`` (default): one chunk per rank; an all-to-all hands chunk ``r`` of every rank
  to rank ``r``, which dequantizes the copies, averages them in float32 and quantizes the
  average again; an all-gather hands every averaged chunk to every rank. Each rank sends
  ``2 (world - 1)`` chunks of ``1 / world`` of the tensor, about a quarter of an fp32 ring
  allreduce at any world size.
- ``"all_gather"``: every rank quantizes its whole tensor once; one all-gather; every rank
  averages the ``world`` dequantized copies. One rounding instead of two, ``world - 1`` whole
  tensors sent per rank.

Error feedback: pass ``error`` (and, for two-shot, ``shard_error``) float32 memories; what each
rounding lost is kept there and added to the next average's input.

Streams: :meth:`QuantizedAverage.begin` quantizes on the caller's current stream. On an
accelerator the middle step (dequantize, average, requantize) and the final dequantization run
on the averager's side stream, which waits for the collectives; the caller's stream waits only
for the finished result, in :meth:`PendingQuantizedAverage.result`.

Example::

    >>> averager = QuantizedAverage("int8")
    >>> pending = averager.begin(grad, group, key=0)  # doctest: +SKIP
    >>> first = pending.launch()  # doctest: +SKIP
    >>> averaged = pending.result()  # grad, now holding the average  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core.collectives import group_size, resolve_group, start_all_gather, work_future
from dcomm.core.low_precision import keep_until_stream_done
from dcomm.core.quantization import (
    QUANTIZED_FORMATS,
    dequantize_rows,
    fused_average_rows,
    fused_quantize_with_error,
    payload_bytes,
    quantize_rows,
)
from dcomm.core.validation import even_int, one_of

__all__ = [
    "AVERAGE_FORMATS",
    "AVERAGE_PATTERNS",
    "PendingQuantizedAverage",
    "QuantizedAverage",
    "chunk_numel",
    "quantized_average_bytes",
]

AVERAGE_FORMATS = ("bf16", *QUANTIZED_FORMATS)
AVERAGE_PATTERNS = ("two_shot", "all_gather")


def chunk_numel(numel: int, world: int, block_size: int = 256) -> int:
    """Values in each rank's chunk of a two-shot average: ``numel / world`` rounded up to whole blocks.

    Example::

        >>> chunk_numel(1000, 4, 256)
        256
    """
    return max(-(-numel // (world * block_size)), 1) * block_size


def _rows(numel: int, world: int, block_size: int, pattern: str) -> int:
    """Blocks (rows of the send buffer) one rank quantizes: whole chunks, or the whole tensor."""
    if pattern == "two_shot":
        return world * chunk_numel(numel, world, block_size) // block_size
    return max(-(-numel // block_size), 1)


def _row_bytes(fmt: str, block_size: int) -> int:
    return 2 * block_size if fmt == "bf16" else payload_bytes(block_size, fmt, block_size)


def quantized_average_bytes(numel: int, world: int, fmt: str, block_size: int = 256, pattern: str = "two_shot") -> int:
    """Bytes one rank sends to average ``numel`` values over ``world`` ranks.

    Two-shot: ``world - 1`` encoded chunks in the all-to-all and as many in the all-gather (a
    rank's own chunk does not travel). All-gather: ``world - 1`` copies of the encoded tensor.

    Example::

        >>> quantized_average_bytes(2**20, 4, "int8") / (2 * 3 / 4 * 4 * 2**20)  # of an fp32 ring
        0.25390625
    """
    if world <= 1:
        return 0
    per_rank = _rows(numel, world, block_size, pattern) * _row_bytes(fmt, block_size)
    if pattern == "two_shot":
        return 2 * (world - 1) * per_rank // world
    return (world - 1) * per_rank


@dataclass
class _Buffers:
    """The uint8 rows of one average, kept per key while the size stays the same."""

    send: torch.Tensor  # [rows, row bytes]: this rank's encoded tensor
    gathered: torch.Tensor  # every rank's averaged chunk (two-shot) or encoded tensor (all-gather)
    received: torch.Tensor | None = None  # two-shot: this rank's chunk from every rank
    row: torch.Tensor | None = None  # two-shot: the encoded average of this rank's chunk


class QuantizedAverage:
    """Averages flat tensors over a process group with encoded blocks; keeps buffers per key.

    Args:
        fmt: ``"int8"``, ``"fp8"`` (e4m3), ``"int4"`` or ``"bf16"``.
        block_size: values per block, each with its own float32 scale (even).
        pattern: ``"two_shot"`` (all-to-all, average, all-gather) or ``"all_gather"``.

    Every rank must use the same settings and begin the same averages in the same order.

    Example::

        >>> averager = QuantizedAverage("fp8", pattern="all_gather")
        >>> averager.padded_numel(1000, 4)
        1024
    """

    __slots__ = ("_buffers", "_streams", "block_size", "fmt", "pattern")

    def __init__(self, fmt: str, block_size: int = 256, pattern: str = "two_shot") -> None:
        self.fmt = one_of("fmt", fmt, AVERAGE_FORMATS, "pass one of the formats")
        self.block_size = even_int("block_size", block_size, 2, "the default is 256")
        self.pattern = one_of("pattern", pattern, AVERAGE_PATTERNS, "the default is 'two_shot'")
        self._buffers: dict[Hashable, _Buffers] = {}
        self._streams: dict[torch.device, Any] = {}

    def __repr__(self) -> str:
        return f"QuantizedAverage({self.fmt!r}, block_size={self.block_size}, pattern={self.pattern!r})"

    def padded_numel(self, numel: int, world: int) -> int:
        """Length of an ``error`` memory that :meth:`begin` can quantize in place (whole blocks)."""
        return _rows(numel, world, self.block_size, self.pattern) * self.block_size

    def shard_numel(self, numel: int, world: int) -> int:
        """Length of the ``shard_error`` memory of a two-shot average (0 for ``"all_gather"``)."""
        return chunk_numel(numel, world, self.block_size) if self.pattern == "two_shot" else 0

    def begin(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None,
        *,
        error: torch.Tensor | None = None,
        shard_error: torch.Tensor | None = None,
        key: Hashable | None = None,
    ) -> PendingQuantizedAverage:
        """Encode ``tensor`` for averaging over ``group`` (WORLD when None); nothing is sent yet.

        ``tensor`` (contiguous, floating) receives the average. ``error`` (float32, ``numel`` or
        :meth:`padded_numel` values) is added to the input and then holds what this rank's
        encoding lost; ``shard_error`` (float32, :meth:`shard_numel` values, two-shot only) the
        same for the re-encoded average of this rank's chunk. Where a block is not finite (an
        fp16 step that overflowed), the average is not finite there either and both memories
        keep their previous values, so later steps are not poisoned. ``key`` (e.g. a bucket index)
        reuses that key's send and receive buffers while the size stays the same; an average
        must finish before its key begins again.

        Example::

            >>> pending = averager.begin(bucket.buffer(), None, key=bucket.index())  # doctest: +SKIP
        """
        if not tensor.is_floating_point():
            raise TypeError(f"tensor: expected a floating tensor, got dtype {tensor.dtype}; convert it with .float()")
        if not tensor.is_contiguous():
            raise ValueError(
                f"tensor: expected a contiguous tensor, got strides {tensor.stride()}; pass tensor.contiguous()"
            )
        world = group_size(group)
        numel, block = tensor.numel(), self.block_size
        padded, shard = self.padded_numel(numel, world), self.shard_numel(numel, world)
        _check_memory("error", error, (numel, padded), tensor.device)
        _check_memory("shard_error", shard_error, (shard,) if shard else (), tensor.device)
        pending = PendingQuantizedAverage(self, tensor, group, world, shard_error)
        if world == 1:
            return pending
        flat = tensor.view(-1)
        if flat.dtype.itemsize > 4:  # add in float32, as the wire does
            flat = flat.float()
        buffers = self._get_buffers(key, padded // block, world, tensor.device)
        if error is None:
            self._encode(flat, numel, buffers.send)
        elif not fused_quantize_with_error(flat, error, self.fmt, block, buffers.send):
            # Encode input plus carried error, in place in the memory; keep what encoding lost.
            carried = error[:numel]
            previous = carried.clone()
            carried.add_(flat)
            self._encode(error, numel, buffers.send)
            carried.sub_(self._decode(buffers.send).view(-1)[:numel])
            _update_error(carried, carried, previous)
        pending._buffers = buffers
        pending.bytes_sent = quantized_average_bytes(numel, world, self.fmt, block, self.pattern)
        side = self._side_stream(tensor.device)
        if side is not None:
            side.wait_stream(torch.get_device_module(tensor.device).current_stream(tensor.device))
        return pending

    # -- encoding -----------------------------------------------------------------------------

    def _encode(self, source: torch.Tensor, numel: int, out: torch.Tensor) -> None:
        """Encode the first ``numel`` values of the flat ``source`` (zero-padded) into rows ``out``.

        Whole blocks are read straight from ``source`` when it is float32; only the rest goes
        through a small zero-padded copy.
        """
        block, rows = self.block_size, out.shape[0]
        direct = min(source.numel() // block, rows) if source.dtype == torch.float32 else 0
        if direct:
            self._encode_rows(source[: direct * block].view(direct, block), out[:direct])
        if direct < rows:
            start = direct * block
            tail = torch.empty((rows - direct) * block, dtype=torch.float32, device=source.device)
            tail[: numel - start].copy_(source[start:numel])
            tail[numel - start :].zero_()
            self._encode_rows(tail.view(-1, block), out[direct:])

    def _encode_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        if self.fmt == "bf16":
            out.view(torch.bfloat16).copy_(rows)
        else:
            quantize_rows(rows, self.fmt, self.block_size, out=out)

    def _decode(self, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[n, row bytes]`` to values ``[n, block_size]`` (float32, or into ``out``)."""
        if self.fmt == "bf16":
            values = packed.view(torch.bfloat16)
            return values.float() if out is None else out.copy_(values)
        return dequantize_rows(packed, self.fmt, self.block_size, self.block_size, out=out)

    def _decode_into(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """Decode rows into the flat ``out`` (fewer values than the rows hold): whole blocks in place."""
        block = self.block_size
        numel = out.numel()
        direct = min(numel // block, packed.shape[0])
        if direct:
            self._decode(packed[:direct], out[: direct * block].view(direct, block))
        if direct * block < numel:
            out[direct * block :].copy_(self._decode(packed[direct : direct + 1]).view(-1)[: numel - direct * block])

    # -- buffers and streams ------------------------------------------------------------------

    def _get_buffers(self, key: Hashable | None, rows: int, world: int, device: torch.device) -> _Buffers:
        two_shot = self.pattern == "two_shot"
        gathered_rows = rows if two_shot else world * rows
        buffers = None if key is None else self._buffers.get(key)
        if (
            buffers is not None
            and buffers.send.device == device
            and buffers.send.shape[0] == rows
            and buffers.gathered.shape[0] == gathered_rows
            and (buffers.row is None or buffers.row.shape[0] == rows // world)
        ):
            return buffers
        send = torch.empty(rows, _row_bytes(self.fmt, self.block_size), dtype=torch.uint8, device=device)
        buffers = _Buffers(send, send.new_empty(gathered_rows, send.shape[1]))
        if two_shot:
            buffers.received = torch.empty_like(send)
            buffers.row = send.new_empty(rows // world, send.shape[1])
        if key is not None:
            self._buffers[key] = buffers
        return buffers

    def _side_stream(self, device: torch.device) -> Any | None:
        """The stream this averager's middle and final steps run on (None on CPU)."""
        if device.type == "cpu":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.get_device_module(device).Stream(device=device)
        return stream


def _update_error(memory: torch.Tensor, updated: torch.Tensor, previous: torch.Tensor) -> None:
    """Write ``updated`` into the error ``memory`` where it is finite, ``previous`` elsewhere.

    An overflowed step (inf or NaN) thus keeps the carried error instead of poisoning every later
    step. ``updated`` or ``previous`` may be ``memory`` itself.
    """
    torch.where(torch.isfinite(updated), updated, previous, out=memory)


def _check_memory(name: str, memory: torch.Tensor | None, sizes: tuple[int, ...], device: torch.device) -> None:
    if memory is None:
        return
    if not sizes:
        raise ValueError(f"{name}: the 'all_gather' pattern re-encodes nothing, so it has no {name}; pass None")
    if memory.dtype != torch.float32 or not memory.is_contiguous() or memory.numel() not in sizes:
        raise ValueError(
            f"{name}: expected a contiguous float32 tensor of {' or '.join(map(str, sizes))} values, got "
            f"{memory.numel()} of {memory.dtype}; allocate it with the averager's padded_numel/shard_numel"
        )
    if memory.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {memory.device}; move it with .to()")


class PendingQuantizedAverage:
    """One average in flight: :meth:`launch`, then :meth:`advance` (optional), then :meth:`result`.

    ``bytes_sent`` is what this rank sends for it (known at once, host arithmetic).

    Example::

        >>> fut = pending.launch()  # doctest: +SKIP
        >>> pending.advance()  # doctest: +SKIP
        >>> pending.result()  # doctest: +SKIP
    """

    __slots__ = (
        "_averager",
        "_buffers",
        "_future",
        "_group",
        "_shard_error",
        "_stage",
        "_tensor",
        "_world",
        "bytes_sent",
    )

    def __init__(
        self,
        averager: QuantizedAverage,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None,
        world: int,
        shard_error: torch.Tensor | None,
    ) -> None:
        self._averager = averager
        self._tensor = tensor
        # The group as given (None: WORLD), resolved at each call: a pending average lives in
        # callbacks that gloo may free on its own threads, which must never drop the last
        # reference to a process group (it would join its own thread).
        self._group = group
        self._world = world
        self._shard_error = shard_error
        self._buffers: _Buffers | None = None
        # The running collective's future. Waiting on it (not on its work) is safe inside its own
        # callbacks: gloo marks the work finished only after the future's callbacks have run.
        self._future: torch.futures.Future | None = None
        self._stage = "begun"
        self.bytes_sent = 0

    def launch(self) -> torch.futures.Future:
        """Start the first collective (the all-to-all, or the all-gather); return its future.

        Example::

            >>> fut = pending.launch()  # doctest: +SKIP
        """
        if self._stage != "begun":
            raise RuntimeError(f"launch: this average was already launched (stage {self._stage!r}); call it once")
        self._stage = "launched"
        buffers = self._buffers
        if buffers is None:  # a group of one: nothing to send
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done
        if buffers.received is not None:  # two-shot
            work = dist.all_to_all_single(buffers.received, buffers.send, group=self._group, async_op=True)
        else:
            work = start_all_gather(buffers.gathered.view(-1), buffers.send.view(-1), resolve_group(self._group))
        self._future = work_future(work)
        return self._future

    def advance(self) -> None:
        """Two-shot: once the all-to-all is done, average this rank's chunk and start the all-gather.

        On an accelerator this only queues work on the side stream; on CPU it waits for the
        all-to-all. Nothing to do for ``"all_gather"`` or when already advanced.

        Example::

            >>> pending.advance()  # doctest: +SKIP
        """
        if self._stage == "begun":
            self.launch()
        buffers = self._buffers
        if self._stage != "launched" or buffers is None or buffers.received is None or buffers.row is None:
            return
        self._stage = "advanced"
        averager, world = self._averager, self._world
        with self._on_side_stream():
            assert self._future is not None
            self._future.wait()
            shard_error = self._shard_error
            fmt, block = averager.fmt, averager.block_size
            if not fused_average_rows(buffers.received, world, fmt, block, buffers.row, shard_error):
                chunk = buffers.row.shape[0] * block
                average = averager._decode(buffers.received).view(world, chunk).sum(0).div_(world)
                if shard_error is not None:
                    average.add_(shard_error)
                averager._encode_rows(average.view(-1, block), buffers.row)
                if shard_error is not None:
                    updated = torch.sub(average, averager._decode(buffers.row).view(-1))
                    _update_error(shard_error, updated, shard_error)
            if shard_error is not None:
                keep_until_stream_done(shard_error)
            keep_until_stream_done(buffers.received)
            work = start_all_gather(buffers.gathered.view(-1), buffers.row.view(-1), resolve_group(self._group))
            self._future = work_future(work)

    def result(self) -> torch.Tensor:
        """The averaged tensor (the one given to ``begin``), once the last collective is done.

        On an accelerator the caller's current stream waits for it (the host does not).

        Example::

            >>> averaged = pending.result()  # doctest: +SKIP
        """
        if self._stage == "done":
            return self._tensor
        self.advance()
        self._stage = "done"
        buffers = self._buffers
        if buffers is None:
            return self._tensor
        averager, world = self._averager, self._world
        device = self._tensor.device
        side = averager._side_stream(device)
        with self._on_side_stream():
            assert self._future is not None
            self._future.wait()
            out = self._tensor.view(-1)
            if averager.pattern == "two_shot":
                averager._decode_into(buffers.gathered, out)
            else:
                copies = averager._decode(buffers.gathered).view(world, -1)
                torch.div(copies.sum(0)[: out.numel()], world, out=out)
            # Freed later on another stream, their memory waits for this stream's work (free on CPU).
            for tensor in (out, buffers.send, buffers.gathered, buffers.row):
                if tensor is not None:
                    keep_until_stream_done(tensor)
            done = None if side is None else side.record_event()
        self._future = None
        if done is not None:
            torch.get_device_module(device).current_stream(device).wait_event(done)
        return self._tensor

    def _on_side_stream(self) -> contextlib.AbstractContextManager:
        device = self._tensor.device
        side = self._averager._side_stream(device)
        return contextlib.nullcontext() if side is None else torch.get_device_module(device).stream(side)
