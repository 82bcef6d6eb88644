"""Collectives that return futures and average with pre/post division on every backend.

Averaging here is a reduction (``SUM`` unless told otherwise; see
:func:`dcomm.core.plan_average`) between two plain divisions: ``tensor / pre``, then the
reduction, then ``/ post``. The renamed single-tensor collectives of torch 2.13 are here too, under
their new names, for every supported torch.

Example::

    >>> fut = allreduce_future(grad, group, predivide=2.0, postdivide=2.0)  # doctest: +SKIP
    >>> averaged = fut.wait()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core.torch_private import allgather_base, allgather_options, reduce_scatter_base

__all__ = [
    "all_gather_single",
    "completed_future",
    "allreduce_future",
    "gather_objects",
    "rank_device",
    "reduced_by_nccl",
    "group_size",
    "member_size",
    "reduce_scatter_future",
    "reduce_scatter_single",
    "resolve_group",
    "start_all_gather",
    "start_allreduce",
    "start_reduce_scatter",
]


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """Return ``group``, or the default (WORLD) group when it is None.

    Raises ``RuntimeError`` when no default process group exists yet.

    Example::

        >>> resolve_group(None) is dist.group.WORLD  # doctest: +SKIP
        True
    """
    if group is not None:
        return group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "process_group: got None and the default process group is not initialized; "
            "call torch.distributed.init_process_group() first or pass a group"
        )
    world = dist.group.WORLD
    assert world is not None
    return world


def rank_device(group: dist.ProcessGroup) -> torch.device | None:
    """The GPU this rank's NCCL collectives on ``group`` go through when no tensor names one; None off NCCL.

    The group's bound device (``init_process_group(device_id=...)``) where it has one; else GPU
    ``LOCAL_RANK % device_count`` where the launcher sets ``LOCAL_RANK`` (torchrun does: right
    also when a host runs fewer ranks than it has GPUs); else GPU ``rank % device_count``, the
    GPU torch's own NCCL ``barrier`` picks for a rank in that case.

    Example::

        >>> rank_device(dist.group.WORLD)  # local rank 1 of an NCCL job launched by torchrun  # doctest: +SKIP
        device(type='cuda', index=1)
    """
    if not torch.cuda.is_available() or not reduced_by_nccl(group, torch.device("cuda")):
        return None
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    local_rank = os.environ.get("LOCAL_RANK", "")
    index = int(local_rank) if local_rank.isdigit() else dist.get_rank()
    return torch.device("cuda", index % torch.cuda.device_count())


def gather_objects(obj: Any, group: dist.ProcessGroup, device: torch.device | None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in the rank order of ``group``, sent through ``device``.

    ``dist.all_gather_object`` sends its bytes through the current CUDA device on NCCL. A job that
    never called ``torch.cuda.set_device`` (torch's own tests do not) has GPU 0 current on every
    rank, and NCCL refuses two ranks on one GPU; with ``device`` current for the gather, each rank
    uses the GPU its tensors for the call are on.

    Args:
        obj: this rank's object.
        group: the group to gather over (this rank is a member).
        device: the device of this rank's tensors for the call (a CUDA device on NCCL), or None
            to keep the current device.

    Returns:
        One object per rank of ``group``.

    Example::

        >>> gather_objects(("host-a", 4), dist.group.WORLD, params[0].device)  # doctest: +SKIP
        [('host-a', 4), ('host-a', 4)]
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    on_device = torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (WORLD when None).

    Example::

        >>> group_size(None) == dist.get_world_size()  # doctest: +SKIP
        True
    """
    return dist.get_world_size(resolve_group(group))


def member_size(group: dist.ProcessGroup | None, name: str, fix: str) -> int:
    """Size of ``group`` (WORLD when None); a ``ValueError`` naming ``name`` on a rank outside it.

    ``dist.get_world_size`` answers -1 there, which would otherwise surface as a puzzling
    "world size -1" further down.

    Example::

        >>> member_size(dist.new_group([0]), "process_group", "build it on rank 0 only")  # on rank 1  # doctest: +SKIP
        ValueError: process_group: this rank (1) is not a member of the group; build it on rank 0 only
    """
    group = resolve_group(group)
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:  # type: ignore[comparison-overlap]
        raise ValueError(f"{name}: this rank ({dist.get_rank()}) is not a member of the group; {fix}")
    return dist.get_world_size(group)


def reduced_by_nccl(group: dist.ProcessGroup, tensor: torch.Tensor | torch.device) -> bool:
    """Whether a collective on ``group`` reduces ``tensor`` (or tensors on a device) with NCCL.

    Where it does, NCCL-only reduce ops (``AVG``, pre-multiplied sums) are available.

    Example::

        >>> reduced_by_nccl(dist.group.WORLD, torch.ones(1))  # a CPU tensor  # doctest: +SKIP
        False
    """
    device = tensor.device if isinstance(tensor, torch.Tensor) else tensor
    if device.type != "cuda":
        return False
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group this process is not in
        return False


def work_future(work: dist.Work) -> torch.futures.Future:
    """The work's future; backends without one (gloo reduce-scatter) complete it eagerly."""
    try:
        return work.get_future()
    except RuntimeError:
        work.wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def reduce_scatter_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    op: Any = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce-scatter the flat ``tensor`` into ``output``: torch's single-tensor reduce-scatter by either name.

    torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` (the old name warns).

    Example::

        >>> reduce_scatter_single(shard, flat, group)  # doctest: +SKIP
    """
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, tensor, op=op, group=group, async_op=async_op)


def all_gather_single(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *, async_op: bool = False
) -> dist.Work | None:
    """All-gather ``tensor`` from every rank into the flat ``output``, by either of torch's names.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name warns).

    Example::

        >>> all_gather_single(flat, shard, group)  # doctest: +SKIP
    """
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, tensor, group=group, async_op=async_op)


def allreduce_options(op: Any) -> dist.AllreduceOptions:
    """Options for ``ProcessGroup.allreduce`` with ``op``: build them once, reuse them for every call.

    Example::

        >>> options = allreduce_options(dist.ReduceOp.AVG)
        >>> work = group.allreduce([tensor], options)  # doctest: +SKIP
    """
    options = dist.AllreduceOptions()
    options.reduceOp = op  # torch's stub says ReduceOp; a RedOpType (ReduceOp.SUM) converts to one
    return options


_SUM = allreduce_options(dist.ReduceOp.SUM)
# Reductions that order or combine bits: undefined for complex numbers (a sum or a scaled sum is
# the same on the real and imaginary parts, so those reduce the tensor's real view).
_REAL_ONLY_OPS = (
    dist.ReduceOp.MAX,
    dist.ReduceOp.MIN,
    dist.ReduceOp.PRODUCT,
    dist.ReduceOp.BAND,
    dist.ReduceOp.BOR,
    dist.ReduceOp.BXOR,
)


def _reducible(tensor: torch.Tensor, op: Any) -> torch.Tensor:
    """What the process group reduces: ``tensor``, or the real view of a complex one."""
    if not tensor.is_complex():
        return tensor
    if any(op == real_only for real_only in _REAL_ONLY_OPS):  # op first: ReduceOp(MAX) == MAX too
        name = getattr(getattr(op, "op", op), "name", op)  # RedOpType.MAX or a ReduceOp holding one
        raise ValueError(
            f"op: ReduceOp.{name} is not defined for complex tensors (got {tensor.dtype}); "
            "use ReduceOp.SUM, AVG or PREMUL_SUM, or reduce the real and imaginary parts separately"
        )
    return torch.view_as_real(tensor)


def _launch(reducible: torch.Tensor, group: dist.ProcessGroup, op: Any) -> dist.Work:
    return group.allreduce([reducible], _SUM if op == dist.ReduceOp.SUM else allreduce_options(op))


def start_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: Any = dist.ReduceOp.SUM) -> dist.Work:
    """Start reducing ``tensor`` in place over ``group`` (``op``, a sum by default); return the work handle.

    It calls the process group directly, with the options and complex-number handling of
    ``dist.all_reduce(..., async_op=True)`` but without its checks, whose host time a comm hook
    would pay once per bucket on the backward pass's critical path.
    ``group`` must be a group this process belongs to (hooks are handed one). A complex
    ``tensor`` is reduced as its real view, so it takes ``SUM``, ``AVG`` or ``PREMUL_SUM``; an op
    that orders or combines bits (``MAX``, ``PRODUCT``, ``BAND``, ...) raises ``ValueError``.

    Example::

        >>> work = start_allreduce(bucket.buffer(), dist.group.WORLD)  # doctest: +SKIP
        >>> work.wait()  # doctest: +SKIP
    """
    return _launch(_reducible(tensor, op), group, op)


def _reduce_scatter_sum_options() -> Any:
    options = dist.ReduceScatterOptions()
    options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # stub: ReduceOp, value: RedOpType
    return options


_RS_SUM = _reduce_scatter_sum_options()
_ALLGATHER = allgather_options()


def start_reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start summing the flat ``tensor`` over ``group`` into this rank's ``output``; return the work.

    Like :func:`start_allreduce`, a direct call on the process group (no ``dist`` wrapper checks,
    no future): ZeRO overlap pays it once per shard on the backward pass. ``tensor.numel()`` is
    ``output.numel()`` times the group size; the group must contain this process.

    Example::

        >>> start_reduce_scatter(shard, flat, dist.group.WORLD).wait()  # doctest: +SKIP
    """
    return reduce_scatter_base(group, output, tensor, _RS_SUM)


def start_all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start gathering every rank's ``tensor`` into the flat ``output``; return the work.

    The direct-call counterpart of :func:`all_gather_single`.

    Example::

        >>> start_all_gather(flat, shard, dist.group.WORLD).wait()  # doctest: +SKIP
    """
    return allgather_base(group, output, tensor, _ALLGATHER)


def completed_future(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``tensor``: what a comm hook returns when nothing is left to wait for.

    Example::

        >>> completed_future(torch.zeros(2)).wait()
        tensor([0., 0.])
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _divided_in_place(fut: torch.futures.Future, tensor: torch.Tensor, postdivide: float) -> torch.Tensor:
    fut.wait()
    if postdivide != 1.0:
        tensor.div_(postdivide)
    return tensor


def allreduce_future(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
    predivide: float = 1.0, postdivide: float = 1.0, op: Any = dist.ReduceOp.SUM,
) -> torch.futures.Future[torch.Tensor]:  # fmt: skip
    """Reduce ``tensor`` in place over ``group`` (``op``, a sum by default); return a future of ``tensor``.

    ``tensor`` is divided by ``predivide`` before the sum and by ``postdivide`` after it (each
    skipped when 1), so ``predivide * postdivide == world_size`` averages. Every ``op`` takes the
    direct path of :func:`start_allreduce`; the result is bit-identical to ``dist.all_reduce``.

    Example::

        >>> fut = allreduce_future(bucket.buffer(), predivide=dist.get_world_size())  # doctest: +SKIP
    """
    group = resolve_group(group)
    reducible = _reducible(tensor, op)  # refuses a bad op before anything changes
    if predivide != 1.0:
        tensor.div_(predivide)
    fut = _launch(reducible, group, op).get_future()
    return fut.then(lambda f: _divided_in_place(f, tensor, postdivide))


def reduce_scatter_future(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
    predivide: float = 1.0, postdivide: float = 1.0, op: Any = dist.ReduceOp.SUM,
) -> torch.futures.Future[torch.Tensor]:  # fmt: skip
    """Reduce-scatter ``tensor`` (the full, flat input) into ``output`` (this rank's shard).

    ``tensor.numel()`` must be ``output.numel() * world_size``. ``tensor`` is divided in place by
    ``predivide`` first; ``output`` by ``postdivide`` once the sum has landed.

    Example::

        >>> fut = reduce_scatter_future(shard, flat_grad, predivide=2.0)  # doctest: +SKIP
    """
    group = resolve_group(group)
    world = dist.get_world_size(group)
    if tensor.numel() != output.numel() * world:
        raise ValueError(
            f"tensor: expected {output.numel() * world} elements (output.numel()={output.numel()} "
            f"x world size {world}), got {tensor.numel()}; pass the unsharded, padded flat gradient"
        )
    if predivide != 1.0:
        tensor.div_(predivide)
    work = reduce_scatter_single(output, tensor.reshape(-1), group, op=op, async_op=True)
    assert work is not None
    return work_future(work).then(lambda f: _divided_in_place(f, output, postdivide))
