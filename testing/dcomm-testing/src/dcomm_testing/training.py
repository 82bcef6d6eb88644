"""A few steps of training, what the hook tests compare between implementations, and a call recorder.

Example::

    >>> params = train_ddp(seeded_mlp(6, 12, 3), allreduce_hook, None, batch, steps=4)  # doctest: +SKIP
    >>> first_grads, params = train_sgd(fsdp_model, batch, steps=3)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["recorded_calls", "train_ddp", "train_sgd"]

T = TypeVar("T")


def _detached_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()


def _sum_of_squares(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def train_ddp(
    model: nn.Module,
    hook: Callable[..., Any] | None,
    state: object,
    batch: Callable[[int], torch.Tensor],
    steps: int,
    *,
    lr: float = 0.05,
    momentum: float = 0.9,
    loss: Callable[[torch.Tensor], torch.Tensor] = _sum_of_squares,
    **ddp_kwargs: Any,
) -> list[torch.Tensor]:
    """``model``'s parameters after ``steps`` SGD steps of DDP on ``loss(model(batch(step)))``.

    The loss is the sum of the squared outputs unless told otherwise.

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
        loss(ddp(batch(step))).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_sgd(
    model: nn.Module,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    *,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
    keep: Callable[[torch.Tensor], torch.Tensor] = _detached_copy,
    lr: float = 0.05,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(first-step gradients, parameters after ``steps`` plain SGD steps), each passed through ``keep``.

    Step ``s`` minimises ``loss(model(x), y)`` for ``x, y = batch(s)``. ``keep`` copies a tensor
    out (a detached clone by default; ``lambda t: t.detach().full_tensor()`` for sharded ones).

    Example::

        >>> grads, params = train_sgd(fsdp_model, lambda step: seeded_pair(step, (4, 6), (4, 5)), 3)  # doctest: +SKIP
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    first: list[torch.Tensor] = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss(model(x), y).backward()
        if step == 0:
            first = [keep(p.grad) for p in model.parameters()]
        opt.step()
    return first, [keep(p) for p in model.parameters()]


@contextlib.contextmanager
def recorded_calls(owner: object, name: str, record: Callable[..., T]) -> Iterator[list[T]]:
    """Inside the block, every call of ``owner.name`` first appends ``record(*args, **kwargs)`` to the list yielded.

    The attribute is restored on leaving. For a method patched on a class, ``args`` starts with
    the instance.

    Example::

        >>> with recorded_calls(Reducer, "__call__", lambda self, out, inp: inp.dtype) as dtypes:  # doctest: +SKIP
        ...     train()
    """
    real = getattr(owner, name)
    calls: list[T] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(owner, name, spy)
    try:
        yield calls
    finally:
        setattr(owner, name, real)
