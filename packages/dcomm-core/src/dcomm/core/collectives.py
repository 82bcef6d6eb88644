"""Collectives that return futures and average with pre/post division on every backend.

``ReduceOp.AVG`` is NCCL-only and premultiplied sums are unreliable for bf16, so averaging here is
always a ``SUM`` between two plain divisions: ``tensor / pre``, then the sum, then ``/ post``.

Example::

    >>> fut = allreduce_future(grad, group, predivide=2.0, postdivide=2.0)  # doctest: +SKIP
    >>> averaged = fut.wait()  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "allreduce_future",
    "reduced_by_nccl",
    "group_size",
    "reduce_scatter_future",
    "resolve_group",
    "start_allreduce",
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


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (WORLD when None).

    Example::

        >>> group_size(None) == dist.get_world_size()  # doctest: +SKIP
        True
    """
    return dist.get_world_size(resolve_group(group))


def reduced_by_nccl(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether a collective on ``group`` reduces ``tensor`` with NCCL (a CUDA tensor, NCCL backend).

    Where it does, NCCL-only reduce ops (``AVG``, pre-multiplied sums) are available.

    Example::

        >>> reduced_by_nccl(dist.group.WORLD, torch.ones(1))  # a CPU tensor  # doctest: +SKIP
        False
    """
    if tensor.device.type != "cuda":
        return False
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group this process is not in
        return False


def _work_future(work: dist.Work) -> torch.futures.Future:
    """The work's future; backends without one (gloo reduce-scatter) complete it eagerly."""
    try:
        return work.get_future()
    except RuntimeError:
        work.wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    # torch >= 2.13 renamed reduce_scatter_tensor to reduce_scatter_single.
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = op(output, tensor, group=group, async_op=True)
    assert work is not None
    return work


def _sum_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's stub: ReduceOp, the value: RedOpType
    return options


_SUM = _sum_options()


def start_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start summing ``tensor`` in place over ``group``; return the collective's work handle.

    It calls the process group directly: the checks of ``dist.all_reduce`` cost about 10 us of
    host time per call, which a comm hook pays once per bucket on the backward pass's critical
    path. ``group`` must be a group this process belongs to (hooks are handed one).

    Example::

        >>> work = start_allreduce(bucket.buffer(), dist.group.WORLD)  # doctest: +SKIP
        >>> work.wait()  # doctest: +SKIP
    """
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return group.allreduce([tensor], _SUM)


def _divided_in_place(fut: torch.futures.Future, tensor: torch.Tensor, postdivide: float) -> torch.Tensor:
    fut.wait()
    if postdivide != 1.0:
        tensor.div_(postdivide)
    return tensor


def allreduce_future(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    predivide: float = 1.0,
    postdivide: float = 1.0,
) -> torch.futures.Future[torch.Tensor]:
    """Sum ``tensor`` in place over ``group`` asynchronously; return a future of ``tensor``.

    ``tensor`` is divided by ``predivide`` before the sum and by ``postdivide`` after it (each
    skipped when 1), so ``predivide * postdivide == world_size`` averages.

    Example::

        >>> fut = allreduce_future(bucket.buffer(), predivide=dist.get_world_size())  # doctest: +SKIP
    """
    group = resolve_group(group)
    if predivide != 1.0:
        tensor.div_(predivide)
    fut = start_allreduce(tensor, group).get_future()
    return fut.then(lambda f: _divided_in_place(f, tensor, postdivide))


def reduce_scatter_future(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    predivide: float = 1.0,
    postdivide: float = 1.0,
) -> torch.futures.Future[torch.Tensor]:
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
    work = _reduce_scatter(output, tensor.reshape(-1), group)
    return _work_future(work).then(lambda f: _divided_in_place(f, output, postdivide))
