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

from dcomm.averaging import _agreement, _native_key
from dcomm.averaging._agreement import Agreement
from dcomm.averaging._allocations import span_over
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
from dcomm.averaging._layout import _dense, _flat_view, _merged, _overlap, chains
from dcomm.core import foreach_copy_, reduced_by_nccl
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
    whether NCCL reduces them (then their average may be replayed as a CUDA graph: :func:`_replayed`).

    ``rejoined``: per dtype, a buffer for each agreed chain that no longer lies back to back on
    this rank (:func:`dcomm.averaging._agreement.broken_chains`), by chain index: its tensors are
    copied in, averaged as one, and copied back, so that every rank still makes the same allreduces.

    ``spans``: per dtype, on CUDA, the merged tensors as 1-D tensors over their bytes that own
    nothing (:func:`dcomm.averaging._allocations.span_over`), or None (then they are made per
    call). A recipe is used only while every parameter keeps its address, so the spans are valid
    whenever it is, and an eager call skips a dense view per parameter and a view per chain.
    """

    device: torch.device
    groups: list[list[int]]
    in_place: bool
    joined: list[list[list[int]] | None]
    small: list[list[int]]
    tables: list[TensorTable | None]
    by_nccl: bool
    rejoined: list[dict[int, torch.Tensor]]
    spans: list[list[torch.Tensor] | None]


class _Recipe(NamedTuple):
    """What :func:`_prepare` decided for one list of parameters: indices and staging tables, never a parameter.

    A table holds the staged parameters' addresses, which the call key pins (their ``data_ptr``).
    ``agreement``: the joins agreed by the ranks that the recipe follows; the recipe holds only
    while its call ``signature`` keeps that agreement.
    """

    devices: list[_DeviceRecipe]
    integers: list[int]
    agreement: Agreement
    signature: _agreement.Signature


_RECIPES: collections.OrderedDict[int, tuple[tuple[Any, ...], _Recipe]] = collections.OrderedDict()
"""The recipes of the last calls by the hash of their key, most recent last (a periodic averager
passes the same parameters; several parameter lists, or several groups, are averaged in turn)."""

_RECIPES_KEPT = 16

_dtype_of = operator.attrgetter("dtype")


def _call_key(params: list[torch.Tensor], group: dist.ProcessGroup, paths: _Paths) -> tuple[Any, ...] | None:
    """What must not change for a recipe to hold: the group, the paths, and each parameter's
    address, size and dtype (read in C++ once built: :mod:`dcomm.averaging._native_key`).

    A recipe depends on each parameter's address and byte count, not on its shape or identity
    (it holds indices, and its tables and graphs hold addresses). None when a parameter has no
    storage address (sparse): such calls are prepared every time.
    """
    where = _native_key.where_function(params)
    if where is not None:
        if not _KEY_IN_CPP:
            _read_keys_in_cpp()
        found = where(params)
        return None if found is None else (id(group), paths, found)
    try:
        pointers = tuple(map(torch.Tensor.data_ptr, params))
    except RuntimeError:
        return None
    return (id(group), paths, pointers, tuple(map(torch.Tensor.numel, params)), tuple(map(_dtype_of, params)))


_KEY_IN_CPP = False
"""Whether keys are read in C++ (from the first call after the build finished)."""


def _read_keys_in_cpp() -> None:
    """Drop the recipes and graphs kept under keys read in Python: no C++ key will ever match them.

    Once per process; the last call's graph may still be replaying, so the devices finish first.
    """
    global _KEY_IN_CPP
    _KEY_IN_CPP = True
    if any(len(graphs) for graphs, _ in _GRAPHS.values()):
        for device in _GRAPHS:
            torch.cuda.synchronize(device)
    for digest in list(_RECIPES):
        _forget_graphs(digest)
    _RECIPES.clear()


def _signature(params: list[torch.Tensor], paths: _Paths) -> _agreement.Signature:
    """The call's signature (:class:`dcomm.averaging._agreement.Signature`), alike on every rank.

    Made when a call has no recipe; a recipe keeps the one it was made under (its key pins the
    sizes and dtypes the signature names).
    """
    return _agreement.Signature(paths, tuple(map(torch.Tensor.numel, params)), tuple(map(_dtype_of, params)))


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
    if replaced is not None and replaced[1] is recipe:
        _RECIPES.move_to_end(digest)  # the usual call: the kept recipe again
        return
    if replaced is not None:
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


def _prepare(
    params: list[torch.Tensor],
    group: dist.ProcessGroup,
    paths: _Paths,
    signature: _agreement.Signature,
    agreement: Agreement | None,
) -> tuple[_Recipe, dict[torch.device, list[list[torch.Tensor]]]]:
    """Check every parameter and decide each device's path (raises before any collective but the agreement's).

    ``agreement``: the joins the ranks agreed on for this call's signature, or None: then they
    agree now (:func:`dcomm.averaging._agreement.agreed_links`), on every rank alike, and the
    recipe holds the new agreement. ``paths.pack_max_bytes`` must already be bounded by the bucket
    cap. Also returns the dense views it made of the in-place devices' parameters, for this call
    only (the recipe, which is kept, holds indices).
    """
    by_device, integers = _by_device(params, group)
    agreeing = agreement is None
    links: list[list[int] | None] = [] if agreement is None else agreement.links
    position = 0  # of the in-place (device, dtype) group in the agreement
    devices = []
    dense: dict[torch.device, list[list[torch.Tensor]]] = {}
    for device, groups in by_device.items():
        by_nccl = reduced_by_nccl(group, device)
        in_place = by_nccl if paths.in_place is None else paths.in_place
        joined: list[list[list[int]] | None] = []
        small: list[list[int]] = []
        tables: list[TensorTable | None] = []
        rejoined: list[dict[int, torch.Tensor]] = []
        owning_nothing: list[list[torch.Tensor] | None] = []
        if in_place:
            tensors = dense[device] = [[_dense(params[i]) for i in indices] for indices in groups]
            spans = [[(t.data_ptr(), t.nbytes) for t in ts] for ts in tensors]
            in_place = not _overlap([span for group_spans in spans for span in group_spans])
        if in_place:
            for ts, sp in zip(tensors, spans, strict=True):
                if agreeing:
                    links.append(_agreement.agreed_links(ts, sp, group, by_nccl))
                agreed = _agreement.links_for(links, position, len(ts))
                position += 1
                group_chains = chains(_agreement.local_links(ts, sp, agreed))
                broken = [] if agreeing or agreed is None else _agreement.broken_chains(ts, sp, group_chains)
                buffers = {i: ts[0].new_empty(sum(ts[j].numel() for j in group_chains[i])) for i in broken}
                merged = _merged(ts, group_chains, buffers)
                joined.append(group_chains if len(merged) < len(ts) else None)
                fewest = paths.small_min_tensors
                staged, table = _staged_ones(merged, paths.stage_below_bytes, paths.stage_run_bytes, fewest)
                small.append(staged if table is not None else _small_ones(merged, paths.pack_max_bytes, fewest))
                tables.append(table)
                rejoined.append(buffers)
                owning_nothing.append(_spans(merged) if device.type == "cuda" and not buffers else None)
        devices.append(
            _DeviceRecipe(device, groups, in_place, joined, small, tables, by_nccl, rejoined, owning_nothing)
        )
    return _Recipe(devices, integers, Agreement(links) if agreement is None else agreement, signature), dense


def _spans(merged: list[torch.Tensor]) -> list[torch.Tensor]:
    """``merged`` as 1-D CUDA tensors over the same bytes that own nothing (see :class:`_DeviceRecipe`)."""
    return [span_over(tensor, tensor.nbytes) for tensor in merged]


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
    if recipe.in_place:
        for position, (group_chains, small, table, buffers, spans) in enumerate(
            zip(recipe.joined, recipe.small, recipe.tables, recipe.rejoined, recipe.spans, strict=True)
        ):
            if spans is not None:
                tensors, merged = [], spans
            else:
                tensors = (
                    groups[position] if groups is not None else [_dense(params[i]) for i in recipe.groups[position]]
                )
                merged = tensors if group_chains is None else _merged(tensors, group_chains, buffers)
            if paths.on_in_place is not None:
                paths.on_in_place(merged)
            staged = None if table is None else (table, cap_bytes)
            if not buffers:
                _average_in_place(merged, group, paths.launch_max_tensors, small, staged)
                continue
            assert group_chains is not None  # buffers stand in for chains only
            members = [tensors[i].reshape(-1) for chain_index in buffers for i in group_chains[chain_index]]
            pieces = [
                piece
                for chain_index, buffer in buffers.items()
                for piece in buffer.split([tensors[i].numel() for i in group_chains[chain_index]])
            ]
            foreach_copy_(pieces, members)
            _average_in_place(merged, group, paths.launch_max_tensors, small, staged)
            foreach_copy_(members, pieces)
        return
    if groups is None:
        groups = [[_dense(params[i]) for i in indices] for indices in recipe.groups]
    flat_groups = [[t if t.dim() == 1 else t.view(-1) for t in ts] for ts in groups]
    staging = _Staging(
        recipe.device,
        max(sum(f.numel() for f in flats) * flats[0].element_size() for flats in flat_groups),
        max(flats[0].element_size() for flats in flat_groups),
        cap_bytes,
    )
    for flats in flat_groups:
        _average_group(flats, group, staging)
