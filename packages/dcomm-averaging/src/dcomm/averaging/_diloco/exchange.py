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
values are ``bf16`` bit patterns, or int8/fp8/int4 codes with one fp32 scale per block; the
exchange is :class:`dcomm.core.QuantizedAverage` (on GPUs its stage 2 and the final decoding run
on a side stream, so ``advance()`` never makes the training stream wait for the network).

Example::

    >>> exchange = PseudoGradientExchange(group, "int8")  # doctest: +SKIP
    >>> pending = exchange.start(flat_delta, feedback)  # doctest: +SKIP
    >>> averaged = pending.result()  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcomm.core import QuantizedAverage
from dcomm.core.quantized_average import PendingQuantizedAverage, chunk_numel

__all__ = ["BLOCK_SIZE", "COMPRESSIONS", "Feedback", "PendingAverage", "PseudoGradientExchange", "ReadyAverage"]

COMPRESSIONS = (None, "bf16", "fp8", "int8", "int4")
BLOCK_SIZE = 256
"""Values per fp32 scale of the int8/fp8/int4 formats, and the granule of every compressed chunk."""


@dataclass
class Feedback:
    """What encoding lost at the last sync of one fragment: the whole vector, and this rank's chunk."""

    sent: torch.Tensor  # fp32 [numel]: carried into stage 1
    chunk: torch.Tensor  # fp32 [chunk numel]: carried into stage 2 (this rank's averaged chunk)


class PendingAverage:
    """One fragment's averaging in flight: ``advance()`` moves it on, ``result()`` finishes it."""

    def __init__(self, exchange: PseudoGradientExchange, flat: torch.Tensor, feedback: Feedback | None) -> None:
        self._exchange = exchange
        self._result: torch.Tensor | None = None
        self._pending: PendingQuantizedAverage | None = None
        group, world = exchange.group, exchange.world
        if exchange.averager is None:
            self._buffer = flat
            self._work = dist.all_reduce(flat, group=group, async_op=True)
            exchange.bytes_sent += 2 * (world - 1) * flat.numel() * flat.element_size() // world
            return
        assert feedback is not None
        self._pending = exchange.averager.begin(flat, group, error=feedback.sent, shard_error=feedback.chunk)
        self._pending.launch()
        exchange.bytes_sent += self._pending.bytes_sent

    def advance(self) -> None:
        """Compressed: once stage 1 is done, average this rank's chunk and start stage 2. Else nothing."""
        if self._pending is not None:
            self._pending.advance()

    def result(self) -> torch.Tensor:
        """The averaged pseudo-gradient (flat, ``numel`` values), waiting for it if needed."""
        if self._result is not None:
            return self._result
        if self._pending is not None:
            self._result = self._pending.result()
            self._pending = None
            return self._result
        self._work.wait()
        self._result = self._buffer.div_(self._exchange.world)
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
        self.world = group.size()  # also for a group that torch.distributed does not know (torchft's)
        self.averager = None if compression is None else QuantizedAverage(compression, BLOCK_SIZE)
        self.bytes_sent = 0

    def chunk_numel(self, numel: int) -> int:
        """Values per rank's chunk of a compressed ``numel``-vector: a whole number of blocks."""
        return chunk_numel(numel, self.world, BLOCK_SIZE)

    def new_feedback(self, numel: int, device: torch.device) -> Feedback | None:
        """Zero error feedback for a fragment of ``numel`` values (None without compression)."""
        if self.averager is None:
            return None
        sent, chunk = (torch.zeros(n, dtype=torch.float32, device=device) for n in (numel, self.chunk_numel(numel)))
        return Feedback(sent, chunk)

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
