"""Whether dcomm's Triton kernels are switched off (``DCOMM_TRITON=0``); their modules check the import.

Every rank must take the same path, so the switch is an environment variable that a launcher sets
alike on every rank (e.g. where Triton imports but cannot compile).

Example::

    >>> import os
    >>> os.environ["DCOMM_TRITON"] = "0"
    >>> triton_enabled()
    False
    >>> del os.environ["DCOMM_TRITON"]
"""

from __future__ import annotations

import os

__all__ = ["ENV_SWITCH", "triton_enabled"]

ENV_SWITCH = "DCOMM_TRITON"


def triton_enabled() -> bool:
    """``DCOMM_TRITON`` is not ``0``/``false``/``no``/``off`` (read on every call: a test may set it)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")
