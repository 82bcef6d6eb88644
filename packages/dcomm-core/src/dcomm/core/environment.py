"""On/off switches read from the environment, one rule for every dcomm switch.

A launcher sets a switch alike on every rank (every rank must take the same path); it is read at
each use, so a test or a ``with`` block may change it.

Example::

    >>> import os
    >>> os.environ["DCOMM_EXAMPLE"] = "off"
    >>> switched_on("DCOMM_EXAMPLE"), switched_on("DCOMM_UNSET"), switched_on("DCOMM_UNSET", default=False)
    (False, True, False)
    >>> del os.environ["DCOMM_EXAMPLE"]
    >>> with variable_set("DCOMM_EXAMPLE", "1"):
    ...     switched_on("DCOMM_EXAMPLE", default=False)
    True
    >>> "DCOMM_EXAMPLE" in os.environ
    False
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["switched_on", "variable_set"]

_OFF = ("0", "false", "no", "off")


def switched_on(name: str, default: bool = True) -> bool:
    """Whether the variable ``name`` is anything but ``0``/``false``/``no``/``off`` (any case, spaces).

    Args:
        name: the environment variable.
        default: the answer when it is unset.

    Returns:
        True when the switch is on.

    Example::

        >>> switched_on("DCOMM_UNSET_EXAMPLE", default=False)
        False
    """
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in _OFF


@contextlib.contextmanager
def variable_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block, restored (or removed) after.

    Touches only ``name``: ``unittest.mock.patch.dict(os.environ, ...)`` rewrites the whole
    environment on exit, which costs up to a millisecond on hosts with long environments.

    Args:
        name: the environment variable.
        value: its value inside the block.

    Example::

        >>> with variable_set("DCOMM_EXAMPLE", "0"):
        ...     switched_on("DCOMM_EXAMPLE")
        False
    """
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
