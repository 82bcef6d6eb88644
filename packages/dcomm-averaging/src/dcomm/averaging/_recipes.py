"""What one :func:`dcomm.averaging.average_parameters` call decides, kept for the next call, and replayed.

The checks and path decisions of a call (a recipe: indices, staging tables, never a parameter)
are kept while the next call passes the same parameters in the same storage, so a periodic
averager pays them once; on NCCL the in-place average of a kept recipe is captured once as a
CUDA graph and replayed (:func:`_replayed`; ``DCOMM_CUDA_GRAPHS=0`` turns that off).

Example::

    >>> _Paths().stage_below_bytes == 2**20
    True
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dcomm.averaging._buckets import _average_group, _Staging
from dcomm.averaging._in_place import (
    _LAUNCH_MAX_TENSORS,
    PACK_MAX_BYTES,
    SMALL_MIN_TENSORS,
    STAGE_BELOW_BYTES,
    _average_in_place,
    _small_ones,
    _staged_ones,
)
from dcomm.averaging._layout import (
    _dense,
    _flat_view,
    _merged,
    _overlap,
    chains,
    memory_regions,
    storage_regions,
    successors,
)
from dcomm.core import reduced_by_nccl
from dcomm.core.captured_average import SWITCH, CapturedAverages
from dcomm.core.environment import switched_on
from dcomm.core.tensor_table import TensorTable


class _Paths(NamedTuple):
    """How :func:`average_parameters` picks and sizes its paths (tests pass other values).

    ``in_place``: None takes the in-place path exactly where NCCL reduces (NCCL's coalesced
    allreduce reduces each tensor in its own storage; gloo's flattens into a copy, and CPU tensors
    are better served by the buckets); True or False forces it. ``on_in_place`` sees the tensors
    of every in-place call (before the small ones are staged or packed); ``pack_max_bytes`` 0
    packs none; ``stage_below_bytes`` 0 stages none (the small ones are packed, as without Triton);
    fewer small ones than ``small_min_tensors`` are neither staged nor packed;
    ``stage_run_bytes`` is set per call (half the cap: the most one staged run holds); ``graphs``
    False never replays a CUDA graph (see :func:`_replayed`).
    """

    in_place: bool | None = None
    launch_max_tensors: int = _LAUNCH_MAX_TENSORS
    on_in_place: Callable[[list[torch.Tensor]], None] | None = None
    pack_max_bytes: int = PACK_MAX_BYTES
    stage_below_bytes: int = STAGE_BELOW_BYTES
    small_min_tensors: int = SMALL_MIN_TENSORS
    stage_run_bytes: int = 0
    graphs: bool = True


def _check_device(device: torch.device, group: dist.ProcessGroup) -> None:
    if device.type == "cpu" and str(dist.get_backend(group)) == "nccl":
        raise ValueError(
            "params: a parameter is on the CPU but process_group uses the 'nccl' backend, which "
            "only reduces GPU tensors; move the parameters to the GPU or create the group with "
            "backend='cpu:gloo,cuda:nccl'"
        )


def _checked(param: torch.Tensor) -> None:
    """Refuse, before any collective, a parameter that cannot be averaged (its device: see _by_device)."""
    if param.layout != torch.strided:
        raise ValueError(
            f"params: a parameter of shape {tuple(param.shape)} has the {param.layout} layout; "
            "average_parameters averages dense tensors: convert it with param.data = param.data.to_dense()"
        )
    if param.device.type == "meta":
        raise ValueError(
            f"params: a parameter of shape {tuple(param.shape)} is on the meta device and holds no data; "
            "materialize the model first (model.to_empty(device=...) and load its weights)"
        )
    if param.is_complex():
        raise ValueError(
            f"params: a parameter has the complex dtype {param.dtype}; average its real view instead "
            "(torch.view_as_real(param))"
        )
    if param.is_floating_point() and not param.is_contiguous():
        # A layout with gaps or overlaps raises here, not when its device's turn comes: with
        # parameters on several devices, another device would already have been averaged.
        _flat_view(param)


def _by_device(
    params: list[torch.Tensor], group: dist.ProcessGroup
) -> tuple[dict[torch.device, list[list[int]]], list[int]]:
    """Indices of the floating-point parameters by device, then dtype, each checked; of the integer ones.

    Raises ``ValueError`` on this rank, before any collective, for an empty ``params`` (torch
    raises there too) or a parameter that cannot be averaged (sparse, meta, complex, CPU on NCCL).
    Integer and bool tensors (BatchNorm's ``num_batches_tracked``) go to :func:`_average_integers`.
    """
    if not params:
        raise ValueError(
            "params: got no parameters on this rank, so its peers would wait for it in the allreduce; "
            "pass the same non-empty parameters on every rank of the group (for param groups, only "
            "parameters with a gradient are averaged: call it after backward)"
        )
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    integers: list[int] = []
    seen: set[int] = set()
    for index, param in enumerate(params):
        _checked(param)
        if id(param) in seen or param.numel() == 0:
            continue
        seen.add(id(param))
        if not param.is_floating_point():
            integers.append(index)
            continue
        by_kind.setdefault((param.device, param.dtype), []).append(index)
    for device in {device for device, _ in by_kind} | {params[i].device for i in integers}:
        _check_device(device, group)  # once per device: a c10d query per parameter costs host time
    by_device: dict[torch.device, list[list[int]]] = {}
    for (device, _), indices in by_kind.items():
        by_device.setdefault(device, []).append(indices)
    return by_device, integers


class _DeviceRecipe(NamedTuple):
    """One device's parameters: indices per dtype; for the in-place path, per dtype, the chains of
    back-to-back tensors averaged as one (None where none joined), which of the merged tensors to
    stage (:func:`_staged_ones`, with their table) or else to pack (:func:`_small_ones`, no table);
    whether NCCL reduces them (then their average may be replayed as a CUDA graph: :func:`_replayed`)."""

    device: torch.device
    groups: list[list[int]]
    in_place: bool
    joined: list[list[list[int]] | None]
    small: list[list[int]]
    tables: list[TensorTable | None]
    by_nccl: bool


class _Recipe(NamedTuple):
    """What :func:`_prepare` decided for one list of parameters: indices and staging tables, never a parameter.

    A table holds the staged parameters' addresses, which the call key pins (their ``data_ptr``).
    """

    devices: list[_DeviceRecipe]
    integers: list[int]


_RECIPES: collections.OrderedDict[int, tuple[tuple[Any, ...], _Recipe]] = collections.OrderedDict()
"""The recipes of the last calls by the hash of their key, most recent last (a periodic averager
passes the same parameters; several parameter lists, or several groups, are averaged in turn)."""

_RECIPES_KEPT = 16

ALLOCATOR_BLOCK_BYTES = 512
"""PyTorch's CUDA caching allocator rounds every block to a multiple of this many bytes."""

_dtype_of = operator.attrgetter("dtype")


def _call_key(params: list[torch.Tensor], group: dist.ProcessGroup, paths: _Paths) -> tuple[Any, ...] | None:
    """What must not change for a recipe to hold: the parameters, their storage, dtype and size, the paths.

    Flat tuples, cheap to build and hash (a recipe depends on each parameter's address and byte
    count, not on its shape). None when a parameter has no storage address (sparse): such calls
    are prepared every time.
    """
    try:
        pointers = tuple(map(torch.Tensor.data_ptr, params))
    except RuntimeError:
        return None
    sizes = tuple(map(torch.Tensor.numel, params))
    return (id(group), paths, tuple(map(id, params)), pointers, sizes, tuple(map(_dtype_of, params)))


def _recipe_for(key: tuple[Any, ...] | None) -> tuple[int | None, _Recipe | None]:
    """The kept recipe of ``key`` (None if there is none) and the key's hash (computed once per call)."""
    if key is None:
        return None, None
    digest = hash(key)
    kept = _RECIPES.get(digest)
    return digest, (kept[1] if kept is not None and kept[0] == key else None)


def _keep(digest: int, key: tuple[Any, ...], recipe: _Recipe) -> None:
    """Keep ``recipe`` as the most recent; a graph lives only as long as its recipe is kept.

    A recipe replaced under its digest (another key with the same hash) or evicted past the bound
    takes its graphs with it: they touch its tables and its parameters' memory.
    """
    replaced = _RECIPES.get(digest)
    if replaced is not None and replaced[1] is not recipe:
        _forget_graphs(digest)
    _RECIPES[digest] = (key, recipe)
    _RECIPES.move_to_end(digest)
    while len(_RECIPES) > _RECIPES_KEPT:
        evicted, _ = _RECIPES.popitem(last=False)
        _forget_graphs(evicted)


_GRAPHS: dict[torch.device, tuple[CapturedAverages, Any]] = {}
"""Per device, the graphs of the kept recipes' in-place averages (keyed by the recipe's digest) and
the side stream they replay on."""


def _forget_graphs(digest: int) -> None:
    """Drop the graphs of ``digest``'s recipe (replaced or evicted: its tables may be freed)."""
    for graphs, _ in _GRAPHS.values():
        graphs.forget(digest)


def _replayed(digest: int | None, recipe: _DeviceRecipe, group: dist.ProcessGroup, average: Callable[[], None]) -> bool:
    """Run one device's in-place average as a CUDA graph where one is captured or due; whether it did.

    The same parameters averaged again cost the same kernels and collectives every call: on
    models of many tensors their host time is most of the call (4x H200: a ResNet-34's 110
    tensors 1.84x a raw allreduce of the same bytes, replayed 1.14x). Unless ``DCOMM_CUDA_GRAPHS=0``
    (set alike on every rank), from the third call with the same recipe (``digest``) the
    average is captured once and replayed; every eighth call stays eager so that the NCCL
    watchdog keeps seeing a collective (see :mod:`dcomm.core.captured_average`). The graph holds
    at most the staging of the small parameters (``bucket_cap_mb``) while its recipe is kept.
    It also holds ``group``: the call key names the group by ``id``, and a group destroyed and
    replaced by a new one at the same address would otherwise replay the old communicator.
    """
    if digest is None or not (recipe.in_place and recipe.by_nccl) or not switched_on(SWITCH):
        return False  # switched off: no registry, no side stream, nothing more per call
    if torch.cuda.is_current_stream_capturing():
        return False
    kept = _GRAPHS.get(recipe.device)
    if kept is None:
        kept = _GRAPHS[recipe.device] = (
            CapturedAverages("average_parameters", max_graphs=_RECIPES_KEPT),
            torch.cuda.Stream(recipe.device),
        )
    graphs, stream = kept
    work = graphs.replay(digest, stream, watched=True)
    if work is None and graphs.due(digest):

        def captured() -> int:
            average()
            return 0

        work = graphs.capture(digest, captured, stream, keep=(recipe, group))
    if work is None:
        return False
    work.wait()
    return True


def _joins(
    tensors: list[torch.Tensor], spans: list[tuple[int, int]], group: dist.ProcessGroup, by_nccl: bool
) -> list[int]:
    """Which tensor each one is joined to (:func:`dcomm.averaging._layout.successors`), the same on every rank.

    Joined tensors become one allreduce, so every rank must join the same ones. Views of one
    storage join as laid out alike on every rank. On NCCL, separate tensors back to back in one
    CUDA allocation join too; where they lie depends on each rank's allocations, so the ranks
    keep only the links that all of them have: one allreduce of 16 bytes per tensor and one
    device-to-host copy, once per recipe. That is skipped (storages alone join) off NCCL, while a
    CUDA graph is being captured, and where no tensor's byte count is a multiple of the caching
    allocator's 512-byte blocks (then nothing can follow it in the same allocation); each of
    these is the same on every rank.
    """
    if len(tensors) < 2:
        return [-1] * len(tensors)
    may_follow = any(t.nbytes % ALLOCATOR_BLOCK_BYTES == 0 for t in tensors)
    if not (by_nccl and may_follow) or (tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return successors(spans, storage_regions(tensors))
    mine = successors(spans, memory_regions(tensors))
    # One MIN gives every link's smallest value and its largest, negated: the ranks agree where they are equal.
    bounds = torch.tensor(mine + [-link for link in mine], dtype=torch.int64, device=tensors[0].device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MIN, group=group)
    agreed = bounds.tolist()
    low, negated_high = agreed[: len(tensors)], agreed[len(tensors) :]
    return [link if link == -high else -1 for link, high in zip(low, negated_high, strict=True)]


def _prepare(
    params: list[torch.Tensor], group: dist.ProcessGroup, paths: _Paths
) -> tuple[_Recipe, dict[torch.device, list[list[torch.Tensor]]]]:
    """Check every parameter and decide each device's path (raises before any collective but :func:`_joins`).

    ``paths.pack_max_bytes`` must already be bounded by the bucket cap. Also returns the dense
    views it made of the in-place devices' parameters, for this call only (the recipe, which is
    kept, holds indices).
    """
    by_device, integers = _by_device(params, group)
    devices = []
    dense: dict[torch.device, list[list[torch.Tensor]]] = {}
    for device, groups in by_device.items():
        by_nccl = reduced_by_nccl(group, device)
        in_place = by_nccl if paths.in_place is None else paths.in_place
        joined: list[list[list[int]] | None] = []
        small: list[list[int]] = []
        tables: list[TensorTable | None] = []
        if in_place:
            tensors = dense[device] = [[_dense(params[i]) for i in indices] for indices in groups]
            spans = [[(t.data_ptr(), t.nbytes) for t in ts] for ts in tensors]
            in_place = not _overlap([span for group_spans in spans for span in group_spans])
        if in_place:
            for ts, sp in zip(tensors, spans, strict=True):
                group_chains = chains(_joins(ts, sp, group, by_nccl))
                merged = _merged(ts, group_chains)
                joined.append(group_chains if len(merged) < len(ts) else None)
                fewest = paths.small_min_tensors
                staged, table = _staged_ones(merged, paths.stage_below_bytes, paths.stage_run_bytes, fewest)
                small.append(staged if table is not None else _small_ones(merged, paths.pack_max_bytes, fewest))
                tables.append(table)
        devices.append(_DeviceRecipe(device, groups, in_place, joined, small, tables, by_nccl))
    return _Recipe(devices, integers), dense


def _average_on_device(
    recipe: _DeviceRecipe,
    params: list[torch.Tensor],
    group: dist.ProcessGroup,
    cap_bytes: float,
    paths: _Paths,
    groups: list[list[torch.Tensor]] | None = None,
) -> None:
    """Average one device's parameters (one list per dtype) in place, or else through buckets.

    ``groups``: their dense views when :func:`_prepare` has just made them, else None.
    """
    if groups is None:
        groups = [[_dense(params[i]) for i in indices] for indices in recipe.groups]
    if recipe.in_place:
        for tensors, group_chains, small, table in zip(groups, recipe.joined, recipe.small, recipe.tables, strict=True):
            merged = tensors if group_chains is None else _merged(tensors, group_chains)
            if paths.on_in_place is not None:
                paths.on_in_place(merged)
            staged = None if table is None else (table, cap_bytes)
            _average_in_place(merged, group, paths.launch_max_tensors, small, staged)
        return
    flat_groups = [[t if t.dim() == 1 else t.view(-1) for t in ts] for ts in groups]
    staging = _Staging(
        recipe.device,
        max(sum(f.numel() for f in flats) * flats[0].element_size() for flats in flat_groups),
        max(flats[0].element_size() for flats in flat_groups),
        cap_bytes,
    )
    for flats in flat_groups:
        _average_group(flats, group, staging)
