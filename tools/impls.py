"""One table of the algorithms that dcomm replaces: each name, torch's object and dcomm's.

The bench and the demo build every algorithm twice, once from each side of this table, so a
name resolves to the same kind of object from either implementation. Objects are imported only
when asked for, so a missing or broken piece is an error of the variant that uses it.

Example::

    >>> resolve("dcomm", "fp16_compress_hook")  # doctest: +SKIP
    <function fp16_compress_hook at 0x...>
    >>> resolve("torch", "fp16_compress_hook").__module__
    'torch.distributed.algorithms.ddp_comm_hooks.default_hooks'
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["IMPLEMENTATIONS", "IMPLS", "resolve"]

IMPLS = ("torch", "dcomm")

_DDP_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
_FSDP_HOOKS = "torch.distributed.algorithms._comm_hooks.default_hooks"
_POST_LOCAL = "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook"
_ZERO_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"
_POWER_SGD = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    # DDP communication hooks
    "allreduce_hook": {"torch": f"{_DDP_HOOKS}:allreduce_hook", "dcomm": "dcomm.ddp:allreduce_hook"},
    "fp16_compress_hook": {"torch": f"{_DDP_HOOKS}:fp16_compress_hook", "dcomm": "dcomm.ddp:fp16_compress_hook"},
    "bf16_compress_hook": {"torch": f"{_DDP_HOOKS}:bf16_compress_hook", "dcomm": "dcomm.ddp:bf16_compress_hook"},
    # post-local SGD and model averaging
    "PostLocalSGDState": {"torch": f"{_POST_LOCAL}:PostLocalSGDState", "dcomm": "dcomm.ddp:PostLocalSGDState"},
    "post_localSGD_hook": {"torch": f"{_POST_LOCAL}:post_localSGD_hook", "dcomm": "dcomm.ddp:post_localSGD_hook"},
    "PeriodicModelAverager": {
        "torch": "torch.distributed.algorithms.model_averaging.averagers:PeriodicModelAverager",
        "dcomm": "dcomm.averaging:PeriodicModelAverager",
    },
    "HierarchicalModelAverager": {
        "torch": "torch.distributed.algorithms.model_averaging.hierarchical_model_averager:HierarchicalModelAverager",
        "dcomm": "dcomm.averaging:HierarchicalModelAverager",
    },
    "PostLocalSGDOptimizer": {
        "torch": "torch.distributed.optim:PostLocalSGDOptimizer",
        "dcomm": "dcomm.averaging:PostLocalSGDOptimizer",
    },
    "average_parameters": {
        "torch": "torch.distributed.algorithms.model_averaging.utils:average_parameters",
        "dcomm": "dcomm.averaging:average_parameters",
    },
    # PowerSGD
    "PowerSGDState": {"torch": f"{_POWER_SGD}:PowerSGDState", "dcomm": "dcomm.ddp:PowerSGDState"},
    "powerSGD_hook": {"torch": f"{_POWER_SGD}:powerSGD_hook", "dcomm": "dcomm.ddp:powerSGD_hook"},
    # ZeRO overlap wrappers
    "hook_with_zero_step": {"torch": f"{_ZERO_HOOKS}:hook_with_zero_step", "dcomm": "dcomm.ddp:hook_with_zero_step"},
    "hook_with_zero_step_interleaved": {
        "torch": f"{_ZERO_HOOKS}:hook_with_zero_step_interleaved",
        "dcomm": "dcomm.ddp:hook_with_zero_step_interleaved",
    },
    # FSDP (FullyShardedDataParallel) communication hooks and their states
    "fsdp.allreduce_hook": {"torch": f"{_FSDP_HOOKS}:allreduce_hook", "dcomm": "dcomm.fsdp:allreduce_hook"},
    "fsdp.reduce_scatter_hook": {
        "torch": f"{_FSDP_HOOKS}:reduce_scatter_hook",
        "dcomm": "dcomm.fsdp:reduce_scatter_hook",
    },
    "fsdp.fp16_compress_hook": {"torch": f"{_FSDP_HOOKS}:fp16_compress_hook", "dcomm": "dcomm.fsdp:fp16_compress_hook"},
    "fsdp.bf16_compress_hook": {"torch": f"{_FSDP_HOOKS}:bf16_compress_hook", "dcomm": "dcomm.fsdp:bf16_compress_hook"},
    "DefaultState": {"torch": f"{_FSDP_HOOKS}:DefaultState", "dcomm": "dcomm.core:DefaultState"},
    "LowPrecisionState": {"torch": f"{_FSDP_HOOKS}:LowPrecisionState", "dcomm": "dcomm.core:LowPrecisionState"},
}


def resolve(impl: str, name: str) -> Any:
    """The object called ``name`` in implementation ``impl`` (``'torch'`` or ``'dcomm'``)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"name: {name!r} is not in the implementation table; known: {sorted(IMPLEMENTATIONS)}")
    module_name, attribute = IMPLEMENTATIONS[name][impl].split(":")
    return getattr(importlib.import_module(module_name), attribute)
