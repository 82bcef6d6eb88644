"""int8/fp8 (e4m3) gradient reduce-scatter for ``fully_shard`` (FSDP2): a quarter of fp32's bytes.

The sibling of :func:`~dcomm.fsdp.use_low_precision_reduction` for block quantization
(:mod:`dcomm.core.quantization`, one float32 scale per 256 values). FSDP2 hands its
reduce-scatter the flat gradients as one chunk per rank; :class:`QuantizedReduceScatter`
quantizes each chunk, sends chunk ``r`` to rank ``r`` with one all-to-all of ``uint8`` rows
(so fp8 also runs on gloo), and rank ``r`` dequantizes every peer's copy and averages them in
fp32 into its shard. Each rank sends ``world - 1`` quantized chunks: about
``(1 + 4 / block_size) / 4`` of an fp32 reduce-scatter.

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> from dcomm.fsdp import use_quantized_reduction
    >>> fully_shard(model)  # doctest: +SKIP
    >>> comm = use_quantized_reduction(model, "int8")  # doctest: +SKIP
    >>> comm.bytes_sent  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dcomm.core import keep_until_stream_done
from dcomm.core.quantization import dequantize_rows, quantize_rows
from dcomm.core.validation import even_int
from dcomm.fsdp._custom_reduce_scatter import AveragingReduceScatter, check_sizes, install_reduce_scatter

__all__ = ["QUANTIZED_REDUCTION_DTYPES", "QuantizedReduceScatter", "use_quantized_reduction"]

QUANTIZED_REDUCTION_DTYPES = ("int8", "fp8")


class QuantizedReduceScatter(AveragingReduceScatter):
    """A custom FSDP2 reduce-scatter that averages block-quantized int8 or fp8 chunks.

    FSDP2 calls it as ``comm(output_tensor, input_tensor, group, op)``; ``op`` must be ``SUM``
    (set up by :func:`use_quantized_reduction`, which turns off FSDP2's own division). The
    collective is synchronous on the calling (FSDP2's reduce-scatter) stream, and its buffers are
    tied to that stream. ``bytes_sent`` counts the bytes this rank has sent.

    Args:
        dtype: ``"int8"`` or ``"fp8"`` (e4m3), the format of the quantized chunks.
        block_size: values per float32 scale, an even number >= 2 (256 by default).

    Raises:
        ValueError: another ``dtype`` or a bad ``block_size``; on a call, ``op`` is not ``SUM`` or
            the input is not ``world`` times the output.

    Example::

        >>> fsdp_module.set_custom_reduce_scatter(QuantizedReduceScatter("fp8"))  # doctest: +SKIP
    """

    __slots__ = ("block_size", "bytes_sent", "dtype")
    installer = "use_quantized_reduction"

    def __init__(self, dtype: str = "int8", block_size: int = 256) -> None:
        if dtype not in QUANTIZED_REDUCTION_DTYPES:
            raise ValueError(
                f"dtype: expected one of {QUANTIZED_REDUCTION_DTYPES}, got {dtype!r}; for fp16/bf16 use "
                "dcomm.fsdp.use_low_precision_reduction"
            )
        self.dtype = dtype
        self.block_size = even_int("block_size", block_size, 2, "the default is 256")
        self.bytes_sent = 0

    def __repr__(self) -> str:
        return f"QuantizedReduceScatter(dtype={self.dtype!r}, block_size={self.block_size})"

    def _reduce_scatter(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Quantize each rank's chunk, exchange the chunks all-to-all, average the dequantized copies."""
        world = dist.get_world_size(group)
        check_sizes(output_tensor, input_tensor, world)
        if world == 1:
            output_tensor.copy_(input_tensor.view_as(output_tensor))
            return
        shard = output_tensor.numel()
        block = self.block_size
        cols = -(-shard // block) * block
        rows = input_tensor.view(world, shard)
        if cols != shard:  # pad each chunk to whole blocks
            rows = torch.nn.functional.pad(rows, (0, cols - shard))
        send = quantize_rows(rows, self.dtype, block)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        average = dequantize_rows(recv, self.dtype, cols, block).sum(0).div_(world)
        output_tensor.copy_(average[:shard].view_as(output_tensor))
        keep_until_stream_done(send)
        keep_until_stream_done(recv)
        self.bytes_sent += (world - 1) * send.shape[1]


def use_quantized_reduction(module: nn.Module, dtype: str = "int8", block_size: int = 256) -> QuantizedReduceScatter:
    """Make every ``fully_shard`` module in ``module`` reduce-scatter gradients as int8 or fp8 blocks.

    Call it after ``fully_shard`` and before the first backward. Each FSDP2 module under (and
    including) ``module`` gets one shared :class:`QuantizedReduceScatter`, a gradient divide
    factor of 1 and SUM-only reductions, so the average is taken once, in fp32, from the
    dequantized chunks. Each value of the averaged shard is off the exact average by at most the
    ranks' mean rounding error: half a step of its block (int8: 1/254 of the block maximum; fp8:
    2^-4 of the value). There is no error feedback, so use it where that rounding is acceptable
    (large data-parallel jobs on a slow link); on a fast link fp16/bf16 are the safer choice.

    Args:
        module: a model with ``fully_shard`` applied to it or to its submodules.
        dtype: ``"int8"`` or ``"fp8"``.
        block_size: values per float32 scale (even, >= 2).

    Returns:
        The installed :class:`QuantizedReduceScatter` (its ``bytes_sent`` counts this rank's bytes).

    Raises:
        ValueError: a dtype other than "int8"/"fp8", a module without ``fully_shard``, or HSDP (a
            2-D mesh with replication).
        RuntimeError: a torch without the FSDP2 methods.

    Example::

        >>> fully_shard(model)  # doctest: +SKIP
        >>> use_quantized_reduction(model, "fp8")  # doctest: +SKIP
        QuantizedReduceScatter(dtype='fp8', block_size=256)
    """
    comm = QuantizedReduceScatter(dtype, block_size)
    install_reduce_scatter(module, comm)
    return comm
