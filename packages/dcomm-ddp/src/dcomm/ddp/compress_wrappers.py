"""Wrap any DDP comm hook so that it communicates the bucket in fp16 or bf16.

Drop-in replacements for torch's ``fp16_compress_wrapper`` and ``bf16_compress_wrapper``
(``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``): the wrapped hook sees a
low-precision bucket, and its result is cast back into the bucket's own dtype. With
:func:`~dcomm.ddp.allreduce_hook` this is what :func:`~dcomm.ddp.fp16_compress_hook` does; the
wrappers exist for other hooks, such as PowerSGD.

Example::

    >>> from dcomm.ddp import allreduce_hook, bf16_compress_wrapper
    >>> ddp_model.register_comm_hook(None, bf16_compress_wrapper(allreduce_hook))  # doctest: +SKIP
"""

# No ``from __future__ import annotations``: DDP compares the wrapped hook's annotations with the
# real ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not with strings.

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import copy_back

__all__ = ["bf16_compress_wrapper", "fp16_compress_wrapper"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _compress_wrapper(hook: Hook, dtype: torch.dtype, wrapper: str) -> Hook:
    if not callable(hook):
        raise TypeError(
            f"hook: {wrapper} expects a DDP comm hook (state, bucket) -> Future, got {type(hook).__name__}; "
            f"pass e.g. {wrapper}(dcomm.ddp.allreduce_hook)"
        )

    def compressed_hook(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if buffer.dtype == dtype:
            return hook(hook_state, bucket)
        bucket.set_buffer(buffer.to(dtype))

        def cast_back(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            return copy_back(buffer, fut.value())  # one kernel, into the full-precision bucket

        return hook(hook_state, bucket).then(cast_back)

    # DDP refuses a hook named "bf16_compress_wrapper_hook" unless torch was built with NCCL >= 2.10
    # (torch's needs it); this one runs on every backend, so it goes by another name.
    compressed_hook.__name__ = compressed_hook.__qualname__ = f"dcomm_{wrapper}_hook"
    return compressed_hook


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Make ``hook`` communicate in ``torch.float16`` and cast its result back to the bucket's dtype.

    The wrapped hook receives the bucket cast to fp16 (``bucket.buffer()`` is the fp16 copy);
    when its future completes, the result is written back into the original bucket in one
    kernel. A bucket that is already fp16 goes to ``hook`` unchanged.
    ``fp16_compress_wrapper(allreduce_hook)`` matches torch's ``fp16_compress_hook``.

    Example::

        >>> from dcomm.ddp import allreduce_hook, fp16_compress_wrapper
        >>> ddp_model.register_comm_hook(None, fp16_compress_wrapper(allreduce_hook))  # doctest: +SKIP
    """
    return _compress_wrapper(hook, torch.float16, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Make ``hook`` communicate in ``torch.bfloat16`` and cast its result back to the bucket's dtype.

    Like :func:`fp16_compress_wrapper` with ``torch.bfloat16``; it runs on gloo as well as NCCL
    (torch's wrapper needs NCCL >= 2.10 only because its ``bf16_compress_hook`` does).

    Example::

        >>> from dcomm.ddp import allreduce_hook, bf16_compress_wrapper
        >>> ddp_model.register_comm_hook(None, bf16_compress_wrapper(allreduce_hook))  # doctest: +SKIP
    """
    return _compress_wrapper(hook, torch.bfloat16, "bf16_compress_wrapper")
