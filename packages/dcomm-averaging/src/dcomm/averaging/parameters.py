"""In-place parameter averaging without a flat copy of the model: the collective behind every averager.

:func:`average_parameters` replaces each given parameter by its mean over a process group without
ever building a flat copy of the model. Parameters are grouped by ``(device, dtype)``; each group
takes one of two paths:

* **In place, at most ``bucket_cap_mb`` extra** -- GPU tensors on an NCCL group: every parameter
  of 1 MiB or more is allreduced in its own storage (fp32/fp64/bf16 with NCCL's ``AVG``; fp16
  divided in place with ``torch._foreach_div_`` around a ``SUM``), through the group's coalesced
  allreduce: one grouped NCCL launch for up to 1024 parameters. Parameters that lie back to back
  in one storage (a flattened model) are one allreduce. Each collective in a grouped launch
  costs a few microseconds of host and device time whatever its size, so the smaller
  parameters (norms, biases, a CNN's early convolutions, a narrow transformer's projections) are
  streamed instead through at most ``bucket_cap_mb`` of staging by a table of their addresses
  (:class:`dcomm.core.tensor_table.TensorTable`, built once): one Triton launch packs a run of
  them, one allreduce averages it, one launch copies it back, whatever the number of tensors.
  Without Triton, the small parameters (64 KiB or less) are packed into one buffer of at most
  1 MiB instead.
* **Buckets, at most ``bucket_cap_mb`` extra** -- everywhere else (gloo and CPU parameters, or
  GPU parameters that alias one another): parameters are streamed through a bounded staging
  area: pack a slice into a flat buffer, divide, allreduce (``SUM``), copy back into the
  parameters' own storage. When a group is larger than one bucket the staging area is split
  into two half-bucket buffers so that packing bucket ``i + 1`` overlaps the allreduce of
  bucket ``i``.

On NCCL (unless ``DCOMM_CUDA_GRAPHS=0``, set alike on every rank), a call on the in-place path that
repeats the last ones (the same parameters in the same storage, as a periodic averager passes
them) is replayed from the third call on as one CUDA graph of all its kernels and collectives
(:func:`_replayed`): its host time no longer grows with the number of parameters.

The pieces live beside this module, one concept each: ``_layout`` (memory-order views, aliasing,
back-to-back runs), ``_in_place`` (the NCCL path), ``_buckets`` (the bounded staging path) and
``_recipes`` (the checks and decisions of a call, kept for the next call, and their replay).

Either way parameters keep their storage (optimizers and views that hold them stay valid) and
their dtype (a bf16 parameter is averaged in bf16, never promoted), and the arithmetic is the
same up to the last bit: :func:`dcomm.core.plan_average` decides it for both paths.

Example::

    >>> from dcomm.averaging import average_parameters
    >>> average_parameters(model.parameters(), group, bucket_cap_mb=8)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist

from dcomm.averaging import _agreement
from dcomm.averaging._recipes import (
    _average_on_device,
    _call_key,
    _keep,
    _Paths,
    _prepare,
    _recipe_for,
    _replayed,
    _signature,
)
from dcomm.core import resolve_group
from dcomm.core.validation import positive_number

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "average_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Default bound, in MiB, on the extra memory one :func:`average_parameters` call allocates."""


def _check_bucket_cap_mb(bucket_cap_mb: object) -> float:
    return positive_number("bucket_cap_mb", bucket_cap_mb, f"pass a bound in MiB, e.g. {DEFAULT_BUCKET_CAP_MB:g}")


def _average_integers(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average integer and bool tensors as torch does (the mean, truncated toward zero), but exactly.

    torch averages them in floating point and casts back; here their int64 sum is exact and the
    division truncates (a bool becomes True where any rank holds True, as in torch). One ``SUM``
    allreduce per device.
    """
    world = dist.get_world_size(group)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for members in by_device.values():
        total = torch.cat([t.reshape(-1).to(torch.int64) for t in members])
        dist.all_reduce(total, group=group)
        for tensor, summed in zip(members, total.split([t.numel() for t in members]), strict=True):
            mean = summed if tensor.dtype == torch.bool else torch.div(summed, world, rounding_mode="trunc")
            tensor.copy_(mean.view_as(tensor))


def _average_parameters(
    params: Iterable[torch.Tensor],
    process_group: dist.ProcessGroup | None,
    bucket_cap_mb: float,
    paths: _Paths | None = None,
) -> None:
    """:func:`average_parameters` with its paths chosen by ``paths``.

    The checks and path decisions of a call are kept (as indices) and reused while the next call
    passes the same parameters with the same storage: a periodic averager pays them once.
    """
    cap_bytes = _check_bucket_cap_mb(bucket_cap_mb) * 2**20
    group = resolve_group(process_group)
    if dist.get_rank(group) < 0:  # not a member: nothing to average here
        return
    paths = paths or _Paths()
    # Never more than a bucket; a staged tensor fits half of one (the two pipelined buffers).
    paths = paths._replace(
        pack_max_bytes=min(paths.pack_max_bytes, int(cap_bytes)), stage_run_bytes=int(cap_bytes // 2)
    )
    params = list(params)
    key = _call_key(params, group, paths)
    digest, recipe = _recipe_for(key)
    signature = recipe.signature if recipe is not None else _signature(params, paths)
    # Looked up on every call, so every rank agrees at the same calls whatever its kept recipes.
    agreement = _agreement.lookup(group, signature)
    if recipe is not None and recipe.agreement is not agreement:
        recipe = None  # made under an agreement dropped since (or, if None, about to be made again)
    dense: dict[torch.device, list[list[torch.Tensor]]] = {}
    if recipe is None:
        recipe, dense = _prepare(params, group, paths, signature, agreement)
        if agreement is None:  # the ranks have just agreed
            _agreement.keep(group, signature, recipe.agreement)
    if key is not None and digest is not None:
        _keep(digest, key, recipe)
    graph_key = digest if paths.graphs else None
    with torch.no_grad():
        for device_recipe in recipe.devices:
            average = functools.partial(
                _average_on_device, device_recipe, params, group, cap_bytes, paths, dense.get(device_recipe.device)
            )
            if not _replayed(graph_key, device_recipe, group, average):
                average()
        if recipe.integers:
            _average_integers([params[i].detach() for i in recipe.integers], group)


def average_parameters(
    params: Iterable[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Replace every parameter in ``params`` by its mean over ``process_group``, in place.

    ``process_group`` defaults to WORLD; on a rank outside it this changes nothing. Parameters may
    live on several devices and have several dtypes: each ``(device, dtype)`` group is averaged in
    its own dtype. GPU parameters on an NCCL group are divided and allreduced in their own
    storage: one allreduce for parameters that lie back to back in memory (views of one storage,
    or separate parameters in one CUDA allocation, as the caching allocator places most of a
    model's; the ranks join only what every rank can), one grouped NCCL launch for up to 1024 of
    the others of 1 MiB or more; the smaller ones are streamed through at
    most ``bucket_cap_mb`` of staging, a few allreduces in all (with Triton; without it the ones
    of 64 KiB or less are packed into at most 1 MiB). Elsewhere
    (gloo, CPU) they go through buckets of at most ``bucket_cap_mb`` MiB of extra memory per
    device (a parameter larger than a bucket is split across buckets); so do GPU parameters that
    alias one another. A dense non-contiguous layout (channels-last) is averaged through its
    memory-order flat view, which is contiguous, on either path. The reduce op and divisions come
    from :func:`dcomm.core.plan_average`: fp32/fp64/fp16 are divided by the group size before the
    ``SUM`` (as torch does; an fp16 sum cannot overflow), bf16 after it; on NCCL,
    ``ReduceOp.AVG`` averages fp32/fp64/bf16 inside the collective. Integer and bool tensors
    (BatchNorm's ``num_batches_tracked``) get their mean truncated toward zero, as torch gives
    them (torch computes it in floating point; here the sum is exact). No device synchronize: on
    CUDA the current stream waits for each allreduce, so later work on that stream sees the
    averaged values.

    Every rank of the group must pass the same parameters in the same order, laid out alike (views
    of one buffer on one rank are views of one buffer on every rank, as the same model code gives).
    On NCCL the ranks agree which parameters to join in one small collective the first time they
    pass parameters of these sizes and dtypes; a rank whose parameters get new storage later
    (``param.data = ...``, ``load_state_dict(..., assign=True)``), on its own or with the others,
    keeps what was agreed, averaging parameters no longer back to back through a buffer. So does
    a second list of the same sizes and dtypes averaged over the same group object (a flattened
    copy of the model, a second model of the same shapes): it follows the first list's joins, and
    copies those its own memory breaks; average it over a group of its own
    (``dist.new_group(ranks)``) to have joins of its own.
    Everything is checked before the first collective, so a bad parameter raises with nothing
    averaged: an empty ``params`` (torch raises too; the peers would otherwise wait for this rank),
    a sparse, meta or complex tensor, a CPU tensor on an NCCL group.

    On NCCL, from the third call with the same parameters in the same storage, the in-place
    average is captured once as a CUDA graph and replayed (every eighth call stays eager, so that
    the NCCL watchdog keeps timing a collective); the graph keeps the small parameters' staging
    (at most ``bucket_cap_mb``) reserved while it lives, and is released when a process group is
    destroyed and at exit. ``DCOMM_CUDA_GRAPHS=0``, set alike on every rank, turns it off.

    Example::

        >>> average_parameters(model.parameters(), None)  # doctest: +SKIP
    """
    _average_parameters(params, process_group, bucket_cap_mb)


def get_params_to_average(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
) -> list[torch.nn.Parameter]:
    """The parameters in ``params`` that have a gradient, in order.

    ``params`` is a module's parameters or an optimizer's param groups (dicts with ``"params"``);
    parameters whose ``.grad`` is None (frozen, or unused this step) are skipped.

    Example::

        >>> get_params_to_average(optimizer.param_groups)  # doctest: +SKIP
    """
    chosen: list[torch.nn.Parameter] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            candidates: Iterable[torch.nn.Parameter] = [item]
        elif isinstance(item, dict) and "params" in item:
            candidates = item["params"]
        else:
            raise NotImplementedError(
                f"params: an item of type {type(item).__name__} is neither a parameter nor a param "
                "group; pass model.parameters() or optimizer.param_groups"
            )
        chosen.extend(p for p in candidates if p.grad is not None)
    return chosen


def average_parameters_or_parameter_groups(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
    process_group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Average a module's parameters or an optimizer's param groups that have a gradient.

    Example::

        >>> average_parameters_or_parameter_groups(optimizer.param_groups, None)  # doctest: +SKIP
    """
    average_parameters(get_params_to_average(params), process_group, bucket_cap_mb=bucket_cap_mb)
