"""fp16/bf16 gradient reduction with pre/post division for ``fully_shard`` (FSDP2) modules.

FSDP2 has no ``register_comm_hook``. It does let a module replace its reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``) and turn off its own gradient division
(``set_gradient_divide_factor(1.0)`` with ``set_force_sum_reduction_for_comms(True)``), and it
copies the gradients into its reduce-scatter input in the module's reduce dtype
(``MixedPrecisionPolicy.reduce_dtype``), converting them on the way at no extra cost.
:func:`use_low_precision_reduction` uses all three on every ``fully_shard`` module of a model: the
reduce dtype becomes fp16/bf16, so :class:`LowPrecisionReduceScatter` receives its input already
in low precision and only divides: by the pre-divide factor before a plain ``SUM``
reduce-scatter (no ``ReduceOp.AVG``, no bf16 ``PREMUL_SUM``: works on gloo and NCCL alike) and by
the post-divide factor on the shard, which FSDP2 then casts back to the parameter dtype.

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> from dcomm.fsdp import low_precision_mp_policy, use_low_precision_reduction
    >>> for block in model.blocks:  # doctest: +SKIP
    ...     fully_shard(block, mp_policy=low_precision_mp_policy(torch.bfloat16))
    >>> fully_shard(model, mp_policy=low_precision_mp_policy(torch.bfloat16))  # doctest: +SKIP
    >>> use_low_precision_reduction(model, torch.bfloat16)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dcomm.core import (
    LOW_PRECISION_DTYPES,
    AveragePlan,
    average_sync,
    cast_for_communication,
    copy_back,
    keep_until_stream_done,
    plan_average,
    reduce_scatter_single,
    reduced_by_nccl,
    warn_once,
)
from dcomm.core.torch_private import TorchChanged
from dcomm.fsdp._custom_reduce_scatter import (
    AveragingReduceScatter,
    check_sizes,
    fully_shard_modules,
    set_reduce_scatter,
)
from dcomm.fsdp._torch_private import (
    fsdp_param_groups,
    mp_policy,
    mp_policy_holders,
    reduces_as_fsdp_default,
    refresh_mp_dtypes,
    set_mp_policy,
    shard_group,
)

__all__ = ["LowPrecisionReduceScatter", "low_precision_mp_policy", "use_low_precision_reduction"]


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(
            f"dtype: expected torch.float16 or torch.bfloat16, got {dtype!r}; "
            "pass the dtype to communicate gradients in"
        )


class LowPrecisionReduceScatter(AveragingReduceScatter):
    """A custom FSDP2 reduce-scatter that communicates in ``dtype`` and averages with pre/post divide.

    FSDP2 calls it as ``comm(output_tensor, input_tensor, group, op)`` on its reduce-scatter
    stream; ``op`` must be ``SUM`` (set up by :func:`use_low_precision_reduction`).

    Fast path, taken when FSDP2's reduce dtype is ``dtype`` (what :func:`use_low_precision_reduction`
    arranges): the input and output buffers already are ``dtype``, so nothing is cast or
    allocated. The input (FSDP2's scratch buffer) is divided in place by the pre-divide factor of
    ``group``'s size, summed into ``output_tensor`` with a ``SUM`` reduce-scatter, and the shard
    divided in place by the post-divide factor; FSDP2 casts it back to the parameter dtype. Two
    cases need no separate pass over the input:

    - fp16 on NCCL: the pre-divide is NCCL's pre-multiplied sum by ``1 / pre`` (a power of two, so
      the product is exact and equal to the division).
    - bf16: bf16 has float32's exponent range, so dividing by ``pre`` (a power of two) is exact,
      the sum of the divided inputs is the divided sum, and ``(sum / pre) / post`` rounds exactly
      like ``sum / world``. On NCCL (more than one rank) the reduce-scatter is NCCL's ``AVG``, the
      op torch's own bf16 reduction uses; elsewhere (gloo has no ``AVG``) the shard is divided once
      by the group size, giving bit for bit the result of the separate pre/post divide. Never
      ``PREMUL_SUM`` for bf16.

    Fallback, for input in another dtype (a reduce dtype that could not be changed): the input is
    cast to ``dtype`` divided by the pre-divide factor into a new buffer, and the shard written
    back in the output's dtype divided by the post-divide factor. Those buffers are allocated on,
    and tied to, the stream that runs the collective, which is synchronous with respect to that
    stream, so their memory is never reused while the reduce-scatter is in flight. Each such call
    adds 1 to ``fallbacks``; the first one in a process warns once, on rank 0.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``, the dtype the gradients travel in.

    Raises:
        ValueError: ``dtype`` is not fp16 or bf16; on a call, ``op`` is not ``SUM`` or the input
            is not ``world`` times the output.

    Example::

        >>> fsdp_module.set_custom_reduce_scatter(LowPrecisionReduceScatter(torch.float16))  # doctest: +SKIP
    """

    __slots__ = ("_plans", "dtype", "fallbacks")
    installer = "use_low_precision_reduction"

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        _check_dtype(dtype)
        self.dtype = dtype
        self.fallbacks = 0  # reductions that took the slower cast path (public, for monitoring)
        self._plans: dict[tuple[Any, ...], tuple[int, AveragePlan | None, AveragePlan]] = {}

    def __repr__(self) -> str:
        return f"LowPrecisionReduceScatter(dtype={self.dtype})"

    def _plan(
        self, group: dist.ProcessGroup, input_tensor: torch.Tensor, output_tensor: torch.Tensor
    ) -> tuple[int, AveragePlan | None, AveragePlan]:
        """``(group size, the fast path's plan or None, the cast fallback's plan)`` for these buffers.

        Worked out once per group, device type and buffer dtypes: FSDP2 calls the reduce-scatter
        once per module per backward, on its critical path. The fast path takes the best plan of
        :func:`dcomm.core.plan_average` for ``self.dtype`` (NCCL ``AVG`` for bf16, fp16's
        pre-division folded into NCCL's pre-multiplied sum, ``SUM`` then one division for bf16 on
        gloo); the fallback divides in its casts around a plain ``SUM``.
        """
        world = dist.get_world_size(group)
        fallback = plan_average(
            group, self.dtype, input_tensor.device, arithmetic="split", nccl_average=False, nccl_premul=False
        )
        if input_tensor.dtype != self.dtype or output_tensor.dtype != self.dtype:
            return world, None, fallback
        return world, plan_average(group, self.dtype, input_tensor.device), fallback

    def _reduce_scatter(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """The fast path where the buffers are ``self.dtype``, else the cast fallback (see the class)."""
        key = (group, input_tensor.device.type, input_tensor.dtype, output_tensor.dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(group, input_tensor, output_tensor)
        world, fast, fallback = plan
        check_sizes(output_tensor, input_tensor, world)
        if fast is not None:  # the fast path: FSDP2 already converted the input to self.dtype
            average_sync(input_tensor, group, fast, output=output_tensor)
            return
        self.fallbacks += 1
        warn_once(
            ("LowPrecisionReduceScatter", self.dtype, input_tensor.dtype),
            f"LowPrecisionReduceScatter({self.dtype}): got a {input_tensor.dtype} reduce-scatter input, "
            f"so it casts to {self.dtype} itself (correct, one extra pass over the gradients; counted in "
            f"its .fallbacks); pass mp_policy=dcomm.fsdp.low_precision_mp_policy({self.dtype}) to "
            "fully_shard so that FSDP converts the gradients in its copy-in",
        )
        low_input = cast_for_communication(input_tensor, self.dtype, fallback.pre)
        low_output = torch.empty_like(output_tensor, dtype=self.dtype)
        reduce_scatter_single(low_output, low_input, group, op=fallback.op)
        copy_back(output_tensor, low_output, fallback.post)
        keep_until_stream_done(low_input)
        keep_until_stream_done(low_output)


def low_precision_mp_policy(
    dtype: torch.dtype = torch.bfloat16,
    *,
    param_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
) -> Any:
    """The ``MixedPrecisionPolicy`` to pass to ``fully_shard`` for :func:`use_low_precision_reduction`.

    Its ``reduce_dtype`` is ``dtype``, so FSDP2 converts the gradients to fp16/bf16 while it
    copies them into the reduce-scatter input; the other fields are passed through.
    :func:`use_low_precision_reduction` sets the same reduce dtype on modules built without it
    (through FSDP2 internals); passing this policy needs only public API.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``, the reduce dtype.
        param_dtype: passed to ``MixedPrecisionPolicy``.
        output_dtype: passed to ``MixedPrecisionPolicy``.
        cast_forward_inputs: passed to ``MixedPrecisionPolicy``.

    Returns:
        A ``torch.distributed.fsdp.MixedPrecisionPolicy``.

    Raises:
        ValueError: ``dtype`` is not fp16 or bf16.

    Example::

        >>> low_precision_mp_policy(torch.float16).reduce_dtype
        torch.float16
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _check_dtype(dtype)
    return MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=dtype,
        output_dtype=output_dtype,
        cast_forward_inputs=cast_forward_inputs,
    )


def _reduces_in(policy: Any, dtype: torch.dtype) -> bool:
    """Whether FSDP2's reduce dtype under ``policy`` is ``dtype`` whatever the parameter dtype."""
    return policy.reduce_dtype == dtype or (policy.reduce_dtype is None and policy.param_dtype == dtype)


def _set_reduce_dtype(module: nn.Module, dtype: torch.dtype) -> bool:
    """Make ``module``'s FSDP2 parameter groups reduce in ``dtype``; False (and a warning) where torch differs.

    FSDP2 has no public setter for the mixed-precision policy after ``fully_shard``: the
    parameter groups and their policies (on the group up to torch 2.14, on each parameter in
    2.15) are reached through :mod:`dcomm.fsdp._torch_private`. Where a torch release changed
    them the reduce-scatter casts by itself (correct, slower) and the warning says which member
    changed.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    try:
        for group in fsdp_param_groups(module):
            changed = False
            for holder in mp_policy_holders(group):
                policy = mp_policy(holder)
                if not isinstance(policy, MixedPrecisionPolicy):
                    raise TorchChanged(
                        f"torch {torch.__version__} changed FSDP2's mp_policy: got {type(policy).__name__}"
                    )
                if not _reduces_in(policy, dtype):
                    set_mp_policy(holder, dataclasses.replace(policy, reduce_dtype=dtype))
                    changed = True
            if changed:
                refresh_mp_dtypes(group)
    except TorchChanged as changed:
        warnings.warn(f"use_low_precision_reduction: {changed}", UserWarning, stacklevel=3)
        return False
    return True


def use_low_precision_reduction(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> LowPrecisionReduceScatter:
    """Make every ``fully_shard`` module in ``module`` reduce gradients in ``dtype`` (fp16 or bf16).

    Call it after ``fully_shard`` and before the first backward. Each FSDP2 module under (and
    including) ``module`` gets a mixed-precision policy whose ``reduce_dtype`` is ``dtype`` (the
    other fields unchanged), so FSDP2 converts the gradients while copying them into the
    reduce-scatter input and back to the parameter dtype after it; and a
    :class:`LowPrecisionReduceScatter`, a gradient divide factor of 1 and SUM-only reductions, so
    the averaging is done once, by dcomm's pre/post divide. Except bf16 over NCCL on modules that
    reduce as ``fully_shard`` left them: FSDP2's own bf16 reduction there is NCCL's ``AVG``, the
    average dcomm would compute, so nothing else is installed and torch reduces, bit for bit as
    with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` and without a Python call per
    reduce-scatter (the returned object is then not installed). Build the modules with
    ``mp_policy=low_precision_mp_policy(dtype)`` to set the reduce dtype with public API only;
    otherwise it is set here through FSDP2's parameter groups. Where that is impossible (a torch
    whose internals differ) dcomm's reduce-scatter is installed whatever the dtype; it receives
    higher-precision input, casts it by itself (correct, one extra pass over the gradients) and
    warns once.

    As with torch's ``reduce_dtype``: the sharded gradients keep the parameter dtype, gradients
    accumulated without reduction (``set_requires_gradient_sync(False)``) are kept in ``dtype``,
    and an fp16 gradient element beyond fp16's range (65504) overflows in the copy-in. The sum of
    the ranks is divided before by ``divide_factors(world)[0]`` (torch's FSDP factors), so, as with
    torch, it overflows where the mean exceeds 65504 * pre / world (32752 at 4 ranks).

    Args:
        module: a model with ``fully_shard`` applied to it or to its submodules.
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        The :class:`LowPrecisionReduceScatter` (installed unless torch's own bf16 reduction was kept).

    Raises:
        ValueError: a dtype other than fp16/bf16, a module without ``fully_shard``, or HSDP (a 2-D
            mesh with replication).
        RuntimeError: a torch without the FSDP2 methods.

    Example::

        >>> fully_shard(model, mp_policy=low_precision_mp_policy(torch.float16))  # doctest: +SKIP
        >>> use_low_precision_reduction(model, torch.float16)  # doctest: +SKIP
        LowPrecisionReduceScatter(dtype=torch.float16)
    """
    comm = LowPrecisionReduceScatter(dtype)
    hint = (
        " (for FullyShardedDataParallel use register_comm_hook with dcomm.fsdp.fp16_compress_hook or "
        "bf16_compress_hook)"
    )
    targets = fully_shard_modules(module, comm.installer, hint)
    converted = [_set_reduce_dtype(target, dtype) for target in targets]
    if not (all(converted) and _torch_averages_alike(module, targets, dtype)):
        set_reduce_scatter(targets, comm)
    return comm


def _torch_averages_alike(module: nn.Module, targets: list[Any], dtype: torch.dtype) -> bool:
    """Whether FSDP2's own reduction of ``targets`` already is dcomm's average, so nothing is installed.

    That is bf16 over NCCL with FSDP2's defaults (its own reduce-scatter, no divide factor, no
    forced ``SUM``): NCCL's ``AVG`` in bf16, which is :class:`LowPrecisionReduceScatter`'s fast
    path too, without a Python call per reduce-scatter. Not fp16 (torch divides in two extra
    kernels there; dcomm folds its pre-divide into the collective), nor gloo (no ``AVG``).
    """
    if dtype != torch.bfloat16:
        return False
    param = next(module.parameters(), None)
    if param is None:
        return False
    try:
        groups = [group for target in targets for group in fsdp_param_groups(target)]
    except TorchChanged:
        return False
    for group in groups:
        process_group = shard_group(group)
        if process_group is None or not reduces_as_fsdp_default(group):
            return False
        if not reduced_by_nccl(process_group, param.device):
            return False
    return bool(groups)
