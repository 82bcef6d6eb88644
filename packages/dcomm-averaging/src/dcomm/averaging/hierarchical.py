"""Hierarchical model averaging: groups of growing size averaging at growing periods.

``period_group_size_dict`` maps a period to a group size, periods increasing, the last size being
the size of ``process_group``. At a step past warm-up only the group of the largest period that
divides the step averages (it contains the smaller groups); when no period divides the step,
nothing is averaged. Groups are consecutive ranks of ``process_group`` (``[0, 1], [2, 3]`` for
size 2), so a group of size ``s`` sits inside every larger group whose size is a multiple of ``s``.
Every setting is checked before any group is created, so a bad map fails on every rank with the
same message and nothing hangs.

Example::

    >>> from dcomm.averaging import HierarchicalModelAverager
    >>> # 16 ranks: average within groups of 8 every 4 steps, all 16 every 16 steps.
    >>> averager = HierarchicalModelAverager({4: 8, 16: 16}, warmup_steps=100)  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dcomm.averaging.averagers import ModelAverager, check_warmup_steps
from dcomm.averaging.parameters import (
    DEFAULT_BUCKET_CAP_MB,
    average_parameters_or_parameter_groups,
    check_bucket_cap_mb,
)
from dcomm.core import get_logger, member_size, subgroups_of_size

__all__ = ["HierarchicalModelAverager"]

logger = get_logger(__name__)  # rank 0 only

# The same text as torch's warning, so filters written for torch keep matching.
MAX_PERIOD_ONE_WARNING = (
    "When the maximum period in arg ``period_group_size_dict`` is 1, "
    "no need to use model averaging because the communication cost "
    "of all-reducing parameters will be no less than the cost of all-reducing gradients "
    "by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case."
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


def _example_periods(items: list[tuple[Any, Any]]) -> list[int]:
    """The user's periods when they are valid (at least two, increasing positive ints), else 2, 4, 8, ..."""
    periods = [p for p, _ in items]
    if len(periods) >= 2 and all(_is_positive_int(p) for p in periods) and periods == sorted(set(periods)):
        return periods
    return [2 * 2**i for i in range(max(2, len(items)))]


def _example_sizes(sizes: list[Any], count: int, world: int) -> list[int]:
    """``count`` sizes dividing ``world``: each the largest divisor up to the user's; the last ``world``."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    fallback = divisors[1] if len(divisors) > 1 else 1
    padded = (sizes + [None] * count)[:count]
    fixed = [
        max((d for d in divisors if d <= size), default=fallback) if _is_positive_int(size) else fallback
        for size in padded
    ]
    fixed[-1] = world
    return fixed


def _example(period_group_size_dict: Any, world: int) -> dict[int, int]:
    """A valid map as close to the user's as possible, for error messages."""
    items = list(period_group_size_dict.items()) if isinstance(period_group_size_dict, Mapping) else []
    periods = _example_periods(items)
    sizes = _example_sizes([s for _, s in items], len(periods), world)
    return dict(zip(periods, sizes, strict=True))


def _validate(period_group_size_dict: Any, world: int) -> OrderedDict[int, int]:
    """The checked map; else a TypeError (not a mapping or None, a period or size not an int) or a ValueError.

    Either names the argument, the value and the fix.
    """
    name = "period_group_size_dict"

    def fail(problem: str, kind: type[Exception] = ValueError) -> Exception:
        return kind(
            f"{name}: {problem}; use increasing periods mapped to group sizes that divide {world} "
            f"and end with {world}, e.g. {_example(period_group_size_dict, world)}"
        )

    if not isinstance(period_group_size_dict, Mapping) or not period_group_size_dict:
        # None is the default (torch's too): a missing map, not one of the wrong type.
        is_map = period_group_size_dict is None or isinstance(period_group_size_dict, Mapping)
        problem = f"expected a non-empty mapping of period to group size, got {period_group_size_dict!r}"
        raise fail(problem, ValueError if is_map else TypeError)
    periods = list(period_group_size_dict.keys())
    sizes = list(period_group_size_dict.values())
    for period in periods:
        if not _is_positive_int(period):
            kind = ValueError if _is_int(period) else TypeError
            raise fail(f"period {period!r} is not a positive int (periods are steps between averagings)", kind)
    for before, after in itertools.pairwise(periods):
        if after <= before:
            raise fail(f"periods must increase, but {after} comes after {before}")
    for size in sizes:
        if not _is_positive_int(size):
            raise fail(f"group size {size!r} is not a positive int", ValueError if _is_int(size) else TypeError)
        if world % size:
            raise ValueError(
                f"{name}: group size {size} does not divide the world size {world}; use sizes that "
                f"divide {world}, e.g. {_example(period_group_size_dict, world)}"
            )
    if sizes[-1] != world:
        raise fail(
            f"the last group size {sizes[-1]} must be the size of process_group ({world}), the top of the hierarchy"
        )
    return OrderedDict(zip(periods, sizes, strict=True))


def _check_splittable(checked: OrderedDict[int, int], world: int) -> None:
    """Refuse, before any group exists, subgroups of a ``process_group`` smaller than the world.

    Creating a process group is collective over the whole default group, but the ranks outside
    ``process_group`` cannot build this averager: the members alone would create the subgroups,
    the world's group counters would drift apart, and the next group created over the world would
    hang (torch's averager fails the same way). Every member raises this same error.
    """
    everyone = dist.get_world_size()
    smaller = sorted({size for size in checked.values() if size < world})
    if world < everyone and smaller:
        raise ValueError(
            f"process_group: its {world} of the {everyone} ranks cannot be split into groups of "
            f"{smaller}: creating a process group needs every rank of the world, and the ranks outside "
            "process_group cannot build this averager; pass process_group=None with group sizes of the "
            "whole world, or average within process_group with PeriodicModelAverager"
        )


class HierarchicalModelAverager(ModelAverager):
    """Average within nested groups at different periods (hierarchical SGD).

    Ranks that share a fast link (a node) can average often; the whole job, over a slow link,
    rarely. ``period_group_size_dict`` says how often each group size averages: with
    ``{4: 8, 16: 32}`` on 32 ranks, groups of 8 consecutive ranks average every 4 steps and all
    32 every 16 steps (then only the 32: the larger group contains the smaller ones). At a call
    with ``step >= warmup_steps``, the group of the largest period that divides ``step``
    averages; none when no period divides it. ``step`` increments every call. Call it after
    ``optimizer.step()`` (or wrap the optimizer in :class:`PostLocalSGDOptimizer`).

    Group creation is collective: every rank of the default group must build the averager, with
    the same map. Attributes match torch's: ``period_process_group_dict`` maps each period to the
    group of this rank, ``warmup_steps``, ``process_group``, ``step``; ``state_dict()`` and
    ``load_state_dict()`` resume the schedule.

    Args:
        period_group_size_dict: an ordered map period -> group size; periods increase, sizes
            divide the size of ``process_group`` and the last one equals it.
        warmup_steps: calls before the first averaging (the post-local SGD hook's
            ``start_localSGD_iter``).
        process_group: the top of the hierarchy; WORLD when None. A group smaller than the
            world only with group sizes all equal to its size (nothing to create: the ranks
            outside it cannot take part in creating subgroups).
        bucket_cap_mb: the bound on each averaging's extra memory (see :func:`average_parameters`).

    Raises:
        ValueError: an empty map, a period or group size below 1, periods that do not increase,
            a group size that does not divide the group or a last size other than it, a
            negative ``warmup_steps``, subgroups of a group smaller than the world, a rank
            outside ``process_group``: on every rank alike, before any group is created.
        TypeError: a map that is not a mapping, a period or group size that is not an int.

    A largest period of 1 warns, as torch does (plain DDP is cheaper).

    Example::

        >>> averager = HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=10)  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
        >>> averager.average_parameters(model.parameters())  # doctest: +SKIP
    """

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int] | None = None,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        super().__init__(process_group)
        world = member_size(
            self.process_group,
            "process_group",
            "build the HierarchicalModelAverager only on the ranks of process_group, or pass a group holding this rank",
        )
        self.warmup_steps: int = check_warmup_steps(warmup_steps)
        self.bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
        checked = _validate(period_group_size_dict, world)
        _check_splittable(checked, world)
        self._periods: list[int] = list(checked)
        self._group_sizes: list[int] = list(checked.values())
        if self._periods[-1] == 1:
            warnings.warn(MAX_PERIOD_ONE_WARNING, stacklevel=2)
        self.period_process_group_dict: OrderedDict[int, dist.ProcessGroup] = OrderedDict()
        for period, size in checked.items():
            mine, _ = subgroups_of_size(size, self.process_group, what="period_group_size_dict")
            assert mine is not None
            self.period_process_group_dict[period] = mine
            logger.info("ranks in groups of %d average every %d steps unless a larger group does", size, period)

    def process_group_at(self, step: int) -> dist.ProcessGroup | None:
        """The group that averages at ``step``, or None when this step does not average.

        Args:
            step: a value of the averager's step counter.

        Returns:
            This rank's group of the largest period dividing ``step`` (past warm-up), or None.

        Example::

            >>> HierarchicalModelAverager({2: 2, 4: 4}).process_group_at(6)  # doctest: +SKIP
            <the size-2 group of this rank>
        """
        if step < self.warmup_steps:
            return None
        for period in reversed(self._periods):
            if step % period == 0:
                return self.period_process_group_dict[period]
        return None

    def average_parameters(
        self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]]
    ) -> None:
        """Average ``params`` (parameters or param groups) in this step's group; increment ``step``.

        Args:
            params: a module's parameters or an optimizer's param groups (those with a gradient
                are averaged).

        Example::

            >>> averager.average_parameters(optimizer.param_groups)  # doctest: +SKIP
        """
        group = self.process_group_at(self.step)
        if group is not None:
            average_parameters_or_parameter_groups(params, group, bucket_cap_mb=self.bucket_cap_mb)
        self.step += 1

    def _settings(self) -> dict[str, Any]:
        return {
            "period_group_size_dict": dict(zip(self._periods, self._group_sizes, strict=True)),
            "warmup_steps": self.warmup_steps,
        }
