"""dcomm's logging: rank 0 speaks for the job; fallbacks warn once.

Every rank of a job runs the same code, so a library log line would otherwise appear once per
rank. A logger from :func:`get_logger` passes records only on rank 0 (or when no process group
exists). :func:`warn_once` is for an algorithm that falls back to a slower path: one warning per
process and reason, on rank 0, while the algorithm counts every fallback in a public counter.

Example::

    >>> from dcomm.core import get_logger
    >>> logger = get_logger("dcomm.example")
    >>> logger.info("local SGD starts after %d iterations", 100)  # rank 0 only
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Hashable

import torch.distributed as dist

__all__ = ["get_logger", "warn_once"]

_warned: set[Hashable] = set()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _RankZeroFilter(logging.Filter):
    """Passes rank 0's records (every rank's before the process group exists)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _rank() == 0


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, passing records on rank 0 only (every rank before init).

    Handlers, levels and propagation are the application's, as for any library logger.

    Args:
        name: the logger's name (the module's ``__name__``).

    Returns:
        The logger, with a filter that passes rank 0's records.

    Example::

        >>> logger = get_logger(__name__)
        >>> logger.info("post-local SGD: local SGD from iteration %d on", 100)  # doctest: +SKIP
    """
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankZeroFilter) for f in logger.filters):
        logger.addFilter(_RankZeroFilter())
    return logger


def warn_once(key: Hashable, message: str, category: type[Warning] = UserWarning) -> bool:
    """Warn with ``message`` the first time ``key`` is seen in this process, on rank 0 only.

    Returns whether it warned. Meant for an algorithm that falls back to a slower path: the
    warning says why and what to change; the algorithm also counts each fallback publicly.

    Args:
        key: what the warning is about (warned once per key and process).
        message: what happened and what to change.
        category: the warning class.

    Returns:
        Whether it warned now.

    Example::

        >>> warn_once(("example", "float32"), "casting by itself: pass a low-precision policy")  # doctest: +SKIP
        True
    """
    if key in _warned:
        return False
    _warned.add(key)
    if _rank() != 0:
        return False
    warnings.warn(message, category, stacklevel=3)
    return True
