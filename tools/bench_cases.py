"""The benchmark cases of DESIGN.md's "better than torch" list, dcomm and torch side by side.

Each case is a function ``case_<name>(bench, sizes) -> list[Row]`` that measures dcomm's
implementation, torch's built-in one and the case's reference points (a raw allreduce, DDP's
built-in allreduce, a no-communication floor, non-overlapped ZeRO, FSDP's default reduction) on
the same process group. Every variant builds its own model inside :meth:`Bench.run`, so an
implementation that is missing or raises becomes an ``error: ...`` cell, not a crashed run.

Example::

    >>> rows = CASES["ddp"](bench, SIZES["small"])  # doctest: +SKIP
    >>> rows[1].case, rows[1].ratio  # doctest: +SKIP
    ('ddp/fp16', 0.97)
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from bench_timing import Bench, Measurement, Outcome, Step
from torch import nn

__all__ = ["CASES", "SIZES", "Row", "Sizes", "ratio"]

LR = 1e-6
"""Small enough that hundreds of steps on random data never overflow fp16 gradients."""

START_LOCAL_SGD_ITER = 2
"""Post-local SGD: global allreduce steps before local SGD starts (= the averagers' warmup)."""

LOCAL_SGD_SAMPLE_STEPS = 4
"""Post-local SGD is timed over windows of 4 steps: one full period of every averager used."""


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: the tensors averaged in case (a) and the MLP trained in the others."""

    avg_tensors: int
    avg_numel: int
    width: int
    depth: int
    batch: int

    @property
    def avg_bytes(self) -> int:
        return self.avg_tensors * self.avg_numel * 4

    @property
    def mlp_params(self) -> int:
        return self.depth * (self.width * self.width + self.width)


SIZES: dict[str, Sizes] = {
    # 256 x 4 MiB = 1 GiB averaged; 4 x 8192^2 MLP = 268M params, 1 GiB of fp32 gradients.
    "large": Sizes(avg_tensors=256, avg_numel=1 << 20, width=8192, depth=4, batch=64),
    # The emulated slow link moves ~1 GB/s: 256 MiB averaged, 67M params (256 MiB gradients).
    "large-slow": Sizes(avg_tensors=64, avg_numel=1 << 20, width=4096, depth=4, batch=64),
    # gloo on CPU (laptops, CI): 1 MiB averaged, 200K params.
    "small": Sizes(avg_tensors=16, avg_numel=1 << 14, width=256, depth=3, batch=16),
}


@dataclass
class Row:
    """One line of the result table: dcomm vs torch, reference points and derived numbers."""

    case: str
    dcomm: Outcome | None
    torch: Outcome | None
    baselines: dict[str, Outcome] = field(default_factory=dict)
    details: dict[str, float | str] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """dcomm time / torch time (None when either side has no measurement)."""
        return ratio(self.dcomm, self.torch)

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "dcomm": self.dcomm.to_json() if self.dcomm else None,
            "torch": self.torch.to_json() if self.torch else None,
            "ratio_dcomm_torch": _rounded(self.ratio),
            "baselines": {name: outcome.to_json() for name, outcome in self.baselines.items()},
            "details": self.details,
        }


def ratio(numerator: Outcome | None, denominator: Outcome | None) -> float | None:
    """Median time of ``numerator`` over that of ``denominator``, when both were measured."""
    if isinstance(numerator, Measurement) and isinstance(denominator, Measurement):
        return numerator.median_s / denominator.median_s
    return None


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ratios(row_outcomes: dict[str, Outcome | None], reference: Outcome, name: str) -> dict[str, float | str]:
    """``{"<impl>/<name>": time ratio}`` for each measured outcome against ``reference``."""
    out: dict[str, float | str] = {}
    for impl, outcome in row_outcomes.items():
        value = ratio(outcome, reference)
        if value is not None:
            out[f"{impl}/{name}"] = round(value, 3)
    return out


# --------------------------------------------------------------------------------------------
# Models and data shared by the training cases


def make_mlp(sizes: Sizes, device: torch.device) -> nn.Sequential:
    """The same ``depth`` x ``width`` MLP on every rank (seeded), built on ``device``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for index in range(sizes.depth):
        layers.append(nn.Linear(sizes.width, sizes.width, device=device))
        if index < sizes.depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_batch(sizes: Sizes, device: torch.device) -> torch.Tensor:
    """A batch that differs between ranks, so communication has something to do."""
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    return torch.randn(sizes.batch, sizes.width, generator=generator).to(device)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, sizes: Sizes, bench: Bench) -> Step:
    """One training step of ``model`` with ``optimizer`` on a fixed batch (gradients zeroed in place)."""
    batch = make_batch(sizes, bench.device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        loss_of(model(batch)).backward()
        optimizer.step()

    return step


def sgd_step(model: nn.Module, sizes: Sizes, bench: Bench) -> Step:
    """One SGD training step of ``model`` on a fixed batch."""
    return training_step(model, torch.optim.SGD(model.parameters(), lr=LR), sizes, bench)


def make_ddp(module: nn.Module, bench: Bench) -> nn.parallel.DistributedDataParallel:
    device_ids = [bench.device] if bench.is_cuda else None
    return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)


# --------------------------------------------------------------------------------------------
# (a) parameter averaging vs a raw allreduce of the same bytes


def _averaged_tensors(bench: Bench, sizes: Sizes, flattened: bool = False) -> list[nn.Parameter]:
    """The averaged parameters: separate tensors, or (``flattened``) views carved out of one buffer."""
    value = float(dist.get_rank())
    if flattened:
        flat = torch.full((sizes.avg_tensors * sizes.avg_numel,), value, device=bench.device)
        return [nn.Parameter(piece, requires_grad=False) for piece in flat.split(sizes.avg_numel)]
    return [
        nn.Parameter(torch.full((sizes.avg_numel,), value, device=bench.device), requires_grad=False)
        for _ in range(sizes.avg_tensors)
    ]


def build_raw_allreduce(bench: Bench, sizes: Sizes) -> Step:
    flat = torch.ones(sizes.avg_tensors * sizes.avg_numel, device=bench.device)
    return lambda: dist.all_reduce(flat)


def build_average_parameters(bench: Bench, sizes: Sizes, impl: str, flattened: bool = False) -> Step:
    if impl == "torch":
        from torch.distributed.algorithms.model_averaging.utils import average_parameters
    else:
        from dcomm.averaging import average_parameters
    params = _averaged_tensors(bench, sizes, flattened)
    group = dist.group.WORLD
    return lambda: average_parameters(iter(params), group)


def bus_bandwidth_gbps(nbytes: int, world: int, outcome: Outcome | None) -> float | None:
    """Allreduce bus bandwidth (NCCL-tests convention): bytes * 2(n-1)/n / time, in GB/s."""
    if not isinstance(outcome, Measurement):
        return None
    return nbytes * 2 * (world - 1) / world / outcome.median_s / 1e9


AVERAGING_CALLS_PER_SAMPLE = 10
"""Back-to-back calls per timed sample of the averaging case: its throughput, not one call's latency."""


def case_averaging(bench: Bench, sizes: Sizes) -> list[Row]:
    """Throughput (back-to-back calls) of each averaging variant, and the latency of a single call.

    The throughput of a periodic averager is that of calls following other GPU work; a single
    call after an idle GPU (the latency columns) also pays its host-side preparation in full.
    """
    builds: dict[str, Callable[[], Step]] = {
        "raw": lambda: build_raw_allreduce(bench, sizes),
        "torch": lambda: build_average_parameters(bench, sizes, "torch"),
        "dcomm": lambda: build_average_parameters(bench, sizes, "dcomm"),
        "dcomm flattened": lambda: build_average_parameters(bench, sizes, "dcomm", flattened=True),
    }
    per_sample = AVERAGING_CALLS_PER_SAMPLE
    throughput = {name: bench.run(build, steps_per_sample=per_sample) for name, build in builds.items()}
    latency = {name: bench.run(build) for name, build in builds.items()}
    raw = throughput.pop("raw")
    details: dict[str, float | str] = {"MiB": sizes.avg_bytes / 2**20, "tensors": sizes.avg_tensors}
    details["calls per sample"] = per_sample
    details.update(_ratios(throughput, raw, "raw"))
    single_raw = latency.pop("raw")
    details.update({f"single call {k}": v for k, v in _ratios(latency, single_raw, "raw").items()})
    for name, outcome in {**throughput, "raw": raw}.items():
        busbw = bus_bandwidth_gbps(sizes.avg_bytes, bench.world, outcome)
        if busbw is not None:
            details[f"busbw {name} GB/s"] = round(busbw, 2)
    baselines = {"raw allreduce": raw, "dcomm, flattened model": throughput["dcomm flattened"]}
    return [Row("averaging", throughput["dcomm"], throughput["torch"], baselines, details)]


# --------------------------------------------------------------------------------------------
# (b) DDP step with each hook vs the built-in allreduce vs no communication


DDP_HOOKS = {"allreduce": "allreduce_hook", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def ddp_hook(impl: str, name: str) -> Callable[..., Any]:
    """dcomm's or torch's DDP hook called ``DDP_HOOKS[name]``."""
    if impl == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as module
    else:
        import dcomm.ddp as module
    return getattr(module, DDP_HOOKS[name])


def build_ddp_step(bench: Bench, sizes: Sizes, hook: tuple[str, str] | None, no_sync: bool = False) -> Step:
    """A DDP training step (SGD) with ``hook = (impl, name)``, or DDP's built-in allreduce."""
    ddp = make_ddp(make_mlp(sizes, bench.device), bench)
    if hook is not None:
        ddp.register_comm_hook(None, ddp_hook(*hook))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    if not no_sync:
        return training_step(ddp, optimizer, sizes, bench)
    batch = make_batch(sizes, bench.device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        with ddp.no_sync():
            loss_of(ddp(batch)).backward()
        optimizer.step()

    return step


def case_ddp(bench: Bench, sizes: Sizes) -> list[Row]:
    builtin = bench.run(lambda: build_ddp_step(bench, sizes, None))
    floor = bench.run(lambda: build_ddp_step(bench, sizes, None, no_sync=True))
    rows = []
    for name in DDP_HOOKS:
        torch_step = bench.run(lambda name=name: build_ddp_step(bench, sizes, ("torch", name)))
        dcomm_step = bench.run(lambda name=name: build_ddp_step(bench, sizes, ("dcomm", name)))
        outcomes = {"dcomm": dcomm_step, "torch": torch_step}
        details = _ratios(outcomes, builtin, "builtin")
        details.update(_communication_shares(outcomes, builtin, floor))
        baselines = {"builtin": builtin, "no-comm": floor}
        rows.append(Row(f"ddp/{name}", dcomm_step, torch_step, baselines, details))
    return rows


def _communication_shares(
    outcomes: dict[str, Outcome | None], builtin: Outcome, floor: Outcome
) -> dict[str, float | str]:
    """Exposed communication time of each hook as a fraction of the built-in's: (t - floor)/(b - floor)."""
    if not (isinstance(builtin, Measurement) and isinstance(floor, Measurement)):
        return {}
    builtin_comm = builtin.median_s - floor.median_s
    if builtin_comm <= 0:
        return {}
    return {
        f"{impl} comm/builtin comm": round((outcome.median_s - floor.median_s) / builtin_comm, 3)
        for impl, outcome in outcomes.items()
        if isinstance(outcome, Measurement)
    }


# --------------------------------------------------------------------------------------------
# (c) post-local SGD with periodic and hierarchical averaging


def hierarchy(world: int) -> collections.OrderedDict[int, int]:
    """Every 2 steps average within halves of the world, every 4 steps over all of it."""
    levels = collections.OrderedDict()
    if world >= 4 and world % 2 == 0:
        levels[2] = world // 2
    levels[4] = world
    return levels


def build_post_local_sgd_step(bench: Bench, sizes: Sizes, impl: str, averaging: str) -> Step:
    """DDP + post-local SGD hook (pure local SGD after the switch) + an averaging optimizer."""
    if impl == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
            HierarchicalModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer
    else:
        from dcomm.averaging import HierarchicalModelAverager, PeriodicModelAverager, PostLocalSGDOptimizer
        from dcomm.ddp import PostLocalSGDState, post_localSGD_hook

    ddp = make_ddp(make_mlp(sizes, bench.device), bench)
    state = PostLocalSGDState(
        process_group=None,
        subgroup=None,
        start_localSGD_iter=START_LOCAL_SGD_ITER,
        post_local_gradient_allreduce=False,
    )
    ddp.register_comm_hook(state, post_localSGD_hook)
    if averaging == "periodic":
        averager = PeriodicModelAverager(period=LOCAL_SGD_SAMPLE_STEPS, warmup_steps=START_LOCAL_SGD_ITER)
    else:
        averager = HierarchicalModelAverager(
            period_group_size_dict=hierarchy(bench.world), warmup_steps=START_LOCAL_SGD_ITER
        )
    optimizer = PostLocalSGDOptimizer(optim=torch.optim.SGD(ddp.parameters(), lr=LR), averager=averager)
    return training_step(ddp, optimizer, sizes, bench)


def case_post_local_sgd(bench: Bench, sizes: Sizes) -> list[Row]:
    # Samples of 4 steps hold each averager's full cycle; one warm sample passes the switch.
    window = {"steps_per_sample": LOCAL_SGD_SAMPLE_STEPS, "warmup": max(1, bench.warmup // 2)}
    builtin = bench.run(lambda: build_ddp_step(bench, sizes, None))
    rows = []
    for averaging in ("periodic", "hierarchical"):
        torch_step = bench.run(
            lambda averaging=averaging: build_post_local_sgd_step(bench, sizes, "torch", averaging), **window
        )
        dcomm_step = bench.run(
            lambda averaging=averaging: build_post_local_sgd_step(bench, sizes, "dcomm", averaging), **window
        )
        details = _ratios({"dcomm": dcomm_step, "torch": torch_step}, builtin, "ddp")
        if averaging == "hierarchical":
            details["levels"] = ", ".join(f"{p}:{g}" for p, g in hierarchy(bench.world).items())
        rows.append(Row(f"post-local-sgd/{averaging}", dcomm_step, torch_step, {"ddp": builtin}, details))
    return rows


# --------------------------------------------------------------------------------------------
# (d) ZeRO (Adam): non-overlapped vs the overlap hooks


ZERO_HOOKS = {"step": "hook_with_zero_step", "interleaved": "hook_with_zero_step_interleaved"}
_ZERO_DRIVERS: list[Any] = []  # the last reduce_scatter=True hook's driver (see build_zero_step)


def zero_overlap_hook(impl: str, name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(the ZeRO wrapper ``ZERO_HOOKS[name]``, the allreduce hook it wraps) of dcomm or torch."""
    if impl == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return getattr(ddp_zero_hook, ZERO_HOOKS[name]), allreduce_hook
    import dcomm.ddp

    return getattr(dcomm.ddp, ZERO_HOOKS[name]), dcomm.ddp.allreduce_hook


def build_zero_step(bench: Bench, sizes: Sizes, overlap: tuple[str, str] | None, reduce_scatter: bool = False) -> Step:
    """DDP + ZeroRedundancyOptimizer(Adam); ``overlap = (impl, hook name)`` steps inside backward.

    ``reduce_scatter`` (dcomm only): ``reduce_scatter=True`` (element-wise sharding: equal slices
    of every bucket, one reduce-scatter + one all-gather per bucket); the hook's driver is kept in
    ``_ZERO_DRIVERS`` so the row can report how many buckets took that path.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = make_ddp(make_mlp(sizes, bench.device), bench)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=overlap is not None, lr=LR
    )
    if overlap is not None:
        wrapper, allreduce_hook = zero_overlap_hook(*overlap)
        extra = {"reduce_scatter": True, "shard_buckets": True} if reduce_scatter else {}
        ddp.register_comm_hook(None, wrapper(allreduce_hook, ddp, zero, **extra))
        if reduce_scatter:
            _ZERO_DRIVERS[:] = [getattr(zero, "_dcomm_zero_overlap_driver", None)]
    batch = make_batch(sizes, bench.device)

    def step() -> None:
        ddp.zero_grad(set_to_none=False)
        loss_of(ddp(batch)).backward()
        if overlap is None:
            zero.step()

    return step


def case_zero(bench: Bench, sizes: Sizes) -> list[Row]:
    warmup = max(bench.warmup, 3)  # torch's overlap hooks only start updating after 2-3 steps
    plain = bench.run(lambda: build_zero_step(bench, sizes, None), warmup=warmup)
    rows = []
    for name in ZERO_HOOKS:
        torch_step = bench.run(lambda name=name: build_zero_step(bench, sizes, ("torch", name)), warmup=warmup)
        dcomm_step = bench.run(lambda name=name: build_zero_step(bench, sizes, ("dcomm", name)), warmup=warmup)
        details = _ratios({"dcomm": dcomm_step, "torch": torch_step}, plain, "plain")
        details["grad MiB"] = round(sizes.mlp_params * 4 / 2**20, 1)
        rows.append(Row(f"zero/{name}", dcomm_step, torch_step, {"zero, no overlap": plain}, details))
    # dcomm's reduce_scatter=True (2 units of traffic instead of 3), against the same torch hook.
    for name in ZERO_HOOKS:
        torch_step = next(row.torch for row in rows if row.case == f"zero/{name}")
        dcomm_step = bench.run(
            lambda name=name: build_zero_step(bench, sizes, ("dcomm", name), reduce_scatter=True), warmup=warmup
        )
        details = _ratios({"dcomm": dcomm_step, "torch": torch_step}, plain, "plain")
        details["grad MiB"] = round(sizes.mlp_params * 4 / 2**20, 1)
        driver = _ZERO_DRIVERS[0] if _ZERO_DRIVERS else None
        if driver is not None:
            # Buckets reduce-scattered element-wise in the last step / all buckets (the rest fell
            # back to an allreduce because DDP's layout differed from the planned one).
            fast, slow = driver.fast_buckets, driver.fallback_buckets
            details["rs buckets"] = f"{fast}/{fast + slow}"
        rows.append(Row(f"zero/{name}+rs", dcomm_step, torch_step, {"zero, no overlap": plain}, details))
    return rows


# --------------------------------------------------------------------------------------------
# (e) FSDP with each hook vs its default reduction


FSDP_HOOKS = {
    # row name: (sharding strategy, hook name, low-precision state?)
    "reduce_scatter": ("FULL_SHARD", "reduce_scatter_hook", False),
    "fp16": ("FULL_SHARD", "fp16_compress_hook", True),
    "bf16": ("FULL_SHARD", "bf16_compress_hook", True),
    "allreduce": ("NO_SHARD", "allreduce_hook", False),
}


def fsdp_hook(impl: str, hook_name: str, low_precision: bool) -> tuple[object, Callable[..., Any]]:
    """(a fresh hook state over WORLD, the FSDP hook ``hook_name``) of dcomm or torch."""
    if impl == "torch":
        from torch.distributed.algorithms._comm_hooks import default_hooks as hooks
        from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, LowPrecisionState
    else:
        import dcomm.fsdp as hooks
        from dcomm.core import DefaultState, LowPrecisionState
    group = dist.group.WORLD
    state = LowPrecisionState(group, parameter_type=torch.float32) if low_precision else DefaultState(group)
    return state, getattr(hooks, hook_name)


def build_fsdp_step(bench: Bench, sizes: Sizes, strategy: str, hook: tuple[str, str, bool] | None) -> Step:
    """FSDP (one unit per Linear) with ``hook = (impl, hook name, low precision)`` or the default."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FullyShardedDataParallel(
        make_mlp(sizes, bench.device),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=bench.device,
    )
    if hook is not None:
        model.register_comm_hook(*fsdp_hook(*hook))
    return sgd_step(model, sizes, bench)


def case_fsdp(bench: Bench, sizes: Sizes) -> list[Row]:
    defaults: dict[str, Outcome] = {}
    rows = []
    for name, (strategy, hook_name, low_precision) in FSDP_HOOKS.items():
        if strategy not in defaults:
            defaults[strategy] = bench.run(lambda strategy=strategy: build_fsdp_step(bench, sizes, strategy, None))
        outcomes: dict[str, Outcome | None] = {}
        for impl in ("torch", "dcomm"):
            hook = (impl, hook_name, low_precision)
            outcomes[impl] = bench.run(
                lambda strategy=strategy, hook=hook: build_fsdp_step(bench, sizes, strategy, hook)
            )
        details = _ratios(outcomes, defaults[strategy], "default")
        details["strategy"] = strategy
        baselines = {f"default {strategy}": defaults[strategy]}
        rows.append(Row(f"fsdp/{name}", outcomes["dcomm"], outcomes["torch"], baselines, details))
    return rows


LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build_fully_shard_step(bench: Bench, sizes: Sizes, reduction: tuple[str, str] | None) -> Step:
    """FSDP2 (``fully_shard`` per Linear and at the root), reducing gradients in fp32 or in low precision.

    ``reduction = ("torch", "bf16")`` uses torch's ``MixedPrecisionPolicy(reduce_dtype=...)``;
    ``("dcomm", "bf16")`` uses ``dcomm.fsdp.use_low_precision_reduction`` on modules built with
    ``low_precision_mp_policy`` (FSDP2 casts in its copy-in, as in torch's row).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    impl, dtype = (reduction[0], LOW_PRECISION[reduction[1]]) if reduction else ("", None)
    policy = MixedPrecisionPolicy(reduce_dtype=dtype) if impl == "torch" else MixedPrecisionPolicy()
    if impl == "dcomm":
        from dcomm.fsdp import low_precision_mp_policy, use_low_precision_reduction

        policy = low_precision_mp_policy(dtype)
    model = make_mlp(sizes, bench.device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if impl == "dcomm":
        use_low_precision_reduction(model, dtype)
    return sgd_step(model, sizes, bench)


def case_fully_shard(bench: Bench, sizes: Sizes) -> list[Row]:
    default = bench.run(lambda: build_fully_shard_step(bench, sizes, None))
    rows = []
    for name in LOW_PRECISION:
        torch_step = bench.run(lambda name=name: build_fully_shard_step(bench, sizes, ("torch", name)))
        dcomm_step = bench.run(lambda name=name: build_fully_shard_step(bench, sizes, ("dcomm", name)))
        details = _ratios({"dcomm": dcomm_step, "torch": torch_step}, default, "default")
        details["torch"] = "MixedPrecisionPolicy(reduce_dtype)"
        rows.append(Row(f"fully_shard/{name}", dcomm_step, torch_step, {"default fp32": default}, details))
    return rows


CASES: dict[str, Callable[[Bench, Sizes], list[Row]]] = {
    "averaging": case_averaging,
    "ddp": case_ddp,
    "post-local-sgd": case_post_local_sgd,
    "zero": case_zero,
    "fsdp": case_fsdp,
    "fully_shard": case_fully_shard,
}
