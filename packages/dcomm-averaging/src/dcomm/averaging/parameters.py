"""Parameter averaging in place, with at most one bucket of extra memory: the collective behind every averager.

:func:`average_parameters` replaces each given parameter by its mean over a process group, with
the same arithmetic as torch's ``average_parameters`` (divide by the group size, then ``SUM``; a
list of several floating dtypes in their promotion) but without torch's flat copy of the whole
model: large parameters are averaged in their own storage, the others through staging buckets
of at most ``bucket_cap_mb`` (see :mod:`dcomm.averaging._buckets`). Before the first call on a new
parameter list, the ranks check in one small collective that they all pass alike parameters
(:mod:`dcomm.averaging._agreement`), so a mismatch is one clear error on every rank, never a hang.

Example::

    >>> from dcomm.averaging import average_parameters
    >>> average_parameters(model.parameters(), group, bucket_cap_mb=8)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import functools
import operator
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from dcomm.averaging._agreement import AgreedSignatures, CallSignature, Problem, agree
from dcomm.averaging._buckets import DevicePlan, Piece, average_device, plan_device
from dcomm.averaging._layout import memory_order_view
from dcomm.core import plan_average, rank_device, reduced_by_nccl, resolve_group
from dcomm.core.validation import positive_number

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "average_parameters",
    "average_parameters_or_parameter_groups",
    "check_bucket_cap_mb",
    "get_params_to_average",
]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Default bound, in MiB, on the extra memory one :func:`average_parameters` call allocates (DDP's bucket size)."""

PLANS_KEPT = 8
"""Plans kept per process group: the parameter lists averaged last (a model, its param groups, a second model)."""


def check_bucket_cap_mb(bucket_cap_mb: object) -> float:
    """``bucket_cap_mb`` as a float, or the error naming it.

    Args:
        bucket_cap_mb: the bound on staging memory, in MiB.

    Returns:
        The bound.

    Raises:
        TypeError: not a number (a bool is not one).
        ValueError: not positive.

    Example::

        >>> check_bucket_cap_mb(8)
        8.0
    """
    return positive_number("bucket_cap_mb", bucket_cap_mb, f"pass a bound in MiB, e.g. {DEFAULT_BUCKET_CAP_MB:g}")


class _CallPlan(NamedTuple):
    """What a call does: per device, its floating-point parameters' plan; the integer ones; the signature."""

    devices: tuple[DevicePlan, ...]
    integers: tuple[int, ...]
    signature: CallSignature


_PLANS: weakref.WeakKeyDictionary[dist.ProcessGroup, collections.OrderedDict[Any, _CallPlan]] = (
    weakref.WeakKeyDictionary()
)
"""Per process group (gone with it), the plans of its last parameter lists, most recent last."""

_AGREED = AgreedSignatures()

_dtype_of = operator.attrgetter("dtype")


def _plan_key(params: list[torch.Tensor], cap_bytes: float) -> tuple[Any, ...] | None:
    """What must not change for a plan to hold: each parameter's address, size and dtype (None: no address)."""
    try:
        addresses = tuple(map(torch.Tensor.data_ptr, params))
    except (RuntimeError, TypeError):  # a sparse tensor, or not a tensor: no plan is kept (its check raises)
        return None
    return (cap_bytes, addresses, tuple(map(torch.Tensor.numel, params)), tuple(map(_dtype_of, params)))


def _problem(param: torch.Tensor, nccl_group: bool) -> str | None:
    """Why ``param`` cannot be averaged, or None."""
    if not isinstance(param, torch.Tensor):
        return f"params: got an item of type {type(param).__name__}; pass tensors (a model's parameters)"
    if param.layout != torch.strided:
        return (
            f"params: a parameter of shape {tuple(param.shape)} has the {param.layout} layout; average_parameters "
            "averages dense tensors: convert it with param.data = param.data.to_dense()"
        )
    if param.device.type == "meta":
        return (
            f"params: a parameter of shape {tuple(param.shape)} is on the meta device and holds no data; "
            "materialize the model first (model.to_empty(device=...) and load its weights)"
        )
    if param.is_complex():
        return (
            f"params: a parameter has the complex dtype {param.dtype}; average its real view instead "
            "(torch.view_as_real(param))"
        )
    if nccl_group and param.device.type == "cpu":
        return (
            "params: a parameter is on the CPU but process_group uses the 'nccl' backend, which only reduces "
            "GPU tensors; move the parameters to the GPU or create the group with backend='cpu:gloo,cuda:nccl'"
        )
    if param.is_floating_point() and memory_order_view(param) is None:
        return (
            f"params: a parameter of shape {tuple(param.shape)} and strides {param.stride()} has gaps or "
            "overlaps in memory, so it cannot be averaged in place; make it contiguous first "
            "(param.data = param.data.contiguous())"
        )
    return None


def _make_plan(params: list[torch.Tensor], group: dist.ProcessGroup, cap_bytes: float) -> _CallPlan | Problem:
    """Check every parameter and plan the call, or the first problem found (nothing is averaged then)."""
    if not params:
        return Problem(
            "ValueError",
            "params: got no parameters to average; pass the same non-empty parameters on every rank of the "
            "group (for param groups, only parameters with a gradient are averaged: call it after backward)",
        )
    nccl_group = str(dist.get_backend(group)) == "nccl"
    floats: dict[torch.device, list[int]] = {}
    integers: list[int] = []
    seen: set[int] = set()
    for index, param in enumerate(params):
        problem = _problem(param, nccl_group)
        if problem is not None:
            return Problem("ValueError", problem)
        if id(param) in seen or param.numel() == 0:
            continue
        seen.add(id(param))
        if param.is_floating_point():
            floats.setdefault(param.device, []).append(index)
        else:
            integers.append(index)
    devices = []
    if floats:
        # One dtype for the whole list, as torch.cat makes it in torch's average_parameters.
        dtype = functools.reduce(torch.promote_types, {params[i].dtype for ids in floats.values() for i in ids})
        world = dist.get_world_size(group)
        # NCCL's AVG multiplies by 1 / world inside the sum: torch's bits where that is exact.
        exact_avg = world & (world - 1) == 0
        for device, indices in floats.items():
            average = plan_average(
                group, dtype, device, arithmetic="predivide", nccl_average=exact_avg, nccl_premul=False
            )
            grouped = reduced_by_nccl(group, device)
            devices.append(plan_device(params, indices, dtype, cap_bytes, grouped, average))
    described = tuple((p.numel(), str(p.dtype), p.device.type) for p in params)
    layout = tuple((str(d.dtype), _numels(params, d.in_place), d.bucket_numels) for d in devices)
    return _CallPlan(tuple(devices), tuple(integers), CallSignature(cap_bytes, described, layout))


def _numels(params: list[torch.Tensor], pieces: tuple[Piece, ...]) -> tuple[int, ...]:
    return tuple(params[p.param].numel() if p.length < 0 else p.length for p in pieces)


def _agreement_device(params: list[torch.Tensor], group: dist.ProcessGroup) -> torch.device | None:
    """The device the ranks' agreement goes through: this rank's first GPU parameter's, else the group's."""
    gpus = (p.device for p in params if isinstance(p, torch.Tensor) and p.device.type == "cuda")
    return next(gpus, None) or rank_device(group)


def _fail_together(params: list[torch.Tensor], group: dist.ProcessGroup, problem: Problem) -> NoReturn:
    """Raise ``problem`` on every rank of ``group`` (the peers learn of it in their check)."""
    agree(group, problem, None, _agreement_device(params, group))
    raise AssertionError("agree raises where a rank has a problem")


def _plan_for(params: list[torch.Tensor], group: dist.ProcessGroup, bucket_cap_mb: object) -> _CallPlan:
    """The call's plan, kept from an earlier call with the same parameters or made and agreed now."""
    try:
        cap_bytes = check_bucket_cap_mb(bucket_cap_mb) * 2**20
    except (TypeError, ValueError) as error:
        _fail_together(params, group, Problem(type(error).__name__, str(error)))
    key = _plan_key(params, cap_bytes)
    plans = _PLANS.setdefault(group, collections.OrderedDict())
    plan = plans.get(key) if key is not None else None
    if plan is None:
        made = _make_plan(params, group, cap_bytes)
        if isinstance(made, Problem):
            _fail_together(params, group, made)
        plan = made
    # Looked up on every call, so that every rank keeps (and drops) the same agreed signatures.
    if not _AGREED.contains(group, plan.signature):
        agree(group, None, plan.signature, _agreement_device(params, group))
        _AGREED.add(group, plan.signature)
    if key is not None:
        plans[key] = plan
        plans.move_to_end(key)
        while len(plans) > PLANS_KEPT:
            plans.popitem(last=False)
    return plan


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


def average_parameters(
    params: Iterable[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Replace every parameter in ``params`` by its mean over ``process_group``, in place.

    The result is torch's ``average_parameters``' to the bit where the two send the same message
    (always at two ranks): each value is divided by the group size, then summed over the group, in
    the parameters' dtype; a list of several floating dtypes is averaged in their promotion (fp16
    and bf16 in float32), as torch's ``torch.cat`` does. Unlike torch, the parameters keep their
    storage and dtype (optimizers and views that hold them stay valid), and the extra memory is at
    most ``bucket_cap_mb``, never a copy of the whole model:

    * a parameter of at least 1 MiB (or half the cap, if smaller), or a run of parameters lying
      back to back in one storage (:func:`flatten_parameters` makes a model one run per dtype),
      is averaged in its own storage: on NCCL in one grouped launch, elsewhere one allreduce each;
    * the others are copied, in order, into staging buckets (one of the staged bytes if they fit
      in the cap, else two of half the cap that alternate), averaged there and copied back.

    On NCCL at a power-of-two group size, fp32, fp64 and bf16 use ``ReduceOp.AVG`` (the same bits,
    one division pass fewer; but NCCL's NVLS and SHARP algorithms reduce ``SUM`` only, so where
    they would serve torch's ``SUM``, sums of 4+ ranks may round differently). Integer and bool
    tensors (BatchNorm's ``num_batches_tracked``) get their mean truncated toward zero, as torch
    gives them, but from an exact int64 sum. Tied parameters (one object passed twice) are
    averaged once. Nothing waits on the host on CUDA: the current stream waits for each
    collective. On a rank outside ``process_group`` nothing changes.

    The call is a collective: every rank of the group must pass the same parameters (sizes,
    dtypes, devices, order, memory layout) and the same ``bucket_cap_mb``. The first call with a
    new list spends one small collective to check that; a difference, or a parameter that cannot
    be averaged on any rank, raises the same error on every rank, naming the rank, before any
    value changes. Later calls with the same list cost no check (a list that later differs on
    some ranks only is not caught).

    For a model of many small tensors, :func:`flatten_parameters` (once, before training) makes
    each call one allreduce per dtype, in place.

    Args:
        params: the tensors to average (a module's ``parameters()``, or any tensors).
        process_group: the group to average over; WORLD when None.
        bucket_cap_mb: the bound on extra memory, in MiB (default 25, as DDP's buckets).

    Raises:
        ValueError: on every rank of the group, when a rank passes no parameters, a meta, sparse
            or complex tensor, a layout with gaps, a CPU tensor on an NCCL group, or parameters
            that differ from another rank's; or ``bucket_cap_mb`` is not positive.
        TypeError: ``bucket_cap_mb`` is not a number.

    Example::

        >>> average_parameters(model.parameters())  # every rank of WORLD  # doctest: +SKIP
        >>> average_parameters(model.parameters(), node_group, bucket_cap_mb=8)  # doctest: +SKIP
    """
    group = resolve_group(process_group)
    if dist.get_rank(group) < 0:  # not a member: nothing to average here
        return
    params = list(params)
    plan = _plan_for(params, group, bucket_cap_mb)
    with torch.no_grad():
        for device_plan in plan.devices:
            average_device(device_plan, params, group)
        if plan.integers:
            _average_integers([params[i].detach() for i in plan.integers], group)


def get_params_to_average(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
) -> list[torch.nn.Parameter]:
    """The parameters in ``params`` that have a gradient, in order (torch's rule, torch's result).

    Parameters whose ``.grad`` is None (frozen, or unused this step) are skipped: averaging them
    would undo nothing a local step did. Every rank must skip the same ones (the averaging that
    follows checks it on its first call with a new list).

    Args:
        params: a module's parameters, or an optimizer's param groups (dicts with ``"params"``).

    Returns:
        The parameters with a gradient.

    Raises:
        NotImplementedError: an item is neither a tensor nor a param group (torch's exception type).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> model.weight.grad = torch.zeros_like(model.weight)
        >>> get_params_to_average(model.parameters()) == [model.weight]
        True
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
    """Average, in place, the parameters in ``params`` that have a gradient (see :func:`get_params_to_average`).

    What every averager calls at a step that averages.

    Args:
        params: a module's parameters, or an optimizer's param groups.
        process_group: the group to average over; WORLD when None.
        bucket_cap_mb: the bound on extra memory, in MiB (see :func:`average_parameters`).

    Raises:
        NotImplementedError: an item is neither a tensor nor a param group.
        ValueError, TypeError: as :func:`average_parameters`, on every rank of the group.

    Example::

        >>> loss.backward()  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
        >>> average_parameters_or_parameter_groups(optimizer.param_groups)  # doctest: +SKIP
    """
    average_parameters(get_params_to_average(params), process_group, bucket_cap_mb=bucket_cap_mb)
