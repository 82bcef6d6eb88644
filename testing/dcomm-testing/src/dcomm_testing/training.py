"""A few steps of DDP training with a comm hook: what the hook tests compare between implementations.

Example::

    >>> params = train_ddp(seeded_mlp(6, 12, 3), allreduce_hook, None, batch, steps=4)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["train_ddp"]


def train_ddp(
    model: nn.Module,
    hook: Callable[..., Any] | None,
    state: object,
    batch: Callable[[int], torch.Tensor],
    steps: int,
    *,
    lr: float = 0.05,
    momentum: float = 0.9,
    **ddp_kwargs: Any,
) -> list[torch.Tensor]:
    """``model``'s parameters after ``steps`` SGD steps of DDP on the loss ``sum(model(batch(step)) ** 2)``.

    ``hook`` (with ``state``) is registered when given; ``ddp_kwargs`` go to DDP (bucket caps, say).

    Example::

        >>> train_ddp(model, fp16_compress_hook, None, lambda step: x[step], 4, bucket_cap_mb=0.01)  # doctest: +SKIP
    """
    ddp = DDP(model, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        opt.zero_grad()
        ddp(batch(step)).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
