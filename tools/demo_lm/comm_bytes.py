"""Count the bytes each rank hands to collectives, whoever calls them (Python or C++).

Every collective of ``torch.distributed`` reaches the dispatcher as a ``c10d::`` operator:
``dist.all_reduce`` from a comm hook, the all-gathers and reduce-scatters of FSDP and
``fully_shard``, and also the allreduce that DDP's C++ reducer issues for its buckets when no hook
is registered (the built-in path, which no Python wrapper of ``dist.*`` would see). A kernel
registered for these operators at the ``Autograd`` key runs first for every one of them: it adds
the bytes of the tensors this rank sends, then hands the call on to the real (gloo or NCCL)
kernel unchanged.

What counts as sent, per collective: the input of an allreduce, reduce, all-gather,
reduce-scatter, all-to-all, gather and send; the tensor of a broadcast and the inputs of a
scatter on their root only. This is the payload the algorithm hands to ``torch.distributed``
(an fp16 hook's half-size bucket, FSDP's shard), not what the backend's ring or tree moves.

Example::

    >>> counter = CommCounter.install()  # doctest: +SKIP
    >>> with counter.counting():  # doctest: +SKIP
    ...     dist.all_reduce(torch.ones(256))
    >>> counter.bytes_sent  # doctest: +SKIP
    1024
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "SENT_ARGUMENTS"]

SENT_ARGUMENTS: dict[str, tuple[str, str | None]] = {
    "allreduce_": ("tensors", None),
    "allreduce_coalesced_": ("tensors", None),
    "reduce_": ("tensors", None),
    "_allgather_base_": ("input_tensor", None),
    "allgather_": ("input_tensors", None),
    "allgather_coalesced_": ("input_list", None),
    "allgather_into_tensor_coalesced_": ("inputs", None),
    "_reduce_scatter_base_": ("input_tensor", None),
    "reduce_scatter_": ("input_tensors", None),
    "reduce_scatter_tensor_coalesced_": ("inputs", None),
    "alltoall_base_": ("input", None),
    "alltoall_": ("input_tensors", None),
    "gather_": ("input_tensors", None),
    "send": ("tensors", None),
    "broadcast_": ("tensors", "root_rank"),
    "scatter_": ("input_tensors", "root_rank"),
}
"""``c10d::`` operator -> (argument holding what this rank sends, root argument or None)."""


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(item) for item in value)
    return 0


class CommCounter:
    """Bytes this rank handed to collectives inside :meth:`counting` blocks, one per process."""

    _installed: CommCounter | None = None

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.by_collective: dict[str, int] = {}
        """Bytes sent per ``c10d`` operator name."""
        self._active = False
        self._library = torch.library.Library("c10d", "IMPL")  # kept alive: the kernels live with it
        for name, (argument, root) in SENT_ARGUMENTS.items():
            self._library.impl(name, self._kernel(name, argument, root), "Autograd")

    @classmethod
    def install(cls) -> CommCounter:
        """The process's counter, registering its kernels on the first call."""
        if cls._installed is None:
            cls._installed = cls()
        return cls._installed

    def _kernel(self, name: str, argument: str, root: str | None) -> Callable[..., Any]:
        op = getattr(torch.ops.c10d, name).default
        names = [a.name for a in op._schema.arguments]
        sent_at, group_at = names.index(argument), names.index("process_group")
        root_at = None if root is None else names.index(root)

        def count_then_run(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                is_root = root_at is None or dist.ProcessGroup.unbox(args[group_at]).rank() == args[root_at]
                sent = _nbytes(args[sent_at]) if is_root else 0
                self.bytes_sent += sent
                self.by_collective[name] = self.by_collective.get(name, 0) + sent
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args, **kwargs)

        return count_then_run

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the collectives issued inside the block (collectives outside it pass uncounted)."""
        self._active = True
        try:
            yield
        finally:
            self._active = False
