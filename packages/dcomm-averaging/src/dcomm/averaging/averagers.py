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

import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dcomm.averaging.fault_tolerance import QuorumParameterAveraging
from dcomm.averaging.parameters import (
    DEFAULT_BUCKET_CAP_MB,
    average_parameters_or_parameter_groups,
    check_bucket_cap_mb,
    get_params_to_average,
)
from dcomm.core import resolve_group
from dcomm.core.validation import check_state_dict, non_negative_int, positive_int

__all__ = ["ModelAverager", "PeriodicModelAverager"]

# The same text as torch's warning, so filters written for torch keep matching.
PERIOD_ONE_WARNING = (
    "When period is 1, no need to use model averaging because the communication cost "
    "of all-reducing parameters will be no less than the cost of all-reducing gradients "
    "by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case."
)


def check_warmup_steps(warmup_steps: Any) -> int:
    return non_negative_int(
        "warmup_steps", warmup_steps, "pass 0 for no warm-up, or the start_localSGD_iter of the post-local SGD hook"
    )


def _check_step(name: str, value: Any) -> int:
    return non_negative_int(name, value, "pass what averager.state_dict() returned")


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

        Everything is checked before ``step`` changes. The settings stay this averager's own (see
        :func:`dcomm.core.validation.check_state_dict`).

        Example::

            >>> averager.load_state_dict(torch.load(path)["averager"])  # doctest: +SKIP
        """
        checked = check_state_dict(type(self).__name__, state_dict, {"step": _check_step}, self._settings())
        self.step = checked["step"]


class PeriodicModelAverager(ModelAverager):
    """Average parameters over ``process_group`` every ``period`` steps after ``warmup_steps``.

    A call averages when ``step >= warmup_steps`` and ``(step - warmup_steps) % period == 0``,
    then increments ``step``. ``period`` 1 warns (plain DDP is cheaper). ``bucket_cap_mb``
    bounds the extra memory of each averaging (see :func:`average_parameters`). For post-local
    SGD, ``warmup_steps`` must equal the hook's ``start_localSGD_iter``.

    ``manager`` (a ``torchft.Manager``, instead of ``process_group``; ``pip install
    'dcomm-averaging[ft]'``) averages over the replicas of torchft's quorum and survives failures:
    a sync that fails is retried with the next quorum on the same parameters, and a replica that
    joins takes a peer's step and the average (see :mod:`dcomm.averaging.fault_tolerance`).

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
        manager: Any = None,
    ) -> None:
        self.warmup_steps: int = check_warmup_steps(warmup_steps)
        self.period: int = positive_int("period", period, "pass how many steps apart to average, usually more than 1")
        self.bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
        self._quorum_averaging: QuorumParameterAveraging | None = None
        if manager is None:
            super().__init__(process_group)
        elif process_group is not None:
            raise ValueError(
                "process_group: got both a process group and a torchft manager; pass one: the manager's "
                "quorum decides who averages"
            )
        else:
            self.step = 0
            self._quorum_averaging = QuorumParameterAveraging(manager, self)
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
        if self._quorum_averaging is not None:
            self._quorum_averaging.average(list(get_params_to_average(params)))  # a healed replica's step changes
        elif self.averages_at(self.step):
            average_parameters_or_parameter_groups(params, self.process_group, bucket_cap_mb=self.bucket_cap_mb)
        self.step += 1

    def _settings(self) -> dict[str, Any]:
        return {"period": self.period, "warmup_steps": self.warmup_steps}
