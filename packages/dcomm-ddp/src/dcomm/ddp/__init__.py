"""dcomm.ddp: DDP communication hooks, a one-line import change from torch's.

``from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook``
becomes ``from dcomm.ddp import fp16_compress_hook``; the names, signatures and results are
torch's, and post-local SGD can be checkpointed. Importing it changes nothing in torch.
:func:`register_comm_hook` is the explicit C++ fast path for the averaging and ZeRO overlap hooks.

Example::

    >>> from dcomm.ddp import PostLocalSGDState, post_localSGD_hook
    >>> state = PostLocalSGDState(None, None, start_localSGD_iter=100)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, post_localSGD_hook)  # doctest: +SKIP
    >>> import dcomm.ddp
    >>> dcomm.ddp.register_comm_hook(other_model, None, dcomm.ddp.bf16_compress_hook)  # doctest: +SKIP
    'native'
"""

from dcomm.ddp.__about__ import __version__
from dcomm.ddp.compress_wrappers import bf16_compress_wrapper, fp16_compress_wrapper
from dcomm.ddp.default_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from dcomm.ddp.native_hooks import native_hooks_available, register_comm_hook
from dcomm.ddp.post_local_sgd import PostLocalSGDState, post_localSGD_hook
from dcomm.ddp.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from dcomm.ddp.quantized_hooks import (
    QuantizedState,
    fp8_compress_hook,
    int8_compress_hook,
    quantized_allreduce_bytes,
)
from dcomm.ddp.zero_overlap import (
    fallback_count,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    load_zero_state_dict,
    wait_for_parameters,
    zero_state_dict,
)

__all__ = [
    "__version__",
    # default_hooks
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    # native_hooks
    "register_comm_hook",
    "native_hooks_available",
    # compress_wrappers
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    # post_local_sgd
    "PostLocalSGDState",
    "post_localSGD_hook",
    # powersgd
    "PowerSGDState",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    # quantized_hooks
    "QuantizedState",
    "int8_compress_hook",
    "fp8_compress_hook",
    "quantized_allreduce_bytes",
    # zero_overlap
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "fallback_count",
    "wait_for_parameters",
    "zero_state_dict",
    "load_zero_state_dict",
]
