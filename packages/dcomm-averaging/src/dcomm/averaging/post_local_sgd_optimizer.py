"""PostLocalSGDOptimizer: a local optimizer followed by a model averager, in one ``step()``.

Wrap any ``torch.optim.Optimizer``; each ``step()`` runs it, then the averager. The averager's
step counter is saved in ``state_dict()`` under ``"step"`` (torch's key, so checkpoints move both
ways) and restored by ``load_state_dict()``, so a restored job keeps averaging on schedule.

Example::

    >>> from dcomm.averaging import PeriodicModelAverager, PostLocalSGDOptimizer
    >>> opt = PostLocalSGDOptimizer(  # doctest: +SKIP
    ...     torch.optim.SGD(model.parameters(), lr=0.01),
    ...     PeriodicModelAverager(period=4, warmup_steps=100),
    ... )
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dcomm.averaging._wrapping_optimizer import WrappingOptimizer
from dcomm.core.validation import check_state_dict, non_negative_int

if TYPE_CHECKING:
    from dcomm.averaging.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]


def _check_step(name: str, value: Any) -> int:
    return non_negative_int(name, value, "pass what PostLocalSGDOptimizer.state_dict() returned")


# The same text as torch's warning, so filters written for torch keep matching.
NO_STEP_WARNING = "Loaded state dict does not contain a step counter for an averager. Setting step counter to 0."


class PostLocalSGDOptimizer(WrappingOptimizer):
    """Run ``optim.step()`` then ``averager.average_parameters(optim.param_groups)``.

    Post-local SGD trains with plain data parallelism for a warm-up, then lets each rank step on
    its own and averages the models every few steps (the averager's schedule): fewer
    communications, usually with little loss of accuracy. This optimizer is the second half: the
    local step and the averaging, in one ``step()``. ``param_groups``, ``state`` and
    ``defaults`` are the wrapped optimizer's. ``state_dict()`` is the wrapped optimizer's plus
    ``"step"``: the averager's step. ``load_state_dict()`` restores both; without ``"step"`` it
    warns and starts the averager from 0, as torch does.

    Args:
        optim: the local optimizer (any ``torch.optim.Optimizer``).
        averager: the averager that follows each step (:class:`PeriodicModelAverager`,
            :class:`HierarchicalModelAverager`).

    Example::

        >>> opt = PostLocalSGDOptimizer(local_optim, PeriodicModelAverager(4, 100))  # doctest: +SKIP
        >>> loss.backward()  # doctest: +SKIP
        >>> opt.step()  # doctest: +SKIP
        >>> torch.save(opt.state_dict(), path)  # doctest: +SKIP
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        self.optim = optim
        self.averager = averager
        self.param_groups = optim.param_groups

    def _wrapped(self) -> torch.optim.Optimizer:
        return self.optim

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"step"``, the averager's step.

        Example::

            >>> torch.save(opt.state_dict(), path)  # doctest: +SKIP
        """
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and the averager's step (0, with a warning, if absent).

        ``"step"`` is checked before anything is loaded, and the wrapped optimizer checks its own
        part before it changes, so a bad checkpoint leaves both the optimizer and the averager as
        they were.

        Args:
            state_dict: what :meth:`state_dict` returned.

        Raises:
            TypeError, ValueError: ``"step"`` is not a non-negative int; or the wrapped optimizer's
                own errors.

        Example::

            >>> opt.load_state_dict(torch.load(path))  # doctest: +SKIP
        """
        checked = check_state_dict(type(self).__name__, state_dict, {"step": _check_step}, {}, required=())
        self.optim.load_state_dict(state_dict)
        if "step" not in checked:
            warnings.warn(NO_STEP_WARNING, stacklevel=2)
        self.averager.step = checked.get("step", 0)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the wrapped optimizer (with ``closure`` if given), then the averager.

        Args:
            closure: re-evaluates the model and returns the loss (for optimizers that need it).

        Returns:
            The wrapped optimizer's return value (the loss from ``closure``, or None).

        Example::

            >>> opt.step()  # doctest: +SKIP
        """
        loss = self._wrapped_step(closure)
        self.averager.average_parameters(self.param_groups)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer.

        Example::

            >>> opt.add_param_group({"params": head.parameters(), "lr": 0.1})  # doctest: +SKIP
        """
        self.optim.add_param_group(param_group)
