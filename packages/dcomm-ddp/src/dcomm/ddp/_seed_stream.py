"""The stream of seeds PowerSGD draws its random Q matrices from, without numpy.

torch's PowerSGD seeds each random initialisation with ``numpy.random.RandomState(random_seed)
.randint(1_000_000_000)``. :class:`SeedStream` yields the same numbers (the same Mersenne Twister,
seeded and bounded the same way) with Python's ``random`` module, so dcomm-ddp needs no numpy,
and its position is a plain list of ints that fits in a ``state_dict``.

Example::

    >>> stream = SeedStream(0)
    >>> stream.randint(1_000_000_000)
    209652396
"""

from __future__ import annotations

import random

__all__ = ["SeedStream"]

_N = 624  # Mersenne Twister state words


def _twister_state(seed: int) -> list[int]:
    """The state words of a Mersenne Twister seeded with one 32-bit integer (``init_genrand``)."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, _N):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return words


class SeedStream:
    """Integers in ``[0, high)`` drawn like numpy's legacy ``RandomState(seed).randint(high)``.

    Example::

        >>> stream = SeedStream(7)
        >>> saved = stream.state()
        >>> first = stream.randint(100)
        >>> stream.set_state(saved)
        >>> stream.randint(100) == first
        True
    """

    __slots__ = ("_random",)

    def __init__(self, seed: int) -> None:
        is_int = isinstance(seed, int) and not isinstance(seed, bool)
        if not is_int or not 0 <= seed < 2**32:
            raise (ValueError if is_int else TypeError)(
                f"random_seed: expected an int in [0, 2**32), got {seed!r}; pass e.g. 0 (the default)"
            )
        self._random = random.Random()
        self._random.setstate((3, (*_twister_state(seed), _N), None))

    def randint(self, high: int) -> int:
        """A uniform integer in ``[0, high)``, ``high <= 2**32`` (rejection with a bit mask)."""
        mask = (1 << (high - 1).bit_length()) - 1
        while True:
            value = self._random.getrandbits(32) & mask
            if value < high:
                return value

    def state(self) -> list[int]:
        """The twister's position: 625 ints."""
        return list(self._random.getstate()[1])

    def set_state(self, state: list[int]) -> None:
        """Return to a position from :meth:`state`."""
        self._random.setstate((3, tuple(int(word) for word in state), None))
