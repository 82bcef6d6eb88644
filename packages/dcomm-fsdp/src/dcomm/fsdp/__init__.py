"""dcomm.fsdp: FSDP communication hooks and low-precision gradient reduction for fully_shard.

A drop-in for ``torch.distributed.algorithms._comm_hooks``: the same hook names and signatures,
used with the state classes of :mod:`dcomm.core`, plus :func:`use_low_precision_reduction` for
FSDP2 (``fully_shard``) modules, which have no ``register_comm_hook``, and
:func:`use_quantized_reduction` for an int8/fp8 reduce-scatter.

Example::

    >>> from dcomm.core import LowPrecisionState
    >>> from dcomm.fsdp import bf16_compress_hook
    >>> model.register_comm_hook(LowPrecisionState(dist.group.WORLD), bf16_compress_hook)  # doctest: +SKIP
"""

from dcomm.core import DefaultState, LowPrecisionState
from dcomm.fsdp.__about__ import __version__
from dcomm.fsdp.fully_shard import LowPrecisionReduceScatter, low_precision_mp_policy, use_low_precision_reduction
from dcomm.fsdp.hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook, reduce_scatter_hook
from dcomm.fsdp.quantized_reduction import QuantizedReduceScatter, use_quantized_reduction
from dcomm.fsdp.registration import register_comm_hook

__all__ = [
    "__version__",
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "reduce_scatter_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "register_comm_hook",
    "LowPrecisionReduceScatter",
    "low_precision_mp_policy",
    "use_low_precision_reduction",
    "QuantizedReduceScatter",
    "use_quantized_reduction",
]
