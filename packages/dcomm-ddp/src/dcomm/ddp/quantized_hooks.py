"""int8 and fp8 (e4m3) gradient compression for DDP: a quarter of fp32's bytes at any world size.

A two-shot reduction of block-quantized gradients (:class:`dcomm.core.QuantizedAverage`, one
float32 scale per 256 values):

1. the bucket is cut into one chunk per rank and each chunk quantized;
2. an all-to-all sends chunk ``r`` to rank ``r``, which dequantizes every peer's copy, averages
   them in fp32 and quantizes the average again;
3. an all-gather returns every rank's averaged chunk, dequantized into the bucket.

Step 1 runs in the hook on the backward pass's stream; on GPUs steps 2 and 3 run on a side
stream, so the backward pass never waits for the network (only DDP's final wait does). Every
bucket's kernels and collectives run eagerly, in the order DDP hands the buckets over.

Each rank sends ``2 (world - 1)`` quantized chunks, about ``(1 + 4 / block_size) / 4`` of an
fp32 ring allreduce, whatever the world size (torch's uint8 hooks all-gather whole buckets, so
their bytes grow with the world size). Codes always travel as ``uint8``, so fp8 works on gloo.

With :class:`QuantizedState` and ``error_feedback=True``, what each rounding lost (the local
quantization on every rank, the re-quantization of the average on its owner) is added back at
the next step, so the sum of the applied updates follows the sum of the exact averages. A step
whose gradients overflowed (inf or NaN, as fp16 autocast with a ``GradScaler`` gives now and then)
averages to inf or NaN where it overflowed, so the scaler skips it, and leaves the error memories
as they were there. ``state.bytes_sent`` counts the bytes this rank has sent.

The hooks always send the codes: what travels never depends on timing. On a fast link (NVLink),
where a bf16 allreduce of the bucket takes no longer than the two quantized shots and the
quantization kernels come on top, register ``bf16_compress_hook`` instead.

Example::

    >>> from dcomm.ddp import QuantizedState, int8_compress_hook
    >>> state = QuantizedState(None, error_feedback=True)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, int8_compress_hook)  # doctest: +SKIP
    >>> state.bytes_sent  # doctest: +SKIP
"""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not with strings.

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import QuantizedAverage, completed_future, quantized_average_bytes, resolve_group
from dcomm.core.validation import boolean, even_int, non_negative_int
from dcomm.ddp._hook_state import ResumableHookState
from dcomm.ddp._ordered_chain import drains_here

__all__ = ["QuantizedState", "fp8_compress_hook", "int8_compress_hook", "quantized_allreduce_bytes"]

logger = logging.getLogger(__name__)


def quantized_allreduce_bytes(numel: int, world: int, fmt: str, block_size: int = 256) -> int:
    """Bytes one rank sends to average ``numel`` values with the two-shot quantized reduction.

    ``world - 1`` quantized chunks in the all-to-all and as many in the all-gather (a rank's own
    chunk does not travel). Compare with ``2 * (world - 1) / world * 4 * numel`` for an fp32 ring
    allreduce.

    Example::

        >>> quantized_allreduce_bytes(2**20, 4, "int8") / (2 * 3 / 4 * 4 * 2**20)
        0.25390625
    """
    return quantized_average_bytes(numel, world, fmt, block_size)


class QuantizedState(ResumableHookState):
    """State of :func:`int8_compress_hook` and :func:`fp8_compress_hook`: group, error feedback, bytes.

    Args:
        process_group: the group gradients are averaged over (WORLD when None).
        error_feedback: keep what quantization rounded off and add it back at the next step.
        block_size: values per quantization block, each with its own float32 scale (even).

    ``bytes_sent`` counts the bytes this rank has sent (host-side arithmetic, no sync).
    ``state_dict()`` / ``load_state_dict()`` save and restore the error memory and the counter, so
    a restored job continues bit-identically.

    Example::

        >>> state = QuantizedState(None, error_feedback=True)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, fp8_compress_hook)  # doctest: +SKIP
    """

    __slots__ = (
        "_averagers",
        "_bytes",
        "_pattern",
        "block_size",
        "error_feedback",
        "shard_error_dict",
    )

    _SETTINGS = ("error_feedback", "block_size")
    _MEMORY = ("error_dict", "shard_error_dict")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        error_feedback: bool = True,
        block_size: int = 256,
    ) -> None:
        super().__init__(process_group)
        self.error_feedback = boolean("error_feedback", error_feedback, "pass False to drop the rounding errors")
        self.block_size = even_int("block_size", block_size, 2, "the default is 256")
        self._bytes = 0
        # Per bucket index: the local rounding error (the padded bucket, in error_dict) and the
        # owner's error of its re-quantized average chunk.
        self.shard_error_dict: dict[int, torch.Tensor] = {}
        # The exchange pattern of dcomm.core.QuantizedAverage ("two_shot" or "all_gather"); every
        # rank must use the same. Internal: for measuring, not an API.
        self._pattern = "two_shot"
        self._averagers: dict[tuple[str, str], QuantizedAverage] = {}

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent through the hook."""
        return self._bytes

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:  # e.g. 0, to count from here on
        self._bytes = non_negative_int("bytes_sent", value, "pass 0 to count from here on")

    def __repr__(self) -> str:
        return (
            f"QuantizedState(error_feedback={self.error_feedback}, block_size={self.block_size}, "
            f"bytes_sent={self.bytes_sent})"
        )

    def _progress(self) -> dict[str, Any]:
        # Older checkpoints may hold "wire" and "passes" (dcomm-ddp 0.1's removed bf16_if_faster)
        # or "cuda_graphs" (the removed graph replay): load_state_dict ignores keys it does not restore.
        return {"bytes_sent": self.bytes_sent}

    def _progress_checks(self, fix: str) -> dict[str, Callable[[str, Any], Any]]:
        return {"bytes_sent": lambda name, value: non_negative_int(name, value, fix)}

    def _restore(self, progress: dict[str, Any]) -> None:
        self._bytes = progress["bytes_sent"]

    def _averager(self, fmt: str) -> QuantizedAverage:
        """The collective for ``fmt``; it keeps each bucket's send and receive buffers between steps."""
        key = (fmt, self._pattern)
        averager = self._averagers.get(key)
        if averager is None:
            averager = self._averagers[key] = QuantizedAverage(fmt, self.block_size, self._pattern)
        return averager

    def _memory(self, key: str, index: int, numel: int, device: torch.device) -> torch.Tensor:
        """A bucket's error memory of ``numel`` values (moved to ``device`` once after a restore).

        A new memory holds -0.0: ``x + (-0.0) == x`` for every ``x``, so it changes nothing.
        """
        memory = getattr(self, key)
        error = memory.get(index)
        if error is not None and error.numel() != numel:
            logger.info("quantized hook: bucket %d changed size (DDP rebuilt its buckets); its error restarts", index)
            error = None
        if error is None:
            error = memory[index] = torch.full((numel,), -0.0, dtype=torch.float32, device=device)
        elif error.device != device:
            error = memory[index] = error.to(device)
        return error


# States for hooks registered with a None state: WORLD, no error feedback; one per group so
# that each group's collectives are ordered.
_DEFAULT_STATES: dict[int, QuantizedState] = {}


def _resolve_state(state: object, hook: str) -> QuantizedState:
    """``state``, or for None the default state of WORLD (no error feedback); a TypeError for anything else."""
    if isinstance(state, QuantizedState):
        return state
    if state is None:
        world = resolve_group(None)
        default = _DEFAULT_STATES.get(id(world))
        if default is None:
            default = _DEFAULT_STATES[id(world)] = QuantizedState(None, error_feedback=False)
        return default
    raise TypeError(
        f"state: {hook} expects a QuantizedState or None, got {type(state).__name__}; register it as "
        f"ddp_model.register_comm_hook(QuantizedState(process_group), {hook})"
    )


def _quantized_average(fmt: str, state: QuantizedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket averaged with the two-shot reduction of quantized codes: a future of the bucket."""
    resolved = resolve_group(state.process_group)  # for this call only: nothing here keeps it
    if resolved.size() == 1:
        return completed_future(bucket.buffer())
    # A bucket out of order (static_graph's first iteration) gets buffers of its own and no error
    # memory: the index no longer names one bucket.
    in_order = state._follows(bucket)
    # Callbacks name the group through the state, never hold it (see powersgd._compress_matrices).
    group = state.process_group
    world = resolved.size()
    buffer = bucket.buffer()
    index, numel = bucket.index(), buffer.numel()
    averager = state._averager(fmt)
    error = shard_error = None
    if state.error_feedback and in_order:
        error = state._memory("error_dict", index, averager.padded_numel(numel, world), buffer.device)
        if averager.shard_numel(numel, world):
            shard_error = state._memory("shard_error_dict", index, averager.shard_numel(numel, world), buffer.device)
    # Encoding runs here, on the hook's stream; the rest on the averager's side stream.
    pending = averager.begin(buffer, group, error=error, shard_error=shard_error, key=index if in_order else None)
    state._bytes += pending.bytes_sent
    return state._chain.run(pending.launch, lambda _: pending.result(), drain=drains_here(bucket, resolved))


def int8_compress_hook(state: QuantizedState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the state's group with block-wise int8 codes (two-shot reduction).

    ``state`` is a :class:`QuantizedState` (error feedback, byte counter) or None (WORLD, no
    error feedback). Each value is off the exact average by at most half a quantization step of
    its block, twice (per rank before the sum, once after); error feedback carries that into the
    next step instead of losing it.

    Example::

        >>> ddp_model.register_comm_hook(QuantizedState(None), int8_compress_hook)  # doctest: +SKIP
    """
    return _quantized_average("int8", _resolve_state(state, "int8_compress_hook"), bucket)


def fp8_compress_hook(state: QuantizedState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like :func:`int8_compress_hook` with fp8 (e4m3) codes: relative error 2^-4 per value.

    fp8 keeps small values of a block better than int8 (it has an exponent) and large ones
    worse (3 mantissa bits). The codes travel as ``uint8`` on every backend.

    Example::

        >>> ddp_model.register_comm_hook(QuantizedState(None), fp8_compress_hook)  # doctest: +SKIP
    """
    return _quantized_average("fp8", _resolve_state(state, "fp8_compress_hook"), bucket)
