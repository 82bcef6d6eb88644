"""The base of the optimizers that run another one: ``PostLocalSGDOptimizer`` and ``DiLoCoOptimizer``.

Example::

    >>> class Counted(WrappingOptimizer):
    ...     def __init__(self, optim):
    ...         self.optim, self.param_groups, self.steps = optim, optim.param_groups, 0
    ...
    ...     def _wrapped(self):
    ...         return self.optim
    ...
    ...     def step(self, closure=None):
    ...         self.steps += 1
    ...         return self._wrapped_step(closure)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class WrappingOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``state``, ``defaults`` and gradients are another optimizer's.

    A subclass names that optimizer in :meth:`_wrapped` and sets ``param_groups`` to its param
    groups. It does not call ``torch.optim.Optimizer.__init__``, which would build a second copy
    of the parameters and state (torch's wrapping optimizers do the same).
    """

    def _wrapped(self) -> torch.optim.Optimizer:
        """The optimizer that owns the parameters and the state."""
        raise NotImplementedError

    def _wrapped_step(self, closure: Callable[[], float] | None) -> float | None:
        """``step()`` of the wrapped optimizer, with ``closure`` if given."""
        wrapped = self._wrapped()
        return wrapped.step() if closure is None else wrapped.step(closure)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._wrapped().state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._wrapped().defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients.

        Example::

            >>> opt.zero_grad()  # doctest: +SKIP
        """
        self._wrapped().zero_grad(set_to_none=set_to_none)
