"""torch's per-parameter ZeRO checkpoint format for element-wise shards (``reduce_scatter=True``).

With element-wise sharding the local optimizer's parameters are slices of flat bucket buffers,
so its state is per slice. :func:`state_dict` joins the slices that ``consolidate_state_dict()``
gathered and cuts them back into parameters (the format of a non-overlapped
``ZeroRedundancyOptimizer``); values that are not element-wise (Adam's ``step``) come from rank 0.
:func:`load_state_dict` does the reverse, so checkpoints move freely between this path, the
other overlap paths and non-overlapped ZeRO. The public entry points are
:func:`dcomm.ddp.zero_state_dict` and :func:`dcomm.ddp.load_zero_state_dict`.

Example::

    >>> zero.consolidate_state_dict(to=0)  # doctest: +SKIP
    >>> saved = state_dict(zero, shards)  # on rank 0  # doctest: +SKIP
    >>> load_state_dict(zero, shards, saved)  # on every rank  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

import dcomm.ddp._torch_private as private
from dcomm.ddp._zero.layout import Shard

# State entries that are per-step scalars even for 0-dim parameters (used only to classify the
# state of buckets made of 0-dim parameters alone, where shapes cannot tell).
_SCALAR_KEYS = ("step", "eta", "mu")


def _joined(shard: Shard, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-parameter state of ``shard`` from every rank's slice state (rank order)."""
    per_param: list[dict[str, Any]] = [{} for _ in shard.params]
    for key, first in parts[0].items():
        if torch.is_tensor(first) and first.dim() == 1 and first.numel() == shard.chunk:
            full = torch.cat([part[key].reshape(-1).cpu() for part in parts])
            for entry, p, offset in zip(per_param, shard.params, shard.offsets, strict=True):
                entry[key] = full[offset : offset + p.numel()].view_as(p).clone()
        else:
            for entry in per_param:
                entry[key] = first.clone() if torch.is_tensor(first) else first
    return per_param


def state_dict(zero: ZeroRedundancyOptimizer, shards: list[Shard]) -> dict[str, Any]:
    """torch's per-parameter ZeRO format, from the slices ``consolidate_state_dict`` gathered."""
    private.check_overlap_initialized(zero)
    gathered = private.all_state_dicts(zero)
    if len(gathered) == 0:
        raise RuntimeError(
            "Optimizer state has not been consolidated on this rank. Please call "
            "`consolidate_state_dict(to=...)` on all ranks beforehand if you meant to save the "
            "global state."
        )
    result = torch.optim.Optimizer.state_dict(zero)
    index_of = private.param_to_index(zero)
    state: dict[int, dict[str, Any]] = {}
    for shard in shards:
        parts = [sd["state"].get(shard.index) for sd in gathered]
        if all(part is None for part in parts):
            continue
        if any(part is None for part in parts):
            raise RuntimeError(f"state: bucket {shard.index} has optimizer state on some ranks only")
        for p, entry in zip(shard.params, _joined(shard, parts), strict=True):
            state[index_of[p]] = entry
    result["state"] = dict(sorted(state.items()))
    return result


def _elementwise(key: str, values: list[Any], params: list[torch.Tensor]) -> bool:
    if not all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, params, strict=True)):
        return False
    return any(p.dim() > 0 for p in params) or key not in _SCALAR_KEYS


def _sliced(zero: ZeroRedundancyOptimizer, shard: Shard, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """This rank's slice state of ``shard`` from the per-parameter ``entries``."""
    result: dict[str, Any] = {}
    for key in entries[0]:
        values = [entry[key] for entry in entries]
        if _elementwise(key, values, shard.params):
            full = torch.zeros(zero.world_size * shard.chunk, dtype=values[0].dtype, device=shard.flat.device)
            for value, p, offset in zip(values, shard.params, shard.offsets, strict=True):
                full[offset : offset + p.numel()].copy_(value.reshape(-1))
            result[key] = full[zero.rank * shard.chunk : (zero.rank + 1) * shard.chunk].clone()
        else:
            result[key] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
    return result


def load_state_dict(zero: ZeroRedundancyOptimizer, shards: list[Shard], saved: dict[str, Any]) -> None:
    """Load a per-parameter ZeRO (or plain optimizer) state dict into this rank's slices."""
    private.check_overlap_initialized(zero)
    params = private.all_params(zero)
    groups = saved.get("param_groups", [])
    if len(groups) != 1 or len(groups[0]["params"]) != len(params):
        raise ValueError(
            f"state_dict: expected 1 parameter group of {len(params)} parameters, got "
            f"{[len(g['params']) for g in groups]}; load a checkpoint of this model's optimizer"
        )
    saved_index = dict(zip(params, groups[0]["params"], strict=True))
    saved_state = saved.get("state", {})
    local: dict[int, dict[str, Any]] = {}
    for shard in shards:
        entries = [saved_state.get(saved_index[p]) for p in shard.params]
        if all(entry is None for entry in entries):
            continue
        if any(entry is None for entry in entries):
            raise ValueError(
                f"state_dict: bucket {shard.index} mixes parameters with and without optimizer "
                "state; reduce_scatter=True steps whole buckets, so every parameter needs state"
            )
        local[shard.index] = _sliced(zero, shard, entries)
    group = {k: v for k, v in groups[0].items() if k != "params"}
    group["params"] = list(range(len(shards)))
    zero.optim.load_state_dict({"state": local, "param_groups": [group]})
    private.sync_param_groups(zero, groups, zero.param_groups)
    private.sync_param_groups(zero, zero.param_groups, zero.optim.param_groups)
