"""Argument and checkpoint checks shared by every dcomm constructor and ``load_state_dict``.

One message form everywhere: ``"<argument>: expected <what>, got <value>; <fix>"``. A value of the
wrong type is a ``TypeError``, a value of the right type outside its range a ``ValueError``. Only
Python ``int`` counts as an int (``bool``, floats and tensors do not), the same in a constructor
and in a checkpoint.

Every validator takes the same arguments and behaves the same way:

Args:
    name: the argument's name, first in the message (``"period"``, ``"bucket_cap_mb"``).
    value: what the caller passed.
    fix: what to do instead, last in the message (``"pass e.g. 4"``).

Returns:
    ``value``, checked (a number as a float for the number validators).

Raises:
    TypeError: ``value`` has the wrong type.
    ValueError: ``value`` has the right type but is out of range.

Example::

    >>> from dcomm.core.validation import positive_int
    >>> positive_int("period", 4, "pass how many steps apart to average")
    4
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch.distributed as dist

__all__ = [
    "boolean",
    "check_state_dict",
    "even_int",
    "non_negative_int",
    "non_negative_number",
    "one_of",
    "positive_int",
    "positive_number",
    "process_group_or_none",
]


def _fail(kind: type[Exception], name: str, expected: str, value: Any, fix: str) -> Exception:
    return kind(f"{name}: expected {expected}, got {value!r}; {fix}")


def _int(name: str, value: Any, minimum: int, expected: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(TypeError, name, expected, value, fix)
    if value < minimum:
        raise _fail(ValueError, name, expected, value, fix)
    return value


def positive_int(name: str, value: Any, fix: str) -> int:
    """``value`` if it is an int >= 1; else a TypeError (not an int) or ValueError (< 1).

    Example::

        >>> positive_int("period", 0, "pass e.g. 4")
        Traceback (most recent call last):
        ValueError: period: expected a positive int, got 0; pass e.g. 4
    """
    return _int(name, value, 1, "a positive int", fix)


def non_negative_int(name: str, value: Any, fix: str) -> int:
    """``value`` if it is an int >= 0; else a TypeError (not an int) or ValueError (< 0).

    Example::

        >>> non_negative_int("warmup_steps", 0, "pass 0 for no warm-up")
        0
    """
    return _int(name, value, 0, "a non-negative int", fix)


def even_int(name: str, value: Any, minimum: int, fix: str) -> int:
    """``value`` if it is an even int >= ``minimum``; else a TypeError (not an int) or ValueError.

    Example::

        >>> even_int("block_size", 3, 2, "the default is 256")
        Traceback (most recent call last):
        ValueError: block_size: expected an even int >= 2, got 3; the default is 256
    """
    checked = _int(name, value, minimum, f"an even int >= {minimum}", fix)
    if checked % 2:
        raise _fail(ValueError, name, f"an even int >= {minimum}", value, fix)
    return checked


def _number(name: str, value: Any, positive: bool, fix: str) -> float:
    expected = "a positive number" if positive else "a non-negative number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(TypeError, name, expected, value, fix)
    if not (value > 0 if positive else value >= 0):  # NaN fails both
        raise _fail(ValueError, name, expected, value, fix)
    return float(value)


def positive_number(name: str, value: Any, fix: str) -> float:
    """``value`` as a float if it is a real number > 0 (not a bool); else a TypeError or ValueError.

    Example::

        >>> positive_number("bucket_cap_mb", 25, "pass e.g. 25")
        25.0
    """
    return _number(name, value, True, fix)


def non_negative_number(name: str, value: Any, fix: str) -> float:
    """``value`` as a float if it is a real number >= 0 (not a bool); else a TypeError or ValueError.

    Example::

        >>> non_negative_number("orthogonalization_epsilon", 0, "pass e.g. 1e-8")
        0.0
    """
    return _number(name, value, False, fix)


def boolean(name: str, value: Any, fix: str) -> bool:
    """``value`` if it is True or False; else a TypeError.

    Example::

        >>> boolean("post_local_gradient_allreduce", True, "pass True or False")
        True
    """
    if not isinstance(value, bool):
        raise _fail(TypeError, name, "True or False", value, fix)
    return value


def one_of(name: str, value: Any, choices: Collection[Any], fix: str) -> Any:
    """``value`` if it is one of ``choices``; else a ValueError listing them.

    Example::

        >>> one_of("side", "torch", ("torch", "dcomm"), "pick a side")
        'torch'
    """
    if value not in choices:
        raise _fail(ValueError, name, f"one of {list(choices)}", value, fix)
    return value


def process_group_or_none(name: str, value: Any, fix: str) -> dist.ProcessGroup | None:
    """``value`` if it is None or a group holding this rank; else a TypeError or ValueError.

    A value that is not a ``ProcessGroup`` is a TypeError (named by its type: a group's repr says
    little); ``dist.GroupMember.NON_GROUP_MEMBER``, what ``dist.new_group`` returns on the ranks
    outside the group, is a ValueError.

    Example::

        >>> process_group_or_none("process_group", 3, "pass None for the default group")
        Traceback (most recent call last):
        TypeError: process_group: expected a ProcessGroup or None, got int; pass None for the default group
    """
    if value is None:
        return None
    if value is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{name}: this rank is not a member of the group it was given (dist.new_group returned "
            f"NON_GROUP_MEMBER here); {fix}"
        )
    if not isinstance(value, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a ProcessGroup or None, got {type(value).__name__}; {fix}")
    return value


def check_state_dict(
    owner: str,
    state_dict: Any,
    progress: Mapping[str, Callable[[str, Any], Any]],
    settings: Mapping[str, Any],
    *,
    required: Collection[str] | None = None,
) -> dict[str, Any]:
    """Check a state dict completely before anything is changed; return its checked progress values.

    ``progress`` maps each key the object restores to a checker ``(name, value) -> value``;
    ``required`` (all progress keys when None) must be present. ``settings`` are the values this
    object was constructed with: the checkpoint never replaces them (the constructor decides the
    schedule, the checkpoint only how far it got). A saved setting that differs warns, naming
    both values, so a resumed schedule that differs from the saved run's never goes unnoticed.
    The same policy holds for every stateful dcomm object.

    Example::

        >>> check_state_dict("PeriodicModelAverager", {"step": 3}, {"step": lambda n, v: v}, {})
        {'step': 3}
    """
    fix = f"pass what {owner}.state_dict() returned"
    if not isinstance(state_dict, Mapping):
        raise _fail(TypeError, "state_dict", f"the mapping {owner}.state_dict() returns", type(state_dict), fix)
    needed = list(progress) if required is None else list(required)
    missing = [key for key in needed if key not in state_dict]
    if missing:
        raise ValueError(f"state_dict: missing keys {missing} (has {sorted(map(str, state_dict))}); {fix}")
    present = [key for key in progress if key in state_dict]
    checked = {key: progress[key](f"state_dict[{key!r}]", state_dict[key]) for key in present}
    for key, value in settings.items():
        if key in state_dict and state_dict[key] != value:
            warnings.warn(
                f"state_dict: saved {key}={state_dict[key]!r} differs from this {owner}'s {key}={value!r}; "
                f"{owner} keeps {key}={value!r}, so the schedule after the restore differs from the saved "
                f"run's (construct the {owner} with {key}={state_dict[key]!r} to continue it exactly)",
                stacklevel=3,
            )
    return checked
