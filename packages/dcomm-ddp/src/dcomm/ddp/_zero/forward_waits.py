"""Parameter collectives left in flight after backward, each waited for by the next forward that needs it.

With ``gather_during_forward=True`` a ZeRO overlap hook does not wait at the end of backward for the
collectives that return the updated parameters. :class:`ForwardWaits` keeps them by parameter, and
a forward pre-hook on every module waits (a stream wait on CUDA) only for those of the module's own
parameters, so the first layers of the next forward run while the last layers' parameters are
still on their way. Saving or loading the root module's state dict waits for all of them (a
collective landing after a load would write over it). The hooks hold this object weakly: a model
that outlives its DDP and ZeRO does not keep them alive.

Example::

    >>> waits = ForwardWaits(ddp.module)  # doctest: +SKIP
    >>> waits.defer(params, dist.broadcast(flat, src=0, async_op=True))  # doctest: +SKIP
    >>> waits.wait_all()  # the parameters are whole  # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class ForwardWaits:
    """The deferred parameter collectives of one model, by parameter, and the hooks that wait for them."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.deferred: dict[int, Any] = {}  # id(param) -> the collective bringing it back
        self.position = {id(p): i for i, p in enumerate(root.parameters())}  # the forward's order, roughly
        this = weakref.ref(self)

        def wait_all(*_: Any) -> None:
            alive = this()
            if alive is not None:
                alive.wait_all()

        for module in root.modules():
            keys = tuple(id(p) for p in module.parameters(recurse=False))
            if keys:
                module.register_forward_pre_hook(_forward_wait(this, keys))
        root.register_state_dict_pre_hook(wait_all)
        root.register_load_state_dict_pre_hook(wait_all)

    def defer(self, params: list[torch.Tensor], work: Any) -> None:
        """Leave ``work`` (bringing back ``params``) to the next forward of the modules holding them."""
        for p in params:
            self.deferred[id(p)] = work

    def first_position(self, params: list[torch.Tensor]) -> int:
        """Where the first of ``params`` comes in the model's parameters: a key that sends first layers first."""
        return min((self.position.get(id(p), 0) for p in params), default=0)

    def wait_all(self) -> None:
        """Wait for every deferred collective (a stream wait on CUDA): the parameters are whole."""
        deferred, self.deferred = self.deferred, {}
        _wait_each(list(deferred.values()))


def _forward_wait(waits: weakref.ref[ForwardWaits], keys: tuple[int, ...]) -> Callable[..., None]:
    """A forward pre-hook waiting for the deferred collectives of the parameters ``keys``."""

    def wait(module: torch.nn.Module, args: Any) -> None:
        alive = waits()
        if alive is not None and alive.deferred:
            deferred = alive.deferred
            _wait_each([work for key in keys if (work := deferred.pop(key, None)) is not None])

    return wait


def _wait_each(works: list[Any]) -> None:
    """Wait for each distinct work once (one collective may bring back several parameters)."""
    seen: set[int] = set()
    for work in works:
        if id(work) not in seen:
            seen.add(id(work))
            work.wait()  # a stream wait on CUDA
