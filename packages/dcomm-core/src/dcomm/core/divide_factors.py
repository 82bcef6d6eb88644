"""Pre/post divide factors that average a gradient sum without fp16 overflow or underflow.

Averaging ``world`` gradients as ``sum(g) / world`` can overflow fp16 while summing, and
``sum(g / world)`` can underflow small gradients. Splitting the division into a factor applied
before the collective and one applied after it keeps both in range.

Example::

    >>> from dcomm.core import divide_factors
    >>> divide_factors(8)
    (4.0, 2.0)
"""

from __future__ import annotations

from dcomm.core.validation import positive_int

__all__ = ["divide_factors"]


def divide_factors(world_size: int) -> tuple[float, float]:
    """Return ``(pre, post)`` with ``pre * post == world_size``.

    ``pre`` starts at 1 and doubles while ``world_size % pre == 0`` and ``world_size / pre > pre``
    (the rule of torch's FSDP hooks); ``post = world_size / pre``. Apply each only when > 1:
    dividing by ``pre`` before a sum keeps an fp16 sum from overflowing, and by ``post`` after it
    keeps small values from underflowing.

    Args:
        world_size: the number of ranks summed over.

    Returns:
        ``(pre, post)`` as floats.

    Raises:
        TypeError, ValueError: ``world_size`` is not a positive int.

    Example::

        >>> divide_factors(6)
        (4.0, 1.5)
    """
    positive_int("world_size", world_size, "pass dist.get_world_size(group)")
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre
