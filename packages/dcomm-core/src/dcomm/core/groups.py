"""Process-group helpers: the node size from the launcher and intra-node subgroups.

The node size comes from ``LOCAL_WORLD_SIZE`` (set by ``torchrun``), falling back to the number of
visible GPUs and then to 1, so CPU jobs and oversubscribed hosts get the groups the launcher
meant, not one group per GPU.

Example::

    >>> # torchrun --nnodes 2 --nproc-per-node 4 ...   (LOCAL_WORLD_SIZE=4, world 8)
    >>> mine, all_groups = intra_node_subgroups()  # doctest: +SKIP
    >>> dist.get_process_group_ranks(mine)  # on rank 5  # doctest: +SKIP
    [4, 5, 6, 7]
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dcomm.core.collectives import resolve_group
from dcomm.core.validation import positive_int

__all__ = ["intra_node_subgroups", "local_world_size", "subgroups_of_size"]


def local_world_size() -> int:
    """Ranks per node: ``LOCAL_WORLD_SIZE``, else the visible GPU count, else 1.

    Example::

        >>> os.environ["LOCAL_WORLD_SIZE"] = "4"
        >>> local_world_size()
        4
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"LOCAL_WORLD_SIZE: expected a positive integer, got {raw!r}; "
                "unset it or set it to the number of ranks per node (torchrun does this)"
            )
        return value
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return 1


def subgroups_of_size(
    size: int, group: dist.ProcessGroup | None = None, *, what: str = "group_size"
) -> tuple[dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """Split ``group`` (WORLD when None) into consecutive subgroups of ``size`` ranks.

    Every rank of the default group must call this (group creation is collective). Returns
    ``(the subgroup holding this rank, or None outside group; all subgroups)``.
    ``what`` names the argument in error messages.

    Example::

        >>> mine, groups = subgroups_of_size(2)  # world 4 -> [0, 1], [2, 3]  # doctest: +SKIP
    """
    parent = resolve_group(group)
    ranks = dist.get_process_group_ranks(parent)
    world = len(ranks)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    positive_int(what, size, f"use one of {divisors}")
    if world % size:
        raise ValueError(f"{what}: {size!r} does not divide the group size {world}; use one of {divisors}")
    if size == world:
        return (parent if dist.get_rank() in ranks else None), [parent]
    me = dist.get_rank()
    mine: dist.ProcessGroup | None = None
    subgroups: list[dist.ProcessGroup] = []
    for start in range(0, world, size):
        members = ranks[start : start + size]
        subgroup = dist.new_group(members)
        subgroups.append(subgroup)
        if me in members:
            mine = subgroup
    return mine, subgroups


def intra_node_subgroups(
    group: dist.ProcessGroup | None = None,
) -> tuple[dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """One subgroup per node, sized by :func:`local_world_size`.

    Raises ``ValueError`` when the node size does not divide the group size.

    Example::

        >>> mine, per_node = intra_node_subgroups()  # doctest: +SKIP
    """
    return subgroups_of_size(local_world_size(), group, what="LOCAL_WORLD_SIZE")
