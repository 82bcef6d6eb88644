"""One table of "torch's implementation or dcomm's" under the same names, so one loop drives both.

Example::

    >>> lib = implementation("torch")
    >>> lib.PeriodicModelAverager.__module__
    'torch.distributed.algorithms.model_averaging.averagers'
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

__all__ = ["IMPLEMENTATIONS", "implementation"]

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "torch": {
        "PeriodicModelAverager": "torch.distributed.algorithms.model_averaging.averagers:PeriodicModelAverager",
        "HierarchicalModelAverager": (
            "torch.distributed.algorithms.model_averaging.hierarchical_model_averager:HierarchicalModelAverager"
        ),
        "PostLocalSGDOptimizer": "torch.distributed.optim:PostLocalSGDOptimizer",
        "PostLocalSGDState": "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook:PostLocalSGDState",
        "post_localSGD_hook": "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook:post_localSGD_hook",
        "average_parameters": "torch.distributed.algorithms.model_averaging.utils:average_parameters",
    },
    "dcomm": {
        "PeriodicModelAverager": "dcomm.averaging:PeriodicModelAverager",
        "HierarchicalModelAverager": "dcomm.averaging:HierarchicalModelAverager",
        "PostLocalSGDOptimizer": "dcomm.averaging:PostLocalSGDOptimizer",
        "PostLocalSGDState": "dcomm.ddp:PostLocalSGDState",
        "post_localSGD_hook": "dcomm.ddp:post_localSGD_hook",
        "average_parameters": "dcomm.averaging:average_parameters",
    },
}
"""For each side, each name mapped to ``"module:attribute"`` (imported on first use)."""


def implementation(side: str) -> SimpleNamespace:
    """The objects of ``side`` ("torch" or "dcomm") under the shared names.

    Example::

        >>> implementation("dcomm").post_localSGD_hook.__module__  # doctest: +SKIP
        'dcomm.ddp.post_local_sgd'
    """
    if side not in IMPLEMENTATIONS:
        raise ValueError(f"side: expected one of {sorted(IMPLEMENTATIONS)}, got {side!r}")
    objects = {}
    for name, target in IMPLEMENTATIONS[side].items():
        module, attribute = target.split(":")
        objects[name] = getattr(importlib.import_module(module), attribute)
    return SimpleNamespace(**objects)
