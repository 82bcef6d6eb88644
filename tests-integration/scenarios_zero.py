"""ZeRO overlap on any backend: both dcomm hooks, shard_buckets and reduce_scatter both ways, bf16.

Each case trains the same model twice on this rank's device: DDP with dcomm's ZeRO overlap hook
around ``bf16_compress_hook``, and DDP with the same ``bf16_compress_hook`` followed by a
non-overlapped ``ZeroRedundancyOptimizer``. Both communicate the same bf16 sums and apply the
same fp32 Adam arithmetic (on CUDA both in torch's fused Adam kernel, which dcomm's local step
uses where Adam's implementation is left to torch), so after every step (the first included) the parameters agree to
float32 tolerance, and every rank holds the same parameters. ``reduce_scatter=True`` cases wrap
the fp32 ``allreduce_hook`` (reference: DDP with it): every bucket is sharded element-wise
(equal slices across parameter boundaries) and its gradient reduce-scattered onto the slices
instead of allreduced, so only the summation order differs (rtol 1e-5, atol 1e-6). The
accumulation scenario skips ``zero_grad`` between backward passes and compares the same way. The
tied-weights scenario trains a model that uses one weight twice (as a language model's embedding
and its LM head), whose gradient is complete only once both uses have run backward.

Example::

    python3 -m pytest tests-integration -k zero  # gloo; tests-integration/run.py for NCCL
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import device, scenario
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    from dcomm.ddp import bf16_compress_hook
except ImportError:  # pragma: no cover - dcomm-ddp without its default hooks
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from dcomm.ddp import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved, wait_for_parameters
from dcomm_testing import assert_same_on_ranks, flat_parameters, seeded_mlp, seeded_normal

STEPS = 4


def _model() -> torch.nn.Module:
    return seeded_mlp(32, 64, 64, 8, activation=torch.nn.ReLU, device=device())


class _TiedWeights(torch.nn.Module):
    """An encoder whose weight, transposed, is also the decoder's: one parameter used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encode = torch.nn.Linear(32, 64, device=device())
        self.middle = torch.nn.Linear(64, 64, device=device())
        self.decode_bias = torch.nn.Parameter(torch.zeros(32, device=device()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.middle(torch.relu(self.encode(x))))
        return F.linear(hidden, self.encode.weight.t(), self.decode_bias)


def _ddp(model: torch.nn.Module) -> DDP:
    ids = [device().index] if device().type == "cuda" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=0.01)  # several buckets once DDP settles
    return ddp


def _batch(rank: int, step: int) -> torch.Tensor:
    return seeded_normal(100 * rank + step, (16, 32), scale=rank + 1, draw=torch.float32).to(device())


def _train_against_plain_zero(
    case: str,
    rank: int,
    build: Callable[..., Any],
    hook: Callable[..., Any],
    zero_grad_every: int,
    make_model: Callable[[], torch.nn.Module] = _model,
    adam: dict[str, Any] | None = None,
    **kwargs: Any,
) -> ZeroRedundancyOptimizer:
    """Train with the overlap hook and with ``hook`` + plain ZeRO; compare after every step.

    ``zero_grad_every`` > 1 accumulates gradients over that many backward passes; ``adam`` adds
    Adam arguments on both sides. Returns the overlapped run's optimizer.
    """
    model, ref_model = make_model(), make_model()
    ddp, ref_ddp = _ddp(model), _ddp(ref_model)
    adam = {"lr": 1e-2, **(adam or {})}
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, **adam)
    overlap_hook = build(hook, ddp, zero, **kwargs)
    ddp.register_comm_hook(None, overlap_hook)
    ref_ddp.register_comm_hook(None, hook)
    ref_adam = dict(adam)
    if device().type == "cuda" and "foreach" not in adam and "fused" not in adam:
        # Left to torch, dcomm's local step runs torch's fused Adam on CUDA (dcomm.ddp._zero.fused_step):
        # the same update as the foreach default up to rounding, which Adam's division by sqrt(v)
        # amplifies where v is tiny. Against plain ZeRO with the same kernel, only summation order differs.
        ref_adam["fused"] = True
    ref_zero = ZeroRedundancyOptimizer(ref_ddp.parameters(), optimizer_class=torch.optim.Adam, **ref_adam)
    tol = {"rtol": 1e-5, "atol": 1e-6} if kwargs.get("reduce_scatter") else {}
    before = flat_parameters(model)
    for step in range(STEPS):
        x = _batch(rank, step)
        if step % zero_grad_every == 0:
            zero.zero_grad(set_to_none=True)
            ref_zero.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        ref_ddp(x).square().mean().backward()
        ref_zero.step()
        wait_for_parameters(overlap_hook)  # a no-op without gather_during_forward
        ours, theirs = flat_parameters(model), flat_parameters(ref_model)
        assert not torch.equal(ours, before), f"{case}: step {step} left the parameters unchanged"
        torch.testing.assert_close(ours, theirs, **tol, msg=lambda m, c=case, s=step: f"{c} step {s}: {m}")
        assert_same_on_ranks([ours], f"{case} step {step}")
        before = ours
    if device().type == "cuda":
        torch.cuda.synchronize()
    return zero


@scenario(min_world_size=2)
def scenario_zero_overlap_bf16(rank: int, world_size: int) -> None:
    builders = (hook_with_zero_step, hook_with_zero_step_interleaved)
    for builder, shard, rs in itertools.product(builders, (False, True), (False, True)):
        case = f"{builder.__name__}(shard_buckets={shard}, reduce_scatter={rs})"
        # reduce_scatter=True wraps the fp32 allreduce_hook: its reduce-scatter sums in another order
        # than an allreduce, and in bf16 that can move Adam's first step on a near-zero gradient by
        # up to lr; in fp32 the difference stays at float32 rounding.
        hook = allreduce_hook if rs else bf16_compress_hook
        _train_against_plain_zero(case, rank, builder, hook, 1, shard_buckets=shard, reduce_scatter=rs)


@scenario(min_world_size=2)
def scenario_zero_overlap_accumulation(rank: int, world_size: int) -> None:
    """Gradients accumulated over 3 backward passes without zero_grad: plain ZeRO's parameters."""
    builders = (hook_with_zero_step, hook_with_zero_step_interleaved)
    for builder, rs in itertools.product(builders, (False, True)):
        case = f"accumulate {builder.__name__}(reduce_scatter={rs})"
        _train_against_plain_zero(case, rank, builder, allreduce_hook, 3, reduce_scatter=rs)


@scenario(min_world_size=2)
def scenario_zero_overlap_tied_weights(rank: int, world_size: int) -> None:
    """A weight used twice: every layout, both hooks and gather_during_forward give plain ZeRO's parameters."""
    builders = (hook_with_zero_step, hook_with_zero_step_interleaved)
    for builder, rs, gather in itertools.product(builders, (False, True), (False, True)):
        options = {"reduce_scatter": rs, "gather_during_forward": gather}
        case = f"tied weights {builder.__name__}({options})"
        _train_against_plain_zero(case, rank, builder, allreduce_hook, 1, _TiedWeights, **options)


@scenario(min_world_size=2)
def scenario_zero_overlap_fused_adam(rank: int, world_size: int) -> None:
    """Adam with fused=True (one kernel per step on CUDA) on both sides: plain ZeRO's parameters."""
    builders = (hook_with_zero_step, hook_with_zero_step_interleaved)
    for builder, rs in itertools.product(builders, (False, True)):
        case = f"fused Adam {builder.__name__}(reduce_scatter={rs})"
        zero = _train_against_plain_zero(
            case, rank, builder, allreduce_hook, 1, adam={"fused": True}, reduce_scatter=rs
        )
        assert zero.optim.defaults["fused"] is True, f"{case}: the local optimizer is not the fused Adam"


@scenario(min_world_size=2)
def scenario_zero_overlap_fused_local_step(rank: int, world_size: int) -> None:
    """Adam left to torch's default: the local step runs fused on CUDA, with plain ZeRO's parameters at every step.

    The fused kernel keeps Adam's step counters on the device: they tell which implementation
    stepped. The groups still say ``fused=None`` (torch's state-dict format). With
    ``foreach=True`` chosen, or off CUDA, torch's implementation stays (and the reference uses it).
    """
    builders = (hook_with_zero_step, hook_with_zero_step_interleaved)
    on_cuda = device().type == "cuda"
    for builder, rs, (adam, fused) in itertools.product(
        builders, (False, True), (({}, on_cuda), ({"foreach": True}, False))
    ):
        case = f"local step {builder.__name__}(reduce_scatter={rs}), Adam {adam}"
        zero = _train_against_plain_zero(case, rank, builder, allreduce_hook, 1, adam=adam, reduce_scatter=rs)
        steps = [state["step"] for state in zero.optim.state.values() if "step" in state]
        stepping = torch.tensor([float(bool(steps))], device=device())
        torch.distributed.all_reduce(stepping)  # a rank may own no parameter of this small model
        assert stepping.item() > 0, f"{case}: no rank stepped"
        assert all(step.is_cuda == fused for step in steps), f"{case}: expected fused={fused}"
        assert all(group["fused"] is None for group in zero.optim.param_groups), case
