"""dcomm.ddp against torch's DDP hooks on any backend: parameters after a few training steps.

Every rank trains on its own batches (seeded by rank and step). The fp32 allreduce and post-local
SGD must equal torch's bit for bit; the fp16/bf16 hooks must stay within 2.5e-3 / 2.5e-2 of
torch's (relative to each parameter's change over the run) and of the fp32 run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from harness import device, scenario
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_plsgd

from dcomm.core import intra_node_subgroups, subgroups_of_size
from dcomm.ddp import (
    PostLocalSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    post_localSGD_hook,
)
from dcomm_testing import (
    BackwardOrderedMLP,
    DDPRun,
    assert_close,
    assert_updates_close,
    rank_groups,
    recorded_calls,
    seeded_normal,
)

STEPS = 5
START = 2
FP16_RTOL = 2.5e-3
BF16_RTOL = 2.5e-2


def _torch_bf16(process_group, bucket):  # unannotated: DDP then skips its annotation checks
    # DDP refuses a hook named "bf16_compress_hook" on builds without NCCL; the hook runs on gloo.
    return torch_hooks.bf16_compress_hook(process_group, bucket)


def _batch(step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return seeded_normal(1_000 * step + rank, (6, 8), scale=rank + 1, draw=torch.float32).to(device())


class _Run(DDPRun):
    def __init__(self, hook: Callable, state: object, native: bool | None = None) -> None:
        # Parameters in backward order: a restored run reduces its first step in the same order.
        model = BackwardOrderedMLP(8, 16, 4).to(device())
        self.initial = [p.detach().clone() for p in model.parameters()]
        super().__init__(model, hook if native is None else None, state, _batch)
        if native is not None:  # dcomm's explicit registration: C++ on the reducer, or Python
            from dcomm.ddp import register_comm_hook

            self.path = register_comm_hook(self.ddp, state, hook, native=native)

    def train(self, first: int = 0, last: int = STEPS) -> list[torch.Tensor]:
        return super().train(first, last)


@scenario()
def scenario_ddp_allreduce_hook(rank: int, world_size: int) -> None:
    ours = _Run(allreduce_hook, None).train()
    assert_close(ours, _Run(torch_hooks.allreduce_hook, None).train(), 0.0, "allreduce_hook vs torch")
    assert len(rank_groups(ours)) == 1, "allreduce_hook: replicas differ"


@scenario()
def scenario_ddp_compress_hooks(rank: int, world_size: int) -> None:
    reference = _Run(allreduce_hook, None)
    fp32 = reference.train()
    for hook, torch_hook, rtol in [
        (fp16_compress_hook, torch_hooks.fp16_compress_hook, FP16_RTOL),
        (bf16_compress_hook, _torch_bf16, BF16_RTOL),
    ]:
        ours, theirs = _Run(hook, None).train(), _Run(torch_hook, None).train()
        assert_close(ours, theirs, 0.0, f"{hook.__qualname__} vs torch")  # torch's arithmetic
        assert_updates_close(ours, fp32, reference.initial, rtol, f"{hook.__qualname__} vs fp32")
        assert len(rank_groups(ours)) == 1, f"{hook.__qualname__}: replicas differ"


@scenario()
def scenario_ddp_hooks_in_cpp(rank: int, world_size: int) -> None:
    # dcomm.ddp.register_comm_hook(..., native=True) has DDP's reducer run dcomm's compress hooks
    # in C++: the same parameters, bit for bit, as the Python hooks, without entering them.
    import dcomm.ddp.default_hooks as default_hooks

    # _check_group: the first thing every Python hook call does.
    with recorded_calls(default_hooks, "_check_group", lambda group, name: name) as calls:
        for hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook):
            results = {}
            for native in (True, False):
                calls.clear()
                run = _Run(hook, None, native=native)
                results[native] = run.train()
                in_cpp = native and hook is not allreduce_hook  # allreduce_hook has no C++ twin
                assert run.path == ("native" if in_cpp else "python"), (hook.__qualname__, native, run.path)
                assert (len(calls) == 0) == in_cpp, f"{hook.__qualname__}: {len(calls)} Python calls"
            assert_close(results[True], results[False], 0.0, f"{hook.__qualname__}: C++ vs Python")


@scenario(world_size_multiple=2)
def scenario_ddp_post_local_sgd(rank: int, world_size: int) -> None:
    pairs, _ = subgroups_of_size(2)
    node, _ = intra_node_subgroups()  # from LOCAL_WORLD_SIZE, as subgroup=None builds it
    for post_local in (True, False):
        for ours_sub, torch_sub in [(pairs, pairs), (None, node)]:
            ours = PostLocalSGDState(None, ours_sub, START, post_local)
            theirs = torch_plsgd.PostLocalSGDState(None, torch_sub, START, post_local)
            mine = _Run(post_localSGD_hook, ours).train()
            assert_close(mine, _Run(torch_plsgd.post_localSGD_hook, theirs).train(), 0.0, f"post_local={post_local}")
            assert (ours.iter, theirs.iter) == (STEPS, START)
            if ours_sub is pairs:
                # Pairs agree after the switch with the local allreduce; without it, nobody does.
                assert (len(rank_groups(mine, pairs)) == 1) == post_local


@scenario()
def scenario_ddp_post_local_sgd_resume(rank: int, world_size: int) -> None:
    state = PostLocalSGDState(None, None, START)
    reference = _Run(post_localSGD_hook, state)
    reference.train(last=START + 1)
    ckpt = copy.deepcopy(
        {"hook": state.state_dict(), "model": reference.model.state_dict(), "opt": reference.opt.state_dict()}
    )
    final = reference.train(first=START + 1)

    restored_state = PostLocalSGDState(None, None, START)
    restored = _Run(post_localSGD_hook, restored_state)
    restored.model.load_state_dict(ckpt["model"])  # after DDP's broadcast of rank 0's parameters
    restored.opt.load_state_dict(ckpt["opt"])
    restored_state.load_state_dict(ckpt["hook"])
    assert_close(restored.train(first=START + 1), final, 0.0, "resumed after the switch")
    assert restored_state.iter == state.iter == STEPS
