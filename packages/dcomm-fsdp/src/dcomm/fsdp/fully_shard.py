"""fp16/bf16 gradient reduction with pre/post division for ``fully_shard`` (FSDP2) modules.

FSDP2 has no ``register_comm_hook``. It does let a module replace its reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``) and turn off its own gradient division
(``set_gradient_divide_factor(1.0)`` with ``set_force_sum_reduction_for_comms(True)``).
:func:`use_low_precision_reduction` does both on every ``fully_shard`` module of a model: FSDP2
still copies the gradients into its reduce-scatter input in its reduce dtype, and
:class:`LowPrecisionReduceScatter` casts that input to fp16/bf16 divided by the pre-divide factor,
sums it with a plain ``SUM`` reduce-scatter (no ``ReduceOp.AVG``, no ``PREMUL_SUM``: works on gloo
and NCCL alike), and writes the shard back in the reduce dtype divided by the post-divide factor.

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> from dcomm.fsdp import use_low_precision_reduction
    >>> for block in model.blocks:  # doctest: +SKIP
    ...     fully_shard(block)
    >>> fully_shard(model)  # doctest: +SKIP
    >>> use_low_precision_reduction(model, torch.bfloat16)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dcomm.core import LOW_PRECISION_DTYPES, cast_for_communication, copy_back, divide_factors, keep_until_stream_done

__all__ = ["LowPrecisionReduceScatter", "use_low_precision_reduction"]

# The FSDPModule methods this needs; all exist in every torch that dcomm-fsdp supports (>= 2.11).
_REQUIRED_METHODS = ("set_custom_reduce_scatter", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms")
_MIN_TORCH = "2.11"


class _CompletedWork:
    """What ``async_op=True`` returns: the work already finished on the current stream."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


class LowPrecisionReduceScatter:
    """A custom FSDP2 reduce-scatter that communicates in ``dtype`` and averages with pre/post divide.

    FSDP2 calls it as ``comm(output_tensor, input_tensor, group, op)`` on its reduce-scatter
    stream; ``op`` must be ``SUM`` (set up by :func:`use_low_precision_reduction`). The input is
    cast to ``dtype`` divided by the pre-divide factor of ``group``'s size, reduce-scattered, and
    the shard is written into ``output_tensor`` (in its own dtype) divided by the post-divide
    factor. The low-precision buffers are allocated on, and tied to, the stream that runs the
    collective, and the collective is synchronous with respect to that stream, so their memory is
    never reused while the reduce-scatter is in flight.

    Example::

        >>> fsdp_module.set_custom_reduce_scatter(LowPrecisionReduceScatter(torch.float16))  # doctest: +SKIP
    """

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(
                f"dtype: expected torch.float16 or torch.bfloat16, got {dtype!r}; "
                "pass the dtype to communicate gradients in"
            )
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"LowPrecisionReduceScatter(dtype={self.dtype})"

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Allocate FSDP2's reduce-scatter input/output buffer (plain caching allocator).

        Example::

            >>> LowPrecisionReduceScatter().allocate((4,), dtype=torch.float32, device=torch.device("cpu")).shape
            torch.Size([4])
        """
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> _CompletedWork | None:
        """Reduce-scatter the average of ``input_tensor`` over ``group`` into ``output_tensor``.

        Example::

            >>> LowPrecisionReduceScatter(torch.float16)(shard, flat_grad, dist.group.WORLD)  # doctest: +SKIP
        """
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"op: LowPrecisionReduceScatter divides by itself and needs ReduceOp.SUM, got {op}; "
                "install it with dcomm.fsdp.use_low_precision_reduction(module), which turns off "
                "FSDP's own averaging, instead of set_custom_reduce_scatter alone"
            )
        world = dist.get_world_size(group)
        if input_tensor.numel() != output_tensor.numel() * world:
            raise ValueError(
                f"input_tensor: expected {output_tensor.numel() * world} elements (output numel "
                f"{output_tensor.numel()} x group size {world}), got {input_tensor.numel()}"
            )
        pre, post = divide_factors(world)
        low_input = cast_for_communication(input_tensor, self.dtype, pre)
        low_output = torch.empty_like(output_tensor, dtype=self.dtype)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(low_output, low_input, group=group)
        copy_back(output_tensor, low_output, post)
        keep_until_stream_done(low_input)
        keep_until_stream_done(low_output)
        return _CompletedWork() if async_op else None


def _fsdp_module_class() -> type:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as exc:  # pragma: no cover - torch < 2.6
        raise RuntimeError(
            f"use_low_precision_reduction needs torch.distributed.fsdp.FSDPModule (fully_shard), "
            f"which torch {torch.__version__} lacks; upgrade to torch >= {_MIN_TORCH}"
        ) from exc
    missing = [name for name in _REQUIRED_METHODS if not hasattr(FSDPModule, name)]
    if missing:
        raise RuntimeError(
            f"use_low_precision_reduction needs FSDPModule.{', FSDPModule.'.join(missing)}, which torch "
            f"{torch.__version__} lacks; upgrade to torch >= {_MIN_TORCH}"
        )
    return FSDPModule


def _check_not_hsdp(module: nn.Module) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    for name, param in module.named_parameters():
        if isinstance(param, DTensor) and any(isinstance(p, Replicate) for p in param.placements):
            raise ValueError(
                f"module: parameter {name!r} is replicated over a dimension of mesh "
                f"{tuple(param.device_mesh.shape)} (HSDP), whose all-reduce this reduce-scatter cannot "
                "average; use a 1-D mesh, or MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) for HSDP"
            )


def use_low_precision_reduction(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> LowPrecisionReduceScatter:
    """Make every ``fully_shard`` module in ``module`` reduce gradients in ``dtype`` (fp16 or bf16).

    Call it after ``fully_shard`` and before the first backward. Each FSDP2 module under (and
    including) ``module`` gets a :class:`LowPrecisionReduceScatter`, a gradient divide factor of 1
    and SUM-only reductions, so the averaging is done once, by dcomm's pre/post divide. The sharded
    gradients keep FSDP2's usual dtype (the parameter dtype, or ``MixedPrecisionPolicy.reduce_dtype``
    cast back to it). Returns the installed reduce-scatter.

    Raises ``ValueError`` for a dtype other than fp16/bf16, a module without ``fully_shard``, or
    HSDP (a 2-D mesh with replication); ``RuntimeError`` on a torch without the FSDP2 methods.

    Example::

        >>> fully_shard(model)  # doctest: +SKIP
        >>> use_low_precision_reduction(model, torch.float16)  # doctest: +SKIP
        LowPrecisionReduceScatter(dtype=torch.float16)
    """
    comm = LowPrecisionReduceScatter(dtype)
    fsdp_module = _fsdp_module_class()
    targets = [m for m in module.modules() if isinstance(m, fsdp_module)]
    if not targets:
        raise ValueError(
            f"module: no fully_shard module in {type(module).__name__}; call "
            "torch.distributed.fsdp.fully_shard(module) first (for FullyShardedDataParallel use "
            "register_comm_hook with dcomm.fsdp.fp16_compress_hook or bf16_compress_hook)"
        )
    _check_not_hsdp(module)
    for target in targets:
        target.set_custom_reduce_scatter(comm)
        target.set_gradient_divide_factor(1.0)
        target.set_force_sum_reduction_for_comms(True)
    return comm
