"""Process-group helpers: nodes agreed by every rank, intra-node subgroups, subgroups of a size.

The ranks of a node are agreed collectively (:func:`node_layout`): every rank shares its host and
its ``LOCAL_WORLD_SIZE`` (set by ``torchrun``) once, so ranks that were launched with different
node sizes fail together with one message instead of pairing collectives with the wrong peers.

Example::

    >>> # torchrun --nnodes 2 --nproc-per-node 4 ...   (LOCAL_WORLD_SIZE=4, world 8)
    >>> mine, all_groups = intra_node_subgroups()  # doctest: +SKIP
    >>> dist.get_process_group_ranks(mine)  # on rank 5  # doctest: +SKIP
    [4, 5, 6, 7]
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from dcomm.core.collectives import gather_objects, resolve_group
from dcomm.core.validation import positive_int

__all__ = ["host_identity", "intra_node_subgroups", "node_layout", "subgroups_of_size"]


def subgroups_of_size(
    size: int, group: dist.ProcessGroup | None = None, *, what: str = "group_size"
) -> tuple[dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """Split ``group`` (WORLD when None) into consecutive subgroups of ``size`` ranks.

    Every rank of the default group must call this (group creation is collective). Returns
    ``(the subgroup holding this rank, or None outside group; all subgroups)``.
    ``what`` names the argument in error messages.

    Args:
        size: ranks per subgroup; must divide the size of ``group``.
        group: the group to split (WORLD when None).
        what: the argument named in error messages.

    Returns:
        ``(the subgroup holding this rank, or None outside group; all subgroups)``.

    Raises:
        ValueError: ``size`` does not divide the group size (on every rank alike).

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


def host_identity() -> str:
    """This process's host: ``DCOMM_HOST_ID`` when set, else the host name and boot id.

    The boot id (Linux) tells apart containers that share a host name. ``DCOMM_HOST_ID`` lets a
    launcher or a test say which ranks share a node.

    Example::

        >>> host_identity()  # doctest: +SKIP
        'node17/6f1c0f0e-...'
    """
    explicit = os.environ.get("DCOMM_HOST_ID")
    if explicit:
        return explicit
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _declared_local_size() -> int | str | None:
    """``LOCAL_WORLD_SIZE`` as an int, the raw text when it is not a positive int, None when unset."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        return raw
    return value if value >= 1 else raw


def _layout_problem(entries: list[tuple[int, str, int | str | None]]) -> str | None:
    """Why the gathered ``(rank, host, LOCAL_WORLD_SIZE)`` entries do not form a node layout, or None."""
    declared = {size for _, _, size in entries}
    if len(declared) > 1:
        by_value: dict[str, list[int]] = {}
        for rank, _, size in entries:
            by_value.setdefault("unset" if size is None else repr(size), []).append(rank)
        listing = ", ".join(f"{value} on ranks {ranks}" for value, ranks in by_value.items())
        return (
            f"LOCAL_WORLD_SIZE: the ranks disagree ({listing}); launch every rank with the same "
            "LOCAL_WORLD_SIZE (torchrun sets it to --nproc-per-node), or unset it everywhere to group ranks by host"
        )
    (size,) = declared
    if isinstance(size, str):
        return (
            f"LOCAL_WORLD_SIZE: expected a positive integer, got {size!r}; "
            "unset it or set it to the number of ranks per node (torchrun does this)"
        )
    if size is None:
        return None
    for host, count in _hosts(entries).items():
        if len(count) % size:
            return (
                f"LOCAL_WORLD_SIZE: {size} does not divide the {len(count)} ranks {count} of the group on host "
                f"{host!r}; set it to the number of ranks per node, or unset it to group ranks by host"
            )
    return None


def _hosts(entries: list[tuple[int, str, int | str | None]]) -> dict[str, list[int]]:
    hosts: dict[str, list[int]] = {}
    for rank, host, _ in entries:
        hosts.setdefault(host, []).append(rank)
    return hosts


def node_layout(
    group: dist.ProcessGroup | None = None, *, host_id: str | None = None, device: torch.device | None = None
) -> list[list[int]]:
    """The global ranks of each node of ``group`` (WORLD when None), agreed by all its ranks.

    Collective over ``group``: every rank contributes its host (``host_id``, by default
    :func:`host_identity`) and its ``LOCAL_WORLD_SIZE``, once. Ranks on one host form a node;
    with ``LOCAL_WORLD_SIZE`` set (and equal on every rank), each host's ranks are cut into
    consecutive nodes of that size (several launcher nodes on one host, as in tests). Every rank
    raises the same ``ValueError`` when the declared sizes disagree with each other or with the
    hosts, so no rank goes on to pair its collectives with the wrong peers. The GPU count plays no
    part.

    Args:
        group: the group whose ranks are laid out (WORLD when None).
        host_id: this rank's host (default :func:`host_identity`).
        device: the device this rank's tensors for ``group`` are on (its GPU on NCCL), which the
            agreement goes through; None keeps the current device.

    Returns:
        The global ranks of each node, in order.

    Raises:
        ValueError: the declared node sizes disagree with each other or with the hosts (every rank).

    Example::

        >>> node_layout()  # 2 hosts x 2 ranks  # doctest: +SKIP
        [[0, 1], [2, 3]]
    """
    parent = resolve_group(group)
    ranks = dist.get_process_group_ranks(parent)
    mine = (host_id if host_id is not None else host_identity(), _declared_local_size())
    gathered = gather_objects(mine, parent, device)
    entries = [(rank, host, size) for rank, (host, size) in zip(ranks, gathered, strict=True)]
    problem = _layout_problem(entries)
    if problem is not None:
        raise ValueError(problem)
    size = entries[0][2]
    nodes: list[list[int]] = []
    for members in _hosts(entries).values():
        step = len(members) if size is None else int(size)
        nodes.extend(members[start : start + step] for start in range(0, len(members), step))
    return nodes


def intra_node_subgroups(
    group: dist.ProcessGroup | None = None, *, host_id: str | None = None, device: torch.device | None = None
) -> tuple[dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """One subgroup per node of ``group`` (WORLD when None), as :func:`node_layout` agrees on them.

    Every rank of the default group must call this (the layout and group creation are
    collective). Returns ``(the subgroup holding this rank, or None outside group; all
    subgroups)``. Raises ``ValueError`` on every rank when ``LOCAL_WORLD_SIZE`` differs between
    ranks or does not fit the hosts.

    Args:
        group: the group to split by node (WORLD when None).
        host_id: this rank's host (default :func:`host_identity`).
        device: the device this rank's tensors for ``group`` are on (as for :func:`node_layout`).

    Returns:
        ``(the subgroup holding this rank, or None outside group; all subgroups)``.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` differs between ranks or does not fit the hosts (every rank).

    Example::

        >>> mine, per_node = intra_node_subgroups()  # doctest: +SKIP
    """
    parent = resolve_group(group)
    nodes = node_layout(parent, host_id=host_id, device=device)
    if len(nodes) == 1:
        return parent, [parent]
    me = dist.get_rank()
    mine: dist.ProcessGroup | None = None
    subgroups: list[dist.ProcessGroup] = []
    for members in nodes:
        subgroup = dist.new_group(members)
        subgroups.append(subgroup)
        if me in members:
            mine = subgroup
    return mine, subgroups
