"""Model averagers: the base class and periodic averaging for post-local SGD.

An averager is called once per training step, after ``optimizer.step()``; it decides from its
``step`` counter whether this step averages and over which group, then increments ``step``.
Averagers are resumable: ``state_dict()`` holds the counter (and the settings it was used with)
and ``load_state_dict()`` restores it, so a restored job averages at exactly the same steps.

Example::

    >>> from dcomm.averaging import PeriodicModelAverager
    >>> averager = PeriodicModelAverager(period=4, warmup_steps=100)  # doctest: +SKIP
    >>> for batch in loader:  # doctest: +SKIP
    ...     loss_fn(model(batch)).backward()
    ...     optimizer.step()
    ...     averager.average_parameters(model.parameters())
"""

from __future__ import annotations

import operator
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dcomm.averaging.parameters import (
    DEFAULT_BUCKET_CAP_MB,
    _check_bucket_cap_mb,
    average_parameters_or_parameter_groups,
)
from dcomm.core import resolve_group

__all__ = ["ModelAverager", "PeriodicModelAverager"]

# The same text as torch's warning, so filters written for torch keep matching.
PERIOD_ONE_WARNING = (
    "When period is 1, no need to use model averaging because the communication cost "
    "of all-reducing parameters will be no less than the cost of all-reducing gradients "
    "by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case."
)


def _as_int(name: str, value: Any, minimum: int, fix: str) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming ``name``, the value and ``fix``."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if isinstance(value, bool) or number is None or number < minimum:
        bound = "a non-negative" if minimum == 0 else "a positive"
        raise ValueError(f"{name}: expected {bound} int, got {value!r}; {fix}")
    return number


def check_warmup_steps(warmup_steps: Any) -> int:
    return _as_int(
        "warmup_steps",
        warmup_steps,
        0,
        "pass 0 for no warm-up, or the start_localSGD_iter of the post-local SGD hook",
    )


class ModelAverager(ABC):
    """Base class of model averagers: a process group and a step counter.

    ``process_group`` is WORLD when None. Subclasses implement :meth:`average_parameters`, which
    must increment :attr:`step` once per call.

    Example::

        >>> class EveryStep(ModelAverager):
        ...     def average_parameters(self, params):
        ...         average_parameters_or_parameter_groups(params, self.process_group)
        ...         self.step += 1
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group: dist.ProcessGroup = resolve_group(process_group)
        self.step: int = 0

    @abstractmethod
    def average_parameters(
        self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]]
    ) -> None:
        """Average ``params`` if this step calls for it; increment :attr:`step`."""

    def _settings(self) -> dict[str, Any]:
        """The settings that decide the schedule; saved beside ``step`` and checked on load."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The averager's progress: ``{"step": ...}`` plus the settings that shape the schedule.

        Example::

            >>> torch.save({"averager": averager.state_dict()}, path)  # doctest: +SKIP
        """
        return {"step": self.step, **self._settings()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore ``step`` from :meth:`state_dict`; warn when the saved settings differ.

        Example::

            >>> averager.load_state_dict(torch.load(path)["averager"])  # doctest: +SKIP
        """
        if not isinstance(state_dict, Mapping) or "step" not in state_dict:
            raise ValueError(
                f"state_dict: expected a mapping with a 'step' entry, got {state_dict!r}; "
                "pass what averager.state_dict() returned"
            )
        step = _as_int("state_dict['step']", state_dict["step"], 0, "pass what averager.state_dict() returned")
        for key, value in self._settings().items():
            if key in state_dict and state_dict[key] != value:
                warnings.warn(
                    f"state_dict: saved {key}={state_dict[key]!r} differs from this averager's "
                    f"{key}={value!r}; the averaging schedule after the restore differs from the "
                    "saved run's (build the averager with the saved settings to continue it exactly)",
                    stacklevel=2,
                )
        self.step = step


class PeriodicModelAverager(ModelAverager):
    """Average parameters over ``process_group`` every ``period`` steps after ``warmup_steps``.

    A call averages when ``step >= warmup_steps`` and ``(step - warmup_steps) % period == 0``,
    then increments ``step``. ``period`` 1 warns (plain DDP is cheaper). ``bucket_cap_mb``
    bounds the extra memory of each averaging (see :func:`average_parameters`). For post-local
    SGD, ``warmup_steps`` must equal the hook's ``start_localSGD_iter``.

    Example::

        >>> averager = PeriodicModelAverager(period=4, warmup_steps=100)  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
        >>> averager.average_parameters(model.parameters())  # doctest: +SKIP
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        self.warmup_steps: int = check_warmup_steps(warmup_steps)
        self.period: int = _as_int("period", period, 1, "pass how many steps apart to average, usually more than 1")
        self.bucket_cap_mb = _check_bucket_cap_mb(bucket_cap_mb)
        super().__init__(process_group)
        if self.period == 1:
            warnings.warn(PERIOD_ONE_WARNING, stacklevel=2)

    def averages_at(self, step: int) -> bool:
        """Whether the call made at ``step`` averages.

        Example::

            >>> PeriodicModelAverager(2, warmup_steps=1).averages_at(3)  # doctest: +SKIP
            True
        """
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0

    def average_parameters(
        self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]]
    ) -> None:
        """Average ``params`` (parameters or param groups) if this step is due; increment ``step``.

        Example::

            >>> averager.average_parameters(optimizer.param_groups)  # doctest: +SKIP
        """
        if self.averages_at(self.step):
            average_parameters_or_parameter_groups(params, self.process_group, bucket_cap_mb=self.bucket_cap_mb)
        self.step += 1

    def _settings(self) -> dict[str, Any]:
        return {"period": self.period, "warmup_steps": self.warmup_steps}
