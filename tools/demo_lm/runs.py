"""The table of runs: algorithm name -> {implementation -> builder}.

A builder takes the rank's :class:`Context` and returns a :class:`Trainee`: the model to
evaluate and the closure that trains it one step. ``torch`` builders use
``torch.distributed``'s own algorithm, ``dcomm`` builders the dcomm replacement. The baseline is
DDP with its built-in (C++) allreduce. A builder whose dcomm piece is not installed (DiLoCo, the
int8/fp8 and PowerSGD hooks while they are being built) raises :class:`Unavailable`: the run is
skipped with a note, and joins by itself once the name can be imported.

Example::

    >>> sorted(ALGORITHMS[BASELINE])
    ['torch']
    >>> sorted(ALGORITHMS["DDP fp16_compress_hook"])
    ['dcomm', 'torch']
"""

from __future__ import annotations

import collections
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tools.impls import IMPLEMENTATIONS
from tools.impls import resolve as shared_resolve

from .config import Config
from .model import TinyGPT, next_byte_loss

__all__ = [
    "ALGORITHMS",
    "BASELINE",
    "FAMILIES",
    "CONVERGENCE_GOAL",
    "DILOCO_GOAL",
    "DILOCO_TOLERANCE",
    "Context",
    "Trainee",
    "Unavailable",
]


class Unavailable(Exception):
    """The run's dcomm piece is not installed here (yet): skip it with this note."""


def _load(path: str) -> Any:
    """``"module:name"`` -> the object; :class:`Unavailable` when dcomm lacks it."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        if not module.startswith("dcomm."):
            raise
        raise Unavailable(f"{path} is not installed here") from exc


_POWERSGD = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
_BEYOND_SHARED_TABLE = {
    "PowerSGDState": {"dcomm": "dcomm.ddp:PowerSGDState", "torch": f"{_POWERSGD}:PowerSGDState"},
    "powerSGD_hook": {"dcomm": "dcomm.ddp:powerSGD_hook", "torch": f"{_POWERSGD}:powerSGD_hook"},
}
"""Names the demo needs that ``tools.impls`` does not list (yet)."""


def has_both(name: str) -> bool:
    """Whether torch and dcomm both have ``name`` (the shared table or the demo's extras)."""
    return name in IMPLEMENTATIONS or name in _BEYOND_SHARED_TABLE


def resolve(impl: str, name: str) -> Any:
    """The object called ``name`` in dcomm or torch; :class:`Unavailable` when dcomm lacks it."""
    if name in _BEYOND_SHARED_TABLE:
        return _load(_BEYOND_SHARED_TABLE[name][impl])
    try:
        return shared_resolve(impl, name)
    except (ImportError, AttributeError) as exc:
        if impl != "dcomm":
            raise
        raise Unavailable(f"dcomm's {name} is not installed here") from exc


# --------------------------------------------------------------------------------------------
# What a builder gets and returns


@dataclass
class Context:
    """This rank's place in the job and the configuration every run shares."""

    config: Config
    rank: int
    world: int
    device: torch.device
    node_size: int
    node_group: dist.ProcessGroup | None

    def new_model(self) -> TinyGPT:
        """The same initial model on every rank and in every run."""
        return self.config.new_model().to(self.device)

    def ddp(self, module: nn.Module) -> nn.parallel.DistributedDataParallel:
        device_ids = [self.device] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)

    def adamw(self, params: Any, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW) -> Any:
        return optimizer_class(params, lr=self.config.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def hierarchy(self) -> collections.OrderedDict[int, int]:
        """Average within a node every ``period // 2`` steps and over the world every ``period``."""
        levels: collections.OrderedDict[int, int] = collections.OrderedDict()
        if self.node_size < self.world:
            levels[max(1, self.config.period // 2)] = self.node_size
        levels[self.config.period] = self.world
        return levels


@dataclass
class Trainee:
    """A model to evaluate and the closure that trains it one step on ``(tokens, targets)``."""

    model: nn.Module
    step: Callable[[torch.Tensor, torch.Tensor], None]


def optimizer_trainee(model: nn.Module, optimizer: Any) -> Trainee:
    def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        next_byte_loss(model(tokens), targets).backward()
        optimizer.step()

    return Trainee(model, step)


Builder = Callable[[Context], Trainee]


# --------------------------------------------------------------------------------------------
# Builders


def ddp_builtin(ctx: Context) -> Trainee:
    """DDP with no hook: the reducer's built-in C++ allreduce (the baseline)."""
    ddp = ctx.ddp(ctx.new_model())
    return optimizer_trainee(ddp, ctx.adamw(ddp.parameters()))


def ddp_hook(hook: str, state: Callable[[str, Context], Any] | None = None) -> dict[str, Builder]:
    """DDP with the comm hook ``hook`` (and its state) from each implementation."""

    def builder(impl: str) -> Builder:
        def build(ctx: Context) -> Trainee:
            hook_fn = resolve(impl, hook) if has_both(hook) else _load(f"dcomm.ddp:{hook}")
            ddp = ctx.ddp(ctx.new_model())
            ddp.register_comm_hook(state(impl, ctx) if state else None, hook_fn)
            return optimizer_trainee(ddp, ctx.adamw(ddp.parameters()))

        return build

    impls = ("dcomm", "torch") if has_both(hook) else ("dcomm",)
    return {impl: builder(impl) for impl in impls}


def powersgd_state(impl: str, ctx: Context) -> Any:
    """Rank-4 PowerSGD with error feedback after ``powersgd_start`` steps of plain allreduce.

    torch's defaults otherwise (warm start on, no orthogonalisation epsilon); dcomm's run and
    torch's get the same settings.
    """
    return resolve(impl, "PowerSGDState")(
        process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=ctx.config.powersgd_start
    )


def quantized_state(impl: str, ctx: Context) -> Any:
    """Error feedback on when dcomm has a state for it (``QuantizedState``), else no state.

    The hooks send their codes at every step: the demo charts what int8/fp8 do to the loss.
    """
    try:
        return _load("dcomm.ddp:QuantizedState")(None, error_feedback=True)
    except Unavailable:
        return None


def post_local_sgd(averaging: str) -> dict[str, Builder]:
    """Post-local SGD (intra-node gradient allreduce after the switch) + a model averager.

    dcomm finds the intra-node groups itself (from ``LOCAL_WORLD_SIZE``); torch's would take one
    group per GPU, so it is handed the same groups.
    """

    def builder(impl: str) -> Builder:
        def build(ctx: Context) -> Trainee:
            start = ctx.config.local_sgd_start
            ddp = ctx.ddp(ctx.new_model())
            subgroup = None if impl == "dcomm" else ctx.node_group
            state = resolve(impl, "PostLocalSGDState")(process_group=None, subgroup=subgroup, start_localSGD_iter=start)
            ddp.register_comm_hook(state, resolve(impl, "post_localSGD_hook"))
            if averaging == "periodic":
                averager = resolve(impl, "PeriodicModelAverager")(period=ctx.config.period, warmup_steps=start)
            else:
                averager = resolve(impl, "HierarchicalModelAverager")(ctx.hierarchy(), warmup_steps=start)
            optimizer = resolve(impl, "PostLocalSGDOptimizer")(optim=ctx.adamw(ddp.parameters()), averager=averager)
            return optimizer_trainee(ddp, optimizer)

        return build

    return {impl: builder(impl) for impl in ("dcomm", "torch")}


def zero_overlap(wrapper: str) -> dict[str, Builder]:
    """DDP + ZeroRedundancyOptimizer(AdamW) stepping inside backward through ``wrapper``."""

    def builder(impl: str) -> Builder:
        def build(ctx: Context) -> Trainee:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            ddp = ctx.ddp(ctx.new_model())
            zero = ZeroRedundancyOptimizer(
                ddp.parameters(),
                optimizer_class=torch.optim.AdamW,
                overlap_with_ddp=True,
                lr=ctx.config.lr,
                betas=(0.9, 0.95),
                weight_decay=0.0,
            )
            ddp.register_comm_hook(None, resolve(impl, wrapper)(resolve(impl, "allreduce_hook"), ddp, zero))

            def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
                zero.zero_grad(set_to_none=True)
                next_byte_loss(ddp(tokens), targets).backward()  # the optimizer steps inside backward

            return Trainee(ddp, step)

        return build

    return {impl: builder(impl) for impl in ("dcomm", "torch")}


def fsdp_bf16(impl: str) -> Builder:
    """FSDP (FULL_SHARD, one unit) reducing gradients in bf16 through ``bf16_compress_hook``."""

    def build(ctx: Context) -> Trainee:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        model = FullyShardedDataParallel(
            ctx.new_model(), sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=ctx.device
        )
        state = resolve(impl, "LowPrecisionState")(dist.group.WORLD, parameter_type=torch.float32)
        model.register_comm_hook(state, resolve(impl, "fsdp.bf16_compress_hook"))
        return optimizer_trainee(model, ctx.adamw(model.parameters()))

    return build


def fully_shard_bf16(impl: str) -> Builder:
    """FSDP2 ``fully_shard`` per block and at the root, reducing gradients in bf16.

    torch: ``MixedPrecisionPolicy(reduce_dtype=bf16)``; dcomm: ``use_low_precision_reduction``.
    """

    def build(ctx: Context) -> Trainee:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = ctx.new_model()
        policy = MixedPrecisionPolicy() if impl == "dcomm" else MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if impl == "dcomm":
            _load("dcomm.fsdp:use_low_precision_reduction")(model, torch.bfloat16)
        return optimizer_trainee(model, ctx.adamw(model.parameters()))

    return build


def diloco(compression: str | None) -> Builder:
    """DiLoCo: local AdamW steps, every ``diloco_every`` steps an outer Nesterov SGD step on the
    averaged parameter change (sent as ``compression`` codes, or fp32). No DDP: nothing is
    communicated between synchronisations. With ``diloco_start`` > 0, the first steps are DDP's
    (fp32 gradient allreduce, the same AdamW), as the DiLoCo paper starts from a model trained
    synchronously; the DiLoCoOptimizer takes over the AdamW and its state after them."""

    def build(ctx: Context) -> Trainee:
        optimizer_class = _load("dcomm.averaging:DiLoCoOptimizer")
        config = ctx.config
        model = ctx.new_model()
        inner = ctx.adamw(model.parameters())

        def new_diloco() -> Any:
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            return optimizer_class(inner, outer, sync_every=config.diloco_every, compression=compression)

        if config.diloco_start == 0:
            return optimizer_trainee(model, new_diloco())
        ddp = ctx.ddp(model)
        taken = 0
        diloco = None

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            nonlocal taken, diloco
            inner.zero_grad(set_to_none=True)
            if taken < config.diloco_start:  # synchronous warm-up: DDP's gradient allreduce
                next_byte_loss(ddp(tokens), targets).backward()
                inner.step()
            else:  # the bare module: DDP's reducer is idle without its forward
                if diloco is None:
                    diloco = new_diloco()
                next_byte_loss(model(tokens), targets).backward()
                diloco.step()
            taken += 1

        return Trainee(model, step)

    return build


BASELINE = "DDP built-in allreduce"

ALGORITHMS: dict[str, dict[str, Builder]] = {
    BASELINE: {"torch": ddp_builtin},
    "DDP allreduce_hook": ddp_hook("allreduce_hook"),
    "DDP fp16_compress_hook": ddp_hook("fp16_compress_hook"),
    "DDP bf16_compress_hook": ddp_hook("bf16_compress_hook"),
    "DDP int8_compress_hook": ddp_hook("int8_compress_hook", quantized_state),
    "DDP fp8_compress_hook": ddp_hook("fp8_compress_hook", quantized_state),
    "DDP powerSGD_hook (rank 4)": ddp_hook("powerSGD_hook", powersgd_state),
    "post-local SGD + periodic averager": post_local_sgd("periodic"),
    "post-local SGD + hierarchical averager": post_local_sgd("hierarchical"),
    "ZeRO overlap: hook_with_zero_step": zero_overlap("hook_with_zero_step"),
    "ZeRO overlap: hook_with_zero_step_interleaved": zero_overlap("hook_with_zero_step_interleaved"),
    "FSDP bf16_compress_hook": {impl: fsdp_bf16(impl) for impl in ("dcomm", "torch")},
    "fully_shard bf16 reduction": {impl: fully_shard_bf16(impl) for impl in ("dcomm", "torch")},
    "DiLoCo": {"dcomm": diloco(None)},
    "DiLoCo int8": {"dcomm": diloco("int8")},
}
"""Every run of the demo, in the order it runs: algorithm -> implementation -> builder."""

FAMILIES = {
    "DDP hooks": ("DDP allreduce_hook", "DDP fp16_compress_hook", "DDP bf16_compress_hook"),
    "compression": ("DDP int8_compress_hook", "DDP fp8_compress_hook", "DDP powerSGD_hook (rank 4)"),
    "averaging": (
        "post-local SGD + periodic averager",
        "post-local SGD + hierarchical averager",
        "DiLoCo",
        "DiLoCo int8",
    ),
    "ZeRO overlap": ("ZeRO overlap: hook_with_zero_step", "ZeRO overlap: hook_with_zero_step_interleaved"),
    "FSDP": ("FSDP bf16_compress_hook", "fully_shard bf16 reduction"),
}
"""The algorithms charted together (each chart also draws the baseline): at most 8 lines per chart."""

DILOCO_GOAL = ("DiLoCo", "DiLoCo int8")
"""DiLoCo runs that should end within :data:`DILOCO_TOLERANCE` of the baseline's validation loss at
equal steps (equal tokens: every rank reads its own batch each step in both)."""
DILOCO_TOLERANCE = 0.02
"""DiLoCo's goal (issue 16): at most 2% above fp32 DDP, whatever ``--tolerance`` says."""

CONVERGENCE_GOAL = ("DDP int8_compress_hook", "DDP fp8_compress_hook", "DDP powerSGD_hook (rank 4)")
"""Compressed runs that should end within the tolerance of the baseline's validation loss at
equal steps (with error feedback): the report compares them with fp32 DDP and charts them."""
