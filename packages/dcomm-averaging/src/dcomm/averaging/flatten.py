"""Lay a module's parameters back to back in one buffer per device and dtype, for one-message averaging.

:func:`dcomm.averaging.average_parameters` sends a model's small parameters through staging
buckets (a copy each way) and its large ones one collective each; for a model of many tensors
that is many copies and collectives per call. Parameters that lie back to back in one storage are
averaged as one tensor, in place, with no copy and no extra memory. :func:`flatten_parameters`
lays them out so, once, before training: every parameter keeps its identity (``param.data`` is
replaced by a view of the buffer), its values, shape and strides. It is the way to make averaging
as fast as one raw allreduce for a model that allows it (one whose parameters are not rebound
later, e.g. by ``load_state_dict(..., assign=True)``, and are not sharded).

Example::

    >>> from dcomm.averaging import flatten_parameters
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> buffers = flatten_parameters(model)
    >>> [tuple(b.shape) for b in buffers]
    [(23,)]
"""

from __future__ import annotations

import torch
from torch import nn

from dcomm.averaging._layout import memory_order_view

__all__ = ["flatten_parameters"]


def flatten_parameters(module: nn.Module) -> list[torch.Tensor]:
    """Make ``module``'s parameters views of one flat buffer per ``(device, dtype)``, in registration order.

    Call it once, on every rank, before wrapping the module (DDP) and before building its
    optimizer; optimizers already built keep working (each parameter stays the same object).
    Values, shapes and strides (channels-last included) are kept, and a parameter registered
    twice (tied weights) gets one place. Gradients are left as they are.
    :func:`dcomm.averaging.average_parameters` then averages each buffer as one tensor in place
    (one allreduce per buffer), in whatever order the parameters are passed (a model's
    ``parameters()``, an optimizer's param groups through an averager); parameters left out of a
    call (no gradient) split their buffer into runs around them.

    Args:
        module: the model whose parameters are averaged.

    Returns:
        The buffers, one per ``(device, dtype)`` in order of first appearance.

    Raises:
        ValueError: a module without parameters, a parameter on the meta device or one whose
            layout has gaps or overlaps (nothing is changed then).

    Example::

        >>> model = torch.nn.Linear(4, 3)
        >>> (flat,) = flatten_parameters(model)
        >>> model.weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        True
    """
    params = list(module.parameters())  # each parameter once, tied ones included
    if not params:
        raise ValueError("module: it has no parameters to flatten; pass the model whose parameters are averaged")
    for param in params:
        if param.device.type == "meta":
            raise ValueError(
                f"module: a parameter of shape {tuple(param.shape)} is on the meta device; materialize the "
                "model first (model.to_empty(device=...) and load its weights)"
            )
        if memory_order_view(param) is None:
            raise ValueError(
                f"module: a parameter of shape {tuple(param.shape)} and strides {param.stride()} has gaps or "
                "overlaps in memory; make it contiguous first (param.data = param.data.contiguous())"
            )
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for param in params:
        groups.setdefault((param.device, param.dtype), []).append(param)
    buffers = []
    with torch.no_grad():
        for (device, dtype), members in groups.items():
            flat = torch.empty(sum(p.numel() for p in members), device=device, dtype=dtype)
            offset = 0
            for param in members:
                view = flat.as_strided(param.shape, param.stride(), offset)
                view.copy_(param.detach())
                param.data = view
                offset += param.numel()
            buffers.append(flat)
    return buffers
