"""DDP communication hooks that average gradients: in full precision, or compressed to fp16/bf16.

Drop-in replacements for ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``: register
them with ``DistributedDataParallel.register_comm_hook(process_group, hook)``, where the state is
the process group to average over (``None`` for WORLD). Each does torch's arithmetic, so the
gradients are bit-identical to torch's hook of the same name, and keeps torch's contract whoever
calls it: the returned future holds the averaged bucket, in the bucket's own dtype.

- :func:`allreduce_hook`: divide the bucket by the group size, then sum it.
- :func:`fp16_compress_hook`, :func:`bf16_compress_hook`: cast the bucket, divide the copy by the
  group size, sum it, and copy the sum back into the bucket. ``bf16_compress_hook`` also runs on
  gloo (CPU), where torch's refuses to register.

Each hook launches its collective on the process group directly (no ``dist.all_reduce`` checks).
:func:`dcomm.ddp.register_comm_hook` runs the same arithmetic in C++ on DDP's reducer, where built.

Example::

    >>> from dcomm.ddp import bf16_compress_hook  # was: from torch...default_hooks import ...
    >>> ddp_model.register_comm_hook(None, bf16_compress_hook)  # doctest: +SKIP
"""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not with strings.

import torch
import torch.distributed as dist

from dcomm.core import allreduce_future, resolve_group, start_allreduce

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


def _check_group(process_group: object, hook: str) -> dist.ProcessGroup:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group: {hook} expects a ProcessGroup or None as its state, got "
            f"{type(process_group).__name__}; register it as "
            f"ddp_model.register_comm_hook(process_group_or_None, {hook})"
        )
    return resolve_group(process_group)


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
    compressed = buffer.to(dtype).div_(group.size())  # the bucket itself when already in ``dtype``

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])  # re-raises a failed allreduce

    return start_allreduce(compressed, group).get_future().then(decompress)


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` (WORLD when None) with one allreduce.

    The bucket is divided by the group size, then summed in place: torch's ``allreduce_hook``'s
    arithmetic, so the results are bit-identical to it.

    Args:
        process_group: the group to average over (None: WORLD).
        bucket: DDP's bucket of gradients.

    Returns:
        A future of the bucket, averaged.

    Raises:
        TypeError: ``process_group`` is neither a ProcessGroup nor None.

    Example::

        >>> from dcomm.ddp import allreduce_hook
        >>> ddp_model.register_comm_hook(None, allreduce_hook)  # doctest: +SKIP
    """
    group = _check_group(process_group, "allreduce_hook")
    return allreduce_future(bucket.buffer(), group, predivide=group.size())


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` (WORLD when None), communicating in fp16.

    The bucket is cast to ``torch.float16``, divided by the group size, summed, and copied back
    into the bucket in its own dtype: torch's ``fp16_compress_hook``'s arithmetic, bit for bit.

    Args:
        process_group: the group to average over (None: WORLD).
        bucket: DDP's bucket of gradients (dense).

    Returns:
        A future of the bucket, averaged, in the bucket's own dtype.

    Raises:
        TypeError: ``process_group`` is neither a ProcessGroup nor None.
        ValueError: the bucket holds a sparse gradient.

    Example::

        >>> from dcomm.ddp import fp16_compress_hook
        >>> ddp_model.register_comm_hook(None, fp16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.float16, process_group, bucket, "fp16_compress_hook")


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` (WORLD when None), communicating in bf16.

    Like :func:`fp16_compress_hook` with ``torch.bfloat16``, bit-identical to torch's
    ``bf16_compress_hook``. It sums with ``ReduceOp.SUM`` after dividing, never ``PREMUL_SUM``,
    and works on gloo as well as NCCL.

    Args:
        process_group: the group to average over (None: WORLD).
        bucket: DDP's bucket of gradients (dense).

    Returns:
        A future of the bucket, averaged, in the bucket's own dtype.

    Raises:
        TypeError: ``process_group`` is neither a ProcessGroup nor None.
        ValueError: the bucket holds a sparse gradient.

    Example::

        >>> from dcomm.ddp import bf16_compress_hook
        >>> ddp_model.register_comm_hook(None, bf16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.bfloat16, process_group, bucket, "bf16_compress_hook")


# DDP refuses a hook whose ``__name__`` is "bf16_compress_hook" unless torch was built with NCCL
# >= 2.10 (torch's hook needs it); this one runs on every backend, so it goes by another name.
bf16_compress_hook.__name__ = "dcomm_bf16_compress_hook"
