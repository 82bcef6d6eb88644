"""Communication state handed to gradient hooks: the group and how to average over it.

These classes have the names, constructor signatures and public attributes of torch's FSDP hook
state (``torch.distributed.algorithms._comm_hooks``), so code built around those keeps working.

Example::

    >>> import torch.distributed as dist
    >>> from dcomm.core import LowPrecisionState
    >>> state = LowPrecisionState(dist.group.WORLD, parameter_type=torch.float32)  # doctest: +SKIP
    >>> state.gradient_predivide_factor, state.gradient_postdivide_factor  # doctest: +SKIP
    (2.0, 2.0)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcomm.core.collectives import member_size
from dcomm.core.divide_factors import divide_factors

__all__ = ["DefaultState", "LowPrecisionState"]


class DefaultState:
    """The process group a hook communicates over and its pre/post divide factors.

    Example::

        >>> state = DefaultState(dist.group.WORLD)  # doctest: +SKIP
        >>> model.register_comm_hook(state, dcomm.fsdp.allreduce_hook)  # doctest: +SKIP
    """

    __slots__ = (
        "gradient_postdivide_factor",
        "gradient_predivide_factor",
        "process_group",
        "world_size",
    )

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        if process_group is None:
            raise ValueError(
                f"process_group: expected a ProcessGroup for {type(self).__name__}, got None; "
                "pass dist.group.WORLD or the group the hook should reduce over"
            )
        self.process_group = process_group
        self.world_size = member_size(
            process_group,
            "process_group",
            f"build the {type(self).__name__} only on the group's ranks, or pass a group that holds this rank",
        )
        pre, post = divide_factors(self.world_size)
        self.gradient_predivide_factor = pre
        self.gradient_postdivide_factor = post

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(world_size={self.world_size}, "
            f"predivide={self.gradient_predivide_factor}, "
            f"postdivide={self.gradient_postdivide_factor})"
        )


class LowPrecisionState(DefaultState):
    """:class:`DefaultState` plus the dtype that reduced gradients are cast back to.

    Example::

        >>> state = LowPrecisionState(dist.group.WORLD, parameter_type=torch.float32)  # doctest: +SKIP
        >>> model.register_comm_hook(state, dcomm.fsdp.bf16_compress_hook)  # doctest: +SKIP
    """

    __slots__ = ("parameter_type",)

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        parameter_type: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(process_group)
        if not isinstance(parameter_type, torch.dtype) or not parameter_type.is_floating_point:
            kind = ValueError if isinstance(parameter_type, torch.dtype) else TypeError
            raise kind(
                f"parameter_type: expected a floating-point torch.dtype, got {parameter_type!r}; "
                "pass the dtype of the model's parameters, e.g. torch.float32"
            )
        self.parameter_type = parameter_type
