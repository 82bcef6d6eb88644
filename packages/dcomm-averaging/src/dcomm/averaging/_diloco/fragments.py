"""Streaming DiLoCo's schedule: the model cut into contiguous fragments, each synced at its own offset.

Parameters are taken in model order and cut into ``fragments`` runs of whole parameters of about
equal bytes. Fragment ``i`` syncs at every inner step ``t`` with ``t % sync_every`` equal to its
offset, ``(i + 1) * sync_every // fragments`` (mod ``sync_every``): offsets spread evenly over the
period, the last fragment at the period's end.

Example::

    >>> split_bytes([4, 4, 8, 16], 2)
    [[0, 1, 2], [3]]
    >>> sync_offsets(sync_every=6, fragments=3)
    [2, 4, 0]
"""

from __future__ import annotations

import bisect
import itertools

__all__ = ["split_bytes", "sync_offsets"]


def split_bytes(sizes: list[int], fragments: int) -> list[list[int]]:
    """Cut ``range(len(sizes))`` into ``fragments`` non-empty contiguous runs of about equal bytes.

    Each cut lies where the running total of ``sizes`` is nearest a multiple of the total over
    ``fragments``, moved as little as needed so that every run keeps at least one index.
    ``fragments`` must be between 1 and ``len(sizes)``.

    Example::

        >>> split_bytes([1, 1, 1, 1, 1, 1], 3)
        [[0, 1], [2, 3], [4, 5]]
    """
    count = len(sizes)
    if not 1 <= fragments <= count:
        raise ValueError(f"fragments: expected 1 to {count} (the number of parameters), got {fragments}")
    ends = list(itertools.accumulate(sizes))  # ends[j]: bytes of indices 0..j
    total = ends[-1]
    cuts = [0]
    for k in range(1, fragments):
        target = total * k / fragments
        j = bisect.bisect_left(ends, target)  # first run end at or past the target
        if j > 0 and target - ends[j - 1] <= ends[min(j, count - 1)] - target:
            j -= 1
        cut = j + 1  # the run ends after index j
        lowest, highest = cuts[-1] + 1, count - (fragments - k)
        cuts.append(min(max(cut, lowest), highest))
    cuts.append(count)
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """Each fragment's sync offset within the period: ``(i + 1) * sync_every // fragments % sync_every``.

    Example::

        >>> sync_offsets(sync_every=50, fragments=1)
        [0]
    """
    return [(i + 1) * sync_every // fragments % sync_every for i in range(fragments)]
