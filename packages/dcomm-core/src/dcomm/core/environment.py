"""On/off switches read from the environment, one rule for every dcomm switch.

A launcher sets a switch alike on every rank (every rank must take the same path); it is read at
each use, so a test or a ``with`` block may change it.

Example::

    >>> import os
    >>> os.environ["DCOMM_EXAMPLE"] = "off"
    >>> switched_on("DCOMM_EXAMPLE"), switched_on("DCOMM_UNSET"), switched_on("DCOMM_UNSET", default=False)
    (False, True, False)
    >>> del os.environ["DCOMM_EXAMPLE"]
"""

from __future__ import annotations

import os

__all__ = ["switched_on"]

_OFF = ("0", "false", "no", "off")


def switched_on(name: str, default: bool = True) -> bool:
    """Whether the variable ``name`` is anything but ``0``/``false``/``no``/``off`` (any case, spaces).

    ``default`` when it is unset.
    """
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in _OFF
