"""What users write, checked by ``hatch run types:check`` (mypy): it must type-check as it runs.

Not a test module (pytest does not collect it); every line is an idiom from the READMEs or the
migration guide, with the types torch gives (``dist.group.WORLD`` is ``ProcessGroup | None``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from dcomm.averaging import (
    HierarchicalModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
    average_parameters,
    average_parameters_or_parameter_groups,
)
from dcomm.core import DefaultState, LowPrecisionState, get_logger, warn_once
from dcomm.ddp import (
    PostLocalSGDState,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    post_localSGD_hook,
)
from dcomm.fsdp import fp16_compress_hook as fsdp_fp16_compress_hook
from dcomm.fsdp import low_precision_mp_policy, reduce_scatter_hook, use_low_precision_reduction


def ddp_usage(ddp: DistributedDataParallel) -> None:
    ddp.register_comm_hook(None, bf16_compress_hook)
    ddp.register_comm_hook(dist.group.WORLD, fp16_compress_hook)
    ddp.register_comm_hook(None, fp16_compress_wrapper(allreduce_hook))
    ddp.register_comm_hook(None, bf16_compress_wrapper(allreduce_hook))
    state = PostLocalSGDState(process_group=dist.group.WORLD, subgroup=None, start_localSGD_iter=100)
    ddp.register_comm_hook(state, post_localSGD_hook)
    ddp.register_comm_hook(state, fp16_compress_wrapper(post_localSGD_hook))
    state.load_state_dict(state.state_dict())


def fsdp_usage(fsdp: FullyShardedDataParallel, module: torch.nn.Module) -> None:
    fsdp.register_comm_hook(LowPrecisionState(dist.group.WORLD), fsdp_fp16_compress_hook)
    fsdp.register_comm_hook(DefaultState(dist.group.WORLD), reduce_scatter_hook)
    use_low_precision_reduction(module, torch.bfloat16)
    low_precision_mp_policy(torch.float16)


def averaging_usage(model: torch.nn.Module) -> None:
    averager = PeriodicModelAverager(period=4, warmup_steps=100, process_group=dist.group.WORLD)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    HierarchicalModelAverager(period_group_size_dict={2: 2, 8: 8}, warmup_steps=100, process_group=dist.group.WORLD)
    average_parameters(model.parameters(), dist.group.WORLD)
    average_parameters_or_parameter_groups(model.parameters(), dist.group.WORLD)
    get_logger(__name__).info("averaging every %d steps", averager.period)
    warn_once(("example",), "a slower path")
