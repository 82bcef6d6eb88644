"""How to average over a process group, decided in one place: :func:`plan_average`.

Every averaging in dcomm is a reduction between two divisions: divide by ``pre``, reduce with
``op``, divide by ``post``. Which ``op`` and divisors depends on the dtype, the backend and the
arithmetic a caller must reproduce:

- ``"predivide"``: divide by the group size, then ``SUM`` (torch's DDP hooks and
  ``average_parameters``: the same operations).
- ``"split"``: divide by :func:`divide_factors` before and after a ``SUM`` (torch's FSDP
  hooks; keeps fp16 sums from overflowing and small gradients from underflowing).
- ``"postdivide"``: ``SUM``, then divide by the group size. Exact for bf16 (its exponent range
  is float32's), so it gives the ``"split"`` result with one division pass fewer.
- ``None`` (the default): the best of these for the dtype: fp32/fp64 ``"predivide"``, bf16
  ``"postdivide"``, fp16 ``"split"``.

Where NCCL reduces, ``nccl_average`` lets fp32/fp64/bf16 use ``ReduceOp.AVG`` (no division
pass) and ``nccl_premul`` lets a power-of-two pre-division fold into NCCL's pre-multiplied sum
(exact: the product is the quotient). Never for bf16: torch hands NCCL a float32 factor for a
bf16 pre-multiplied sum, which NCCL reads as a bf16 one (a factor near zero). Neither exists on
gloo.

Example::

    >>> plan = plan_average(group, torch.bfloat16, grad.device)  # doctest: +SKIP
    >>> average_sync(grad, group, plan)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dcomm.core.collectives import reduce_scatter_single, reduced_by_nccl, resolve_group
from dcomm.core.divide_factors import divide_factors
from dcomm.core.torch_private import make_nccl_premul_sum
from dcomm.core.validation import one_of

__all__ = ["ARITHMETICS", "AveragePlan", "average_sync", "plan_average"]

ARITHMETICS = ("predivide", "split", "postdivide")

_NCCL_AVG_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_BEST_ARITHMETIC = {torch.bfloat16: "postdivide", torch.float16: "split"}


class AveragePlan(NamedTuple):
    """Divide by ``pre``, reduce with ``op``, divide by ``post`` (a divisor of 1 is skipped).

    Example::

        >>> op, pre, post = AveragePlan(dist.ReduceOp.SUM, 4.0, 1.0)
    """

    op: Any
    pre: float
    post: float


def _divisors(arithmetic: str, world: int) -> tuple[float, float]:
    if arithmetic == "predivide":
        return float(world), 1.0
    if arithmetic == "postdivide":
        return 1.0, float(world)
    return divide_factors(world)


def plan_average(
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
    device: torch.device,
    *,
    arithmetic: str | None = None,
    factors: tuple[float, float] | None = None,
    nccl_average: bool = True,
    nccl_premul: bool = True,
) -> AveragePlan:
    """The reduce op and divisors that average ``dtype`` tensors on ``device`` over ``group``.

    One rank needs no communication arithmetic: ``(SUM, 1, 1)`` (unless ``factors`` say otherwise).

    Args:
        group: the process group (WORLD when None).
        dtype: the dtype of the tensors reduced.
        device: where they are (NCCL-only ops apply to CUDA tensors on an NCCL group).
        arithmetic: ``"predivide"``, ``"split"``, ``"postdivide"`` or None (see the module docstring).
        factors: ``(pre, post)`` divisors chosen by the caller (a hook state's, which a user may
            set), taken instead of the arithmetic's.
        nccl_average: allow ``ReduceOp.AVG`` for fp32/fp64/bf16 where NCCL reduces.
        nccl_premul: allow NCCL's pre-multiplied sum to take a power-of-two pre-division (not bf16).

    Returns:
        The :class:`AveragePlan`.

    Raises:
        ValueError: ``arithmetic`` is not one of :data:`ARITHMETICS` or None.

    Example::

        >>> plan_average(dist.group.WORLD, torch.float32, torch.device("cpu"))  # world 4  # doctest: +SKIP
        AveragePlan(op=<RedOpType.SUM: 0>, pre=4.0, post=1.0)
    """
    group = resolve_group(group)
    world = dist.get_world_size(group)
    if factors is not None:
        pre, post = factors
    elif world == 1:
        return AveragePlan(dist.ReduceOp.SUM, 1.0, 1.0)
    else:
        if arithmetic is None:
            arithmetic = _BEST_ARITHMETIC.get(dtype, "predivide")
        one_of("arithmetic", arithmetic, ARITHMETICS, "pass None for the best arithmetic of the dtype")
        pre, post = _divisors(arithmetic, world)
    if world > 1 and (nccl_average or nccl_premul) and reduced_by_nccl(group, device):
        if nccl_average and dtype in _NCCL_AVG_DTYPES:
            return AveragePlan(dist.ReduceOp.AVG, 1.0, 1.0)  # NCCL divides inside the sum
        if nccl_premul and pre > 1 and _premul_is_exact(dtype, pre):
            return AveragePlan(make_nccl_premul_sum(1.0 / pre), 1.0, post)
    return AveragePlan(dist.ReduceOp.SUM, pre, post)


def _premul_is_exact(dtype: torch.dtype, divisor: float) -> bool:
    """Whether NCCL's sum pre-multiplied by ``1 / divisor`` gives the bits of dividing first.

    Only for a power of two (the product is then the quotient) and never for bf16 (see the
    module docstring).
    """
    return dtype != torch.bfloat16 and math.frexp(divisor)[0] == 0.5


def average_sync(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    plan: AveragePlan,
    *,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply ``plan``: divide ``tensor``, allreduce it (or reduce-scatter into ``output``), divide the result.

    Synchronous with respect to the current stream.

    Args:
        tensor: the tensor to average, changed in place (divided, then reduced).
        group: the process group (WORLD when None).
        plan: from :func:`plan_average`.
        output: where to reduce-scatter ``tensor`` (this rank's shard), or None to allreduce it.

    Returns:
        The averaged tensor: ``output`` when given, else ``tensor``.

    Example::

        >>> average_sync(shard_input, group, plan, output=shard)  # doctest: +SKIP
    """
    group = resolve_group(group)
    if plan.pre != 1.0:
        tensor.div_(plan.pre)
    if output is None:
        dist.all_reduce(tensor, op=plan.op, group=group)
        result = tensor
    else:
        reduce_scatter_single(output, tensor, group, op=plan.op)
        result = output
    if plan.post != 1.0:
        result.div_(plan.post)
    return result
