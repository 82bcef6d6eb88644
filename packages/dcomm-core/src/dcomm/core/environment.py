"""One environment variable set for the length of a block, nothing else touched.

dcomm has no on/off environment switches: a path is chosen by an explicit argument or call.

Example::

    >>> import os
    >>> with variable_set("DCOMM_EXAMPLE", "1"):
    ...     os.environ["DCOMM_EXAMPLE"]
    '1'
    >>> "DCOMM_EXAMPLE" in os.environ
    False
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["variable_set"]


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
        ...     os.environ["DCOMM_EXAMPLE"]
        '0'
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
