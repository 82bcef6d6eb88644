"""Averaging one fragment's pseudo-gradient over the group: plain fp32, or compressed with error feedback.

``compression=None`` is one ``SUM`` allreduce of the flat fp32 (fp64 for fp64 parameters)
pseudo-gradient, then a division by the group size. A compressed format works like a ring
allreduce built from two exchanges of bytes (``uint8`` on every backend), so that the bytes each
rank sends do not grow with the group size:

1. the vector (plus the error carried from the last sync) is cut into one chunk per rank and
   encoded; an all-to-all hands chunk ``r`` of every rank to rank ``r``, which decodes the
   chunks and averages them in fp32;
2. rank ``r`` encodes its averaged chunk (plus its own carried error) and an all-gather hands
   every chunk to every rank, which decodes them: all ranks end with the same bits.

Both stages keep what encoding lost (error feedback) and add it to the next sync's input, so the
sum of what was applied over many syncs follows the true sum within one rounding step. Encoded
values are ``bf16`` bit patterns, or int8/fp8/int4 codes with one fp32 scale per block
(:mod:`dcomm.core.quantization`).

Example::

    >>> exchange = PseudoGradientExchange(group, "int8")  # doctest: +SKIP
    >>> pending = exchange.start(flat_delta, feedback)  # doctest: +SKIP
    >>> averaged = pending.result()  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcomm.core import all_gather_single, quantization

__all__ = ["BLOCK_SIZE", "COMPRESSIONS", "Feedback", "PendingAverage", "PseudoGradientExchange", "ReadyAverage"]

COMPRESSIONS = (None, "bf16", "fp8", "int8", "int4")
BLOCK_SIZE = 256
"""Values per fp32 scale of the int8/fp8/int4 formats, and the granule of every compressed chunk."""


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    work = all_gather_single(output, tensor, group, async_op=True)
    assert work is not None
    return work


class _Codec:
    """Encodes rows of fp32 values (each a multiple of ``BLOCK_SIZE`` long) into rows of bytes."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    def row_bytes(self, numel: int) -> int:
        """Bytes of one encoded row of ``numel`` values: codes then scales."""
        if self.fmt == "bf16":
            return 2 * numel
        return quantization.payload_bytes(numel, self.fmt, BLOCK_SIZE)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 ``[k, c]`` to uint8 ``[k, row_bytes(c)]``."""
        k, c = rows.shape
        if self.fmt == "bf16":
            return rows.to(torch.bfloat16).view(torch.uint8).view(k, 2 * c)
        codes, scales = quantization.quantize(rows, self.fmt, BLOCK_SIZE)
        return torch.cat((codes.view(k, -1), scales.view(k, -1).view(torch.uint8)), dim=1)

    def decode(self, rows: torch.Tensor, numel: int) -> torch.Tensor:
        """uint8 ``[k, row_bytes(numel)]`` back to fp32 ``[k, numel]``."""
        k = rows.shape[0]
        if self.fmt == "bf16":
            return rows.contiguous().view(torch.bfloat16).to(torch.float32).view(k, numel)
        code = quantization.code_bytes(numel, self.fmt, BLOCK_SIZE)
        codes = rows[:, :code].reshape(-1)
        scales = rows[:, code:].contiguous().view(torch.float32).reshape(-1)
        return quantization.dequantize(codes, scales, self.fmt, k * numel, BLOCK_SIZE).view(k, numel)


@dataclass
class Feedback:
    """What encoding lost at the last sync of one fragment: the whole vector, and this rank's chunk."""

    sent: torch.Tensor  # fp32 [numel]: carried into stage 1
    chunk: torch.Tensor  # fp32 [chunk numel]: carried into stage 2 (this rank's averaged chunk)


class PendingAverage:
    """One fragment's averaging in flight: ``advance()`` moves it on, ``result()`` finishes it."""

    def __init__(self, exchange: PseudoGradientExchange, flat: torch.Tensor, feedback: Feedback | None) -> None:
        self._exchange = exchange
        self._numel = flat.numel()
        self._feedback = feedback
        self._result: torch.Tensor | None = None
        self._stage = 1
        self._sent: torch.Tensor | None = None
        group, world = exchange.group, exchange.world
        if exchange.codec is None:
            self._buffer = flat
            self._work = dist.all_reduce(flat, group=group, async_op=True)
            exchange.bytes_sent += 2 * (world - 1) * flat.numel() * flat.element_size() // world
            return
        assert feedback is not None
        chunk = exchange.chunk_numel(self._numel)
        padded = flat.new_zeros(world * chunk, dtype=torch.float32)
        padded[: self._numel].copy_(flat).add_(feedback.sent)
        sent = exchange.codec.encode(padded.view(world, chunk))
        feedback.sent.copy_(padded[: self._numel])
        feedback.sent.sub_(exchange.codec.decode(sent, chunk).view(-1)[: self._numel])
        self._sent = sent  # alive until the collective is done with it
        self._buffer = torch.empty_like(sent)
        self._work = dist.all_to_all_single(self._buffer, sent, group=group, async_op=True)
        exchange.bytes_sent += (world - 1) * sent.shape[1]

    def advance(self) -> None:
        """Compressed: finish stage 1 (average this rank's chunk) and start stage 2. Else nothing."""
        exchange = self._exchange
        if self._stage != 1 or exchange.codec is None:
            return
        self._stage = 2
        assert self._feedback is not None
        self._work.wait()
        chunk = exchange.chunk_numel(self._numel)
        mine = exchange.codec.decode(self._buffer, chunk).sum(dim=0).div_(exchange.world)
        mine.add_(self._feedback.chunk)
        sent = exchange.codec.encode(mine.view(1, chunk))
        self._feedback.chunk.copy_(mine).sub_(exchange.codec.decode(sent, chunk).view(-1))
        self._sent = sent
        self._buffer = sent.new_empty((exchange.world, sent.shape[1]))
        self._work = _all_gather(self._buffer, sent, exchange.group)
        exchange.bytes_sent += (exchange.world - 1) * sent.shape[1]

    def result(self) -> torch.Tensor:
        """The averaged pseudo-gradient (flat, ``numel`` values), waiting for it if needed."""
        if self._result is not None:
            return self._result
        exchange = self._exchange
        self.advance()
        self._work.wait()
        if exchange.codec is None:
            self._result = self._buffer.div_(exchange.world)
        else:
            chunk = exchange.chunk_numel(self._numel)
            self._result = exchange.codec.decode(self._buffer, chunk).view(-1)[: self._numel]
        self._sent = None
        del self._buffer, self._work
        return self._result


class PseudoGradientExchange:
    """Averages flat pseudo-gradients over ``group`` and counts the bytes this rank sends.

    ``bytes_sent`` follows the usual algorithms: a ring allreduce of ``b`` bytes sends
    ``2 (n - 1) / n * b`` per rank; the all-to-all and the all-gather of a compressed sync each
    send ``(n - 1)`` encoded chunks.

    Example::

        >>> exchange = PseudoGradientExchange(dist.group.WORLD, None)  # doctest: +SKIP
        >>> exchange.start(flat, None).result()  # doctest: +SKIP
    """

    def __init__(self, group: dist.ProcessGroup, compression: str | None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.codec = None if compression is None else _Codec(compression)
        self.bytes_sent = 0

    def chunk_numel(self, numel: int) -> int:
        """Values per rank's chunk of a compressed ``numel``-vector: a whole number of blocks."""
        blocks = -(-numel // (self.world * BLOCK_SIZE))
        return max(blocks, 1) * BLOCK_SIZE

    def new_feedback(self, numel: int, device: torch.device) -> Feedback | None:
        """Zero error feedback for a fragment of ``numel`` values (None without compression)."""
        if self.codec is None:
            return None
        zeros = torch.zeros
        return Feedback(zeros(numel, device=device), zeros(self.chunk_numel(numel), device=device))

    def start(self, flat: torch.Tensor, feedback: Feedback | None) -> PendingAverage:
        """Start averaging ``flat`` (consumed: it may become the result) over the group.

        Every rank must start the same fragments in the same order.
        """
        return PendingAverage(self, flat, feedback)


class ReadyAverage:
    """An averaged pseudo-gradient already in hand (restored from a checkpoint); same face as ``PendingAverage``."""

    def __init__(self, average: torch.Tensor) -> None:
        self._average = average

    def advance(self) -> None:
        """Nothing left to do."""

    def result(self) -> torch.Tensor:
        """The averaged pseudo-gradient."""
        return self._average
