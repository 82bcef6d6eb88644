"""The base of the DDP hook states that a job saves and resumes: PowerSGD's and the quantized hooks'.

Such a state holds its process group (None or a group of this rank), the chain that orders its
buckets' callbacks, and per-bucket tensor memories (``error_dict`` and the subclass's others).
``state_dict()`` saves the settings, the progress and copies of the memories. ``load_state_dict()``
checks the whole dict first and changes nothing when it is rejected; every saved setting must
equal this state's, since the memories were made with those settings.

A subclass names its saved settings and memories and says how to save, check and restore its
progress (counters, random streams).

Example::

    >>> from dcomm.core.validation import non_negative_int
    >>> class CountingState(ResumableHookState):
    ...     __slots__ = ("count",)
    ...     _SETTINGS = ()
    ...     _MEMORY = ("error_dict",)
    ...
    ...     def __init__(self, process_group=None):
    ...         super().__init__(process_group)
    ...         self.count = 0
    ...
    ...     def _progress(self):
    ...         return {"count": self.count}
    ...
    ...     def _progress_checks(self, fix):
    ...         return {"count": lambda name, value: non_negative_int(name, value, fix)}
    ...
    ...     def _restore(self, progress):
    ...         self.count = progress["count"]
    >>> CountingState().state_dict()
    {'count': 0, 'error_dict': {}}
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dcomm.core.validation import check_state_dict, process_group_or_none
from dcomm.ddp._bucket_order import BucketOrder
from dcomm.ddp._ordered_chain import OrderedChain

__all__ = ["ResumableHookState"]


def _memory_copy(name: str, value: Any, fix: str) -> dict[int, torch.Tensor]:
    """A checked copy of a saved memory: a mapping of bucket index to tensor."""
    if not isinstance(value, Mapping) or not all(isinstance(t, torch.Tensor) for t in value.values()):
        raise TypeError(f"{name}: expected a mapping of bucket index to tensor, got {type(value).__name__}; {fix}")
    return {int(index): tensor.detach().clone() for index, tensor in value.items()}


class ResumableHookState:
    """Process group, callback chain and per-bucket memories of a hook, with a checked resume.

    Args:
        process_group: the group gradients are averaged over (WORLD when None).

    Subclasses set ``_SETTINGS`` (attributes saved and required equal on restore),
    ``_MEMORY`` (attributes holding ``dict[int, Tensor]``, saved as copies) and, optionally,
    ``_OPTIONAL`` (progress keys that older checkpoints lack: :meth:`_restore` gets them only where
    present), and implement
    :meth:`_progress`, :meth:`_progress_checks` and :meth:`_restore`.

    Example::

        >>> state = QuantizedState(None)  # a subclass  # doctest: +SKIP
        >>> state.load_state_dict(state.state_dict())  # doctest: +SKIP
    """

    __slots__ = ("_chain", "_order", "error_dict", "process_group")

    _SETTINGS: ClassVar[tuple[str, ...]]
    _MEMORY: ClassVar[tuple[str, ...]]
    _OPTIONAL: ClassVar[tuple[str, ...]] = ()  # progress keys a checkpoint may lack (older versions)

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group_or_none(
            "process_group", process_group, "pass None for the default group, or a group from dist.new_group(...)"
        )
        self._chain = OrderedChain()
        self.error_dict: dict[int, torch.Tensor] = {}
        # In static_graph=True's first iteration every bucket comes with index 0: the memories
        # kept per index cannot serve those after the first (see _follows).
        self._order = BucketOrder()

    def _follows(self, bucket: dist.GradBucket) -> bool:
        """Whether ``bucket`` comes after the previous one, so that its index names it alone."""
        return self._order.follows(bucket)

    def state_dict(self) -> dict[str, Any]:
        """The settings, the progress and copies of the memories (they do not change as training goes on).

        Example::

            >>> checkpoint["hook"] = state.state_dict()  # doctest: +SKIP
        """
        out = {key: getattr(self, key) for key in self._SETTINGS}
        out.update(self._progress())
        for key in self._MEMORY:
            out[key] = {index: tensor.detach().clone() for index, tensor in getattr(self, key).items()}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, into this (possibly already registered) state.

        The settings must equal this state's; tensors move to each bucket's device on first use.
        A dict that is not a mapping is a ``TypeError``; missing keys, other settings or bad
        values are a ``ValueError`` (``TypeError`` for a value of the wrong type). Nothing changes
        when the dict is rejected.

        Example::

            >>> state.load_state_dict(checkpoint["hook"])  # doctest: +SKIP
        """
        owner = type(self).__name__
        fix = f"pass what {owner}.state_dict() returned"
        checks = dict(self._progress_checks(fix))
        for key in self._MEMORY:
            checks[key] = functools.partial(_memory_copy, fix=fix)
        required = [*self._SETTINGS, *(key for key in checks if key not in self._OPTIONAL)]
        checked = check_state_dict(owner, state_dict, checks, {}, required=required)
        for key in self._SETTINGS:
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict['{key}']: saved {state_dict[key]!r}, this state has {getattr(self, key)!r}; "
                    f"construct {owner} with {key}={state_dict[key]!r} to resume"
                )
        for key in self._MEMORY:
            setattr(self, key, checked.pop(key))
        self._restore(checked)

    def _progress(self) -> dict[str, Any]:
        """What :meth:`state_dict` saves besides the settings and the memories."""
        raise NotImplementedError

    def _progress_checks(self, fix: str) -> Mapping[str, Callable[[str, Any], Any]]:
        """For each key of :meth:`_progress`: ``(name, saved value) -> value to restore``, raising on a bad one."""
        raise NotImplementedError

    def _restore(self, progress: dict[str, Any]) -> None:
        """Set the checked values of :meth:`_progress_checks` (nothing here may fail)."""
        raise NotImplementedError
