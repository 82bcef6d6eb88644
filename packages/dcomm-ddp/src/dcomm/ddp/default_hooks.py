"""DDP communication hooks that average gradients: in full precision, or compressed to fp16/bf16.

Drop-in replacements for ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``: register
them with ``DistributedDataParallel.register_comm_hook(process_group, hook)``, where the state is
the process group to average over (``None`` for WORLD).

- :func:`allreduce_hook` gives bit-identical results to torch's: the bucket is divided by the group
  size, then summed.
- :func:`fp16_compress_hook` and :func:`bf16_compress_hook` cast and divide in one kernel and sum
  the low-precision copy. When DDP's reducer calls them directly, the future holds that
  low-precision sum: the reducer casts it back while it copies the bucket into the gradients, a
  copy it makes anyway, so the hook adds one kernel and no callback work. Called from Python (a
  wrapper such as ZeRO overlap), they keep torch's contract and cast the sum back into the bucket.
  The low-precision copy of each bucket is allocated once and reused. ``bf16_compress_hook`` also
  runs on gloo (CPU), where torch's refuses to register.

Every hook launches its collective on the process group directly (no ``dist.all_reduce``
wrapper): a hook runs once per bucket on the autograd thread, and its host time delays the
kernels of the rest of the backward pass.

Example::

    >>> from dcomm.ddp import bf16_compress_hook  # was: from torch...default_hooks import ...
    >>> ddp_model.register_comm_hook(None, bf16_compress_hook)  # doctest: +SKIP
"""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not with strings.

import functools
import sys
from types import FrameType

import torch
import torch.distributed as dist

from dcomm.core import (
    AveragePlan,
    allreduce_future,
    copy_back,
    divide_into,
    plan_average,
    resolve_group,
    start_allreduce,
)
from dcomm.ddp._backward_works import defer_to_last_bucket

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]

# Attribute on a DDP bucket's flat gradient tensor that holds its reusable low-precision copy. The
# bucket tensor lives as long as the bucket (DDP rebuilds buckets once, after the first step), and
# so does the copy; a rebuilt bucket is a new tensor and gets a new copy.
_LOW_PRECISION_ATTR = "_dcomm_ddp_low_precision"


def _check_group(process_group: object, hook: str) -> dist.ProcessGroup:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group: {hook} expects a ProcessGroup or None as its state, got "
            f"{type(process_group).__name__}; register it as "
            f"ddp_model.register_comm_hook(process_group_or_None, {hook})"
        )
    return resolve_group(process_group)


def _plan(group: dist.ProcessGroup, tensor: torch.Tensor, dtype: torch.dtype) -> AveragePlan:
    """torch's arithmetic for these hooks: divide by the group size, then ``SUM``, on every backend."""
    return _cached_plan(group, dtype, tensor.device)


@functools.lru_cache(maxsize=64)
def _cached_plan(group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> AveragePlan:
    # Worked out once per group, dtype and device: a hook runs once per bucket on the backward's
    # critical path.
    return plan_average(group, dtype, device, arithmetic="predivide", nccl_average=False, nccl_premul=False)


@functools.lru_cache(maxsize=64)
def _in_place_plan(group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> AveragePlan:
    """torch's arithmetic for averaging a bucket in place, with the division inside NCCL's sum when exact.

    NCCL can multiply each rank's input by ``1 / world`` as it sums (``PREMUL_SUM``). For a world
    size that is a power of two the product is the exact quotient, so the result is bit-identical
    to dividing first, and the bucket is not read and written once more before the sum.
    """
    world = dist.get_world_size(group)
    exact = world & (world - 1) == 0
    return plan_average(group, dtype, device, arithmetic="predivide", nccl_average=False, nccl_premul=exact)


def _average(
    group: dist.ProcessGroup, tensor: torch.Tensor, bucket: dist.GradBucket | None
) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` in place over ``group`` (torch's arithmetic); a future of ``tensor``.

    ``bucket``: the bucket DDP's reducer is handing over, whose future may complete at once (see
    :mod:`dcomm.ddp._backward_works`); None for a Python caller, who gets torch's contract.
    """
    plan = _in_place_plan(group, tensor.dtype, tensor.device)
    if bucket is None:
        return allreduce_future(tensor, group, predivide=plan.pre, postdivide=plan.post, op=plan.op)
    if plan.pre != 1.0:
        tensor.div_(plan.pre)  # the in-place plan divides only before the sum
    return defer_to_last_bucket(group, start_allreduce(tensor, group, plan.op), bucket, tensor)


def _low_precision_copy(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bucket's reusable ``dtype`` buffer, allocated on first use.

    Reuse is safe because DDP waits for every bucket's future (and, on CUDA, orders the current
    stream after it) before it calls the hook for the same bucket again.
    """
    low = getattr(buffer, _LOW_PRECISION_ATTR, None)
    if low is None or low.dtype != dtype or low.shape != buffer.shape or low.device != buffer.device:
        low = torch.empty_like(buffer, dtype=dtype, memory_format=torch.contiguous_format)
        setattr(buffer, _LOW_PRECISION_ATTR, low)
    return low


def _called_by_reducer(caller: FrameType | None) -> bool:
    """Whether the hook's caller is DDP's C++ reducer rather than Python code.

    The reducer calls a hook from the autograd engine: on a CUDA device thread there is no Python
    frame above the hook, and on CPU the only one is autograd's engine entry point. Any other
    caller (a wrapping hook) may read ``bucket.buffer()`` and gets torch's contract.
    """
    if caller is None:
        return True
    return caller.f_code.co_name == "_engine_run_backward" and str(caller.f_globals.get("__name__")).startswith(
        "torch.autograd"
    )


def _caller_of_hook(depth: int = 3) -> FrameType | None:
    """The frame that called the public hook, ``depth`` frames above this helper (None: called from C++)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth - 1):
        if frame is None:
            return None
        frame = frame.f_back
    return frame


def _compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket, hook: str
) -> torch.futures.Future[torch.Tensor]:
    group = _check_group(process_group, hook)
    buffer = bucket.buffer()
    if buffer.is_sparse:
        raise ValueError(
            f"bucket: {hook} compresses dense gradients, but this bucket holds a sparse gradient (a "
            "parameter with sparse gradients, e.g. nn.Embedding(sparse=True)); register "
            "dcomm.ddp.allreduce_hook instead, or build the layer with sparse=False"
        )
    return _compressed_average(dtype, group, bucket, _called_by_reducer(_caller_of_hook()))


def _compressed_average(
    dtype: torch.dtype, group: dist.ProcessGroup, bucket: dist.GradBucket, by_reducer: bool
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in place over ``group``, sent in ``dtype``; ``by_reducer``: DDP's reducer called."""
    buffer = bucket.buffer()
    if buffer.dtype == dtype:
        # Already low precision (a half-precision model): average in place, nothing to cast.
        return _average(group, buffer, bucket if by_reducer else None)
    plan = _plan(group, buffer, dtype)
    low = divide_into(_low_precision_copy(buffer, dtype), buffer, plan.pre)  # from fp32: one kernel
    work = start_allreduce(low, group)  # plan.op is SUM: torch's arithmetic
    if by_reducer:
        # DDP copies the result into the gradients in their own dtype: that copy is the cast back.
        return defer_to_last_bucket(group, work, bucket, low)
    fut = work.get_future()

    def cast_back(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        return copy_back(buffer, low)  # cast back into the bucket: one kernel (plan.post is 1)

    return fut.then(cast_back)


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` (WORLD when None) with one allreduce.

    The same arithmetic as torch's ``allreduce_hook`` (divide by the group size, then sum), so
    the results are bit-identical to it.

    Example::

        >>> from dcomm.ddp import allreduce_hook
        >>> ddp_model.register_comm_hook(None, allreduce_hook)  # doctest: +SKIP
    """
    group = _check_group(process_group, "allreduce_hook")
    by_reducer = _called_by_reducer(_caller_of_hook(depth=2))
    return _average(group, bucket.buffer(), bucket if by_reducer else None)


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` (WORLD when None), communicating in fp16.

    The bucket is cast to ``torch.float16`` and divided by the group size in one kernel, summed,
    and cast back into the bucket in its own dtype. Results match torch's ``fp16_compress_hook``
    within fp16 rounding (about 1e-3 relative); values whose fp16 cast would overflow but whose
    average does not stay finite here.

    Example::

        >>> from dcomm.ddp import fp16_compress_hook
        >>> ddp_model.register_comm_hook(None, fp16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.float16, process_group, bucket, "fp16_compress_hook")


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` (WORLD when None), communicating in bf16.

    Like :func:`fp16_compress_hook` with ``torch.bfloat16`` (about 1e-2 relative). It sums with
    ``ReduceOp.SUM`` after dividing, never ``PREMUL_SUM``, and works on gloo as well as NCCL.

    Example::

        >>> from dcomm.ddp import bf16_compress_hook
        >>> ddp_model.register_comm_hook(None, bf16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.bfloat16, process_group, bucket, "bf16_compress_hook")


# DDP refuses a hook whose ``__name__`` is "bf16_compress_hook" unless torch was built with NCCL
# >= 2.10 (torch's hook needs it); this one runs on every backend, so it goes by another name.
bf16_compress_hook.__name__ = "dcomm_bf16_compress_hook"
