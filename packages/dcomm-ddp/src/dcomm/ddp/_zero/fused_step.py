"""The local step of ZeRO overlap in torch's fused Adam kernel, where the user left Adam's implementation to torch.

torch's Adam and AdamW default to their ``foreach`` implementation on CUDA: a dozen passes over
the parameters, their gradients and the two moments per step. Their ``fused=True`` kernel makes
one pass with the same update (up to float rounding). A rank's shard of a large model is
hundreds of MB, so the passes cost GPU time per step that no overlap can hide on a GPU kept busy
by backward's GEMMs (measured in ``docs/design/zero-overlap.md``). So where neither ``foreach`` nor ``fused``
was given (and nothing fused cannot do was asked: ``differentiable``, tensor hyperparameters,
parameters off CUDA), the overlap hooks step with ``fused=True``. The optimizer's
``param_groups`` keep ``fused=None`` between steps, so state dicts keep torch's format; the step
counters, which the fused kernel keeps on the device, are moved there before the first fused step
(after a checkpoint was loaded, for one).

Example::

    >>> opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    >>> fusable(opt)  # CPU parameters: torch's own default stays
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["fusable", "fused"]

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HYPERPARAMETERS = ("lr", "betas", "weight_decay", "eps")


def fusable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may step with ``fused=True``: torch's own Adam or AdamW left to its default.

    Not a subclass (it may step otherwise), not where ``foreach`` or ``fused`` was chosen, nor
    with ``differentiable`` or a tensor hyperparameter, and only with every parameter a CUDA
    floating-point tensor.
    """
    if type(optimizer) not in _FUSABLE:
        return False
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
            return False
        values = [group.get(name) for name in _HYPERPARAMETERS]
        flat = [v for value in values for v in (value if isinstance(value, tuple) else (value,))]
        if any(torch.is_tensor(v) for v in flat):
            return False
        if not all(p.is_cuda and p.dtype in _FUSED_DTYPES for p in group["params"]):
            return False
    return True


@contextlib.contextmanager
def fused(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer.step()`` inside runs fused (see :func:`fusable`); its groups say ``fused=None`` again after.

    Each stepped parameter's ``step`` counter is moved to its device first, where the fused
    kernel keeps it (a no-op once there).
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p) or {}
            step = state.get("step")
            if torch.is_tensor(step) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)
        group["fused"] = True
    try:
        yield
    finally:
        for group in optimizer.param_groups:
            group["fused"] = None
