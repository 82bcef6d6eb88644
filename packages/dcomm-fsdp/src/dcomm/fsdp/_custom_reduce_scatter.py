"""What dcomm's FSDP2 reduce-scatters share: the call FSDP2 makes, its checks, and their installation.

FSDP2 (``fully_shard``) lets a module replace its reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``). dcomm's replacements average by themselves, so
:func:`install_reduce_scatter` also turns FSDP2's own division off, and :class:`AveragingReduceScatter`
refuses any op but ``SUM``. A subclass implements only :meth:`AveragingReduceScatter._reduce_scatter`.

Example::

    >>> class PlainAverage(AveragingReduceScatter):
    ...     installer = "use_plain_average"
    ...
    ...     def _reduce_scatter(self, output_tensor, input_tensor, group):
    ...         world = dist.get_world_size(group)
    ...         check_sizes(output_tensor, input_tensor, world)
    ...         dist.reduce_scatter_tensor(output_tensor, input_tensor.div_(world), group=group)
    >>> install_reduce_scatter(model, PlainAverage())  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

# The FSDPModule methods this needs; all exist in every torch that dcomm-fsdp supports (>= 2.11).
_REQUIRED_METHODS = ("set_custom_reduce_scatter", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms")
_MIN_TORCH = "2.11"


class CompletedWork:
    """What ``async_op=True`` returns: the work already finished on the current stream."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


def check_sizes(output_tensor: torch.Tensor, input_tensor: torch.Tensor, world: int) -> None:
    """Refuse an input that is not ``world`` chunks of the output's size."""
    if input_tensor.numel() != output_tensor.numel() * world:
        raise ValueError(
            f"input_tensor: expected {output_tensor.numel() * world} elements (output numel "
            f"{output_tensor.numel()} x group size {world}), got {input_tensor.numel()}"
        )


class AveragingReduceScatter:
    """A custom FSDP2 reduce-scatter that writes the average, not the sum, so FSDP2 must not divide.

    ``installer`` names the ``dcomm.fsdp`` function that installs a subclass (for the error
    message); the subclass implements :meth:`_reduce_scatter`.
    """

    __slots__ = ()
    installer: ClassVar[str]

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Allocate FSDP2's reduce-scatter input/output buffer (plain caching allocator).

        Example::

            >>> comm.allocate((4,), dtype=torch.float32, device=torch.device("cpu")).shape  # doctest: +SKIP
            torch.Size([4])
        """
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> CompletedWork | None:
        """Write the average over ``group`` of this rank's chunk of ``input_tensor`` into ``output_tensor``.

        FSDP2 calls it on its reduce-scatter stream, and the work is queued on that stream when
        this returns: with ``async_op=True`` the returned work is already complete.

        Example::

            >>> comm(shard, flat_grad, dist.group.WORLD)  # doctest: +SKIP
        """
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"op: {type(self).__name__} averages by itself and needs ReduceOp.SUM, got {op}; install it "
                f"with dcomm.fsdp.{self.installer}(module), which turns off FSDP's own averaging, instead of "
                "set_custom_reduce_scatter alone"
            )
        self._reduce_scatter(output_tensor, input_tensor, group)
        return CompletedWork() if async_op else None

    def _reduce_scatter(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Write the average (see :meth:`__call__`); ``input_tensor`` is FSDP2's scratch buffer."""
        raise NotImplementedError


def _fsdp_module_class(caller: str) -> type:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as exc:  # pragma: no cover - torch < 2.6
        raise RuntimeError(
            f"{caller} needs torch.distributed.fsdp.FSDPModule (fully_shard), which torch "
            f"{torch.__version__} lacks; upgrade to torch >= {_MIN_TORCH}"
        ) from exc
    missing = [name for name in _REQUIRED_METHODS if not hasattr(FSDPModule, name)]
    if missing:
        raise RuntimeError(
            f"{caller} needs FSDPModule.{', FSDPModule.'.join(missing)}, which torch "
            f"{torch.__version__} lacks; upgrade to torch >= {_MIN_TORCH}"
        )
    return FSDPModule


def _check_not_hsdp(module: nn.Module) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    for name, param in module.named_parameters():
        if isinstance(param, DTensor) and any(isinstance(p, Replicate) for p in param.placements):
            raise ValueError(
                f"module: parameter {name!r} is replicated over a dimension of mesh "
                f"{tuple(param.device_mesh.shape)} (HSDP), whose all-reduce this reduce-scatter cannot "
                "average; use a 1-D mesh, or MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) for HSDP"
            )


def fully_shard_modules(module: nn.Module, installer: str, hint: str = "") -> list[Any]:
    """The ``fully_shard`` modules in ``module`` (itself included), after checking it can take a reduce-scatter.

    Raises as :func:`~dcomm.fsdp.use_low_precision_reduction` documents: no ``fully_shard``
    module (``hint`` ends that error), HSDP, or a torch without the FSDP2 methods. ``installer``
    names the calling function in the errors.

    Example::

        >>> fully_shard_modules(model, "use_low_precision_reduction")  # doctest: +SKIP
        [FSDPTransformer(...), FSDPBlock(...)]
    """
    fsdp_module = _fsdp_module_class(installer)
    targets: list[Any] = [m for m in module.modules() if isinstance(m, fsdp_module)]
    if not targets:
        raise ValueError(
            f"module: no fully_shard module in {type(module).__name__}; call "
            f"torch.distributed.fsdp.fully_shard(module) first{hint}"
        )
    _check_not_hsdp(module)
    return targets


def install_reduce_scatter(module: nn.Module, comm: AveragingReduceScatter, hint: str = "") -> list[Any]:
    """Give every ``fully_shard`` module in ``module`` the reduce-scatter ``comm``; return those modules.

    Each one also gets a gradient divide factor of 1 and SUM-only reductions, since ``comm``
    averages by itself. Raises as :func:`fully_shard_modules`.
    """
    targets = fully_shard_modules(module, comm.installer, hint)
    set_reduce_scatter(targets, comm)
    return targets


def set_reduce_scatter(targets: list[Any], comm: AveragingReduceScatter) -> None:
    """Give each of the checked ``targets`` (see :func:`fully_shard_modules`) ``comm``, a divide factor of 1 and SUM.

    Example::

        >>> set_reduce_scatter(fully_shard_modules(model, comm.installer), comm)  # doctest: +SKIP
    """
    for target in targets:
        target.set_custom_reduce_scatter(comm)
        target.set_gradient_divide_factor(1.0)
        target.set_force_sum_reduction_for_comms(True)
