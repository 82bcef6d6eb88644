"""dcomm in one command: train a small model with every dcomm algorithm on several local ranks.

Usage (no GPU needed; ``hatch run demo`` runs the same)::

    python -m tools.demo                    # 4 gloo ranks on the CPU, 40 steps per algorithm
    python -m tools.demo --world-size 2 --steps 10
    python -m tools.demo --backend nccl     # one rank per GPU (auto picks it with enough GPUs)

The demo starts the ranks itself (a process group over a ``FileStore``; ``LOCAL_WORLD_SIZE`` makes
them look like two nodes, so hierarchical averaging and post-local SGD have intra-node groups),
trains the same MLP regression on the same per-rank data with each algorithm (DDP with the
allreduce, fp16 and bf16 hooks; post-local SGD with periodic and hierarchical averaging; ZeRO
with both overlap hooks; FSDP and ``fully_shard`` with bf16 gradient reduction), first with
dcomm and then with torch's built-in counterpart, printing one line per run. It ends with a
table: evaluation loss before and after, median step time, and the bytes each rank hands to
collectives per step (computed from the parameter bytes and the algorithm's schedule). It exits 1
if any dcomm run fails or does not reduce the loss; torch's runs that cannot run here (torch's
ZeRO overlap refuses gloo, say) are shown with the reason.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dcomm.core.testing import RankFailure, run_ranks
from tools.impls import resolve
from tools.launch import MULTICAST_OFF, agree_on_error

FEATURES, HIDDEN, BATCH, EVAL_SAMPLES = 16, 64, 32, 256
START_LOCAL_SGD_ITER = 4
"""Post-local SGD: steps of global gradient allreduce before local SGD (= averagers' warmup)."""
PERIOD = 4
"""Periodic averaging period; the hierarchy averages within a node every 2 steps, globally every 4."""


# --------------------------------------------------------------------------------------------
# The problem: a fixed teacher network, per-rank batches, one shared evaluation set


@dataclass
class Problem:
    """Synthetic regression ``y = teacher(x)``; each rank draws its own batches."""

    device: torch.device
    rank: int
    teacher: nn.Module = field(init=False)
    eval_x: torch.Tensor = field(init=False)
    eval_y: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        torch.manual_seed(1234)
        self.teacher = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1)).to(self.device)
        self.eval_x, self.eval_y = self._sample(EVAL_SAMPLES, torch.Generator().manual_seed(99))

    @torch.no_grad()
    def _sample(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(count, FEATURES, generator=generator).to(self.device)
        return x, self.teacher(x)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(BATCH, torch.Generator().manual_seed(10_000 * self.rank + step))

    def new_model(self) -> nn.Module:
        """The student, identical on every rank and in every run."""
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)).to(self.device)

    @torch.no_grad()
    def eval_loss(self, model: nn.Module) -> float:
        """Mean squared error on the evaluation set, averaged over ranks (local SGD differs per rank)."""
        loss = nn.functional.mse_loss(model(self.eval_x).float(), self.eval_y).reshape(1)
        dist.all_reduce(loss)
        return loss.item() / dist.get_world_size()


@dataclass
class Context:
    """What every algorithm builder needs on this rank."""

    problem: Problem
    world: int
    node_size: int
    node_group: dist.ProcessGroup | None

    @property
    def device(self) -> torch.device:
        return self.problem.device

    def ddp(self, module: nn.Module) -> nn.parallel.DistributedDataParallel:
        device_ids = [self.device] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)


@dataclass
class Trainee:
    """A model to evaluate and the closure that trains it one step on ``(x, y)``."""

    model: nn.Module
    step: Callable[[torch.Tensor, torch.Tensor], None]


def sgd_trainee(model: nn.Module, optimizer: torch.optim.Optimizer) -> Trainee:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    return Trainee(model, step)


LR = 0.05


# --------------------------------------------------------------------------------------------
# The algorithms, each built with dcomm ("dcomm") or torch's built-in version ("torch")


def build_ddp(ctx: Context, impl: str, hook_name: str) -> Trainee:
    """DDP with the hook ``hook_name`` (allreduce_hook, fp16_compress_hook, bf16_compress_hook)."""
    ddp = ctx.ddp(ctx.problem.new_model())
    ddp.register_comm_hook(None, resolve(impl, hook_name))
    return sgd_trainee(ddp, torch.optim.SGD(ddp.parameters(), lr=LR))


def hierarchy(ctx: Context) -> collections.OrderedDict[int, int]:
    """Average within a node every 2 steps and over the world every 4."""
    levels: collections.OrderedDict[int, int] = collections.OrderedDict()
    if ctx.node_size < ctx.world:
        levels[2] = ctx.node_size
    levels[PERIOD] = ctx.world
    return levels


def build_post_local_sgd(ctx: Context, impl: str, averaging: str) -> Trainee:
    """Post-local SGD (intra-node gradient allreduce after the switch) + periodic/hierarchical averaging.

    dcomm finds the intra-node groups itself (``subgroup=None``, from LOCAL_WORLD_SIZE); torch's
    would ask for one group per GPU, so it is handed the same groups explicitly.
    """
    subgroup = None if impl == "dcomm" else ctx.node_group
    ddp = ctx.ddp(ctx.problem.new_model())
    state = resolve(impl, "PostLocalSGDState")(
        process_group=None, subgroup=subgroup, start_localSGD_iter=START_LOCAL_SGD_ITER
    )
    ddp.register_comm_hook(state, resolve(impl, "post_localSGD_hook"))
    if averaging == "periodic":
        averager = resolve(impl, "PeriodicModelAverager")(period=PERIOD, warmup_steps=START_LOCAL_SGD_ITER)
    else:
        averager = resolve(impl, "HierarchicalModelAverager")(hierarchy(ctx), warmup_steps=START_LOCAL_SGD_ITER)
    sgd = torch.optim.SGD(ddp.parameters(), lr=LR)
    optimizer = resolve(impl, "PostLocalSGDOptimizer")(optim=sgd, averager=averager)
    return sgd_trainee(ddp, optimizer)


def build_zero_overlap(ctx: Context, impl: str, wrapper_name: str) -> Trainee:
    """DDP + ZeroRedundancyOptimizer(Adam) stepping inside backward through ``wrapper_name``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = ctx.ddp(ctx.problem.new_model())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=0.01)
    hook = resolve(impl, wrapper_name)(resolve(impl, "allreduce_hook"), ddp, zero)
    ddp.register_comm_hook(None, hook)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        zero.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()  # the optimizer steps inside backward

    return Trainee(ddp, step)


def build_fsdp_bf16(ctx: Context, impl: str) -> Trainee:
    """FSDP (FULL_SHARD) reducing gradients in bf16 through ``bf16_compress_hook``."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    model = FullyShardedDataParallel(
        ctx.problem.new_model(), sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=ctx.device
    )
    state = resolve(impl, "LowPrecisionState")(dist.group.WORLD, parameter_type=torch.float32)
    model.register_comm_hook(state, resolve(impl, "fsdp.bf16_compress_hook"))
    return sgd_trainee(model, torch.optim.SGD(model.parameters(), lr=LR))


def build_fully_shard_bf16(ctx: Context, impl: str) -> Trainee:
    """FSDP2 ``fully_shard`` reducing gradients in bf16 (torch: MixedPrecisionPolicy(reduce_dtype))."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = ctx.problem.new_model()
    if impl == "dcomm":
        from dcomm.fsdp import use_low_precision_reduction

        fully_shard(model)
        use_low_precision_reduction(model, torch.bfloat16)
    else:
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    return sgd_trainee(model, torch.optim.SGD(model.parameters(), lr=LR))


# --------------------------------------------------------------------------------------------
# Bytes each rank hands to collectives per step (P parameters, fp32 = 4 bytes each)


def ddp_bytes(bytes_per_param: int) -> Callable[[Context, int, int], float]:
    return lambda ctx, params, steps: float(params * bytes_per_param)


def post_local_sgd_bytes(averaging: str) -> Callable[[Context, int, int], float]:
    """Gradient allreduce every step (global, then intra-node) + parameters on averaging steps."""

    def averages_at(ctx: Context, step: int) -> bool:
        if step < START_LOCAL_SGD_ITER:
            return False
        if averaging == "periodic":
            return (step - START_LOCAL_SGD_ITER) % PERIOD == 0
        return any(step % period == 0 for period in hierarchy(ctx))

    def per_step(ctx: Context, params: int, steps: int) -> float:
        averaging_steps = sum(averages_at(ctx, step) for step in range(steps))
        return params * 4 * (steps + averaging_steps) / steps

    return per_step


def zero_bytes(ctx: Context, params: int, steps: int) -> float:
    """Gradient allreduce + every rank's updated shard broadcast to the others."""
    return float(params * 4 * 2)


def fsdp_bf16_bytes(ctx: Context, params: int, steps: int) -> float:
    """One root unit: all-gather fp32 parameters once (kept for backward) + bf16 reduce-scatter."""
    return float(params * 4 + params * 2)


@dataclass(frozen=True)
class Algorithm:
    """A named way to train, its builder, whether torch has it, and its bytes per step."""

    name: str
    build: Callable[[Context, str], Trainee]
    comm_bytes: Callable[[Context, int, int], float]
    impls: tuple[str, ...] = ("dcomm", "torch")


ALGORITHMS = [
    Algorithm("DDP + allreduce_hook", lambda c, i: build_ddp(c, i, "allreduce_hook"), ddp_bytes(4)),
    Algorithm("DDP + fp16_compress_hook", lambda c, i: build_ddp(c, i, "fp16_compress_hook"), ddp_bytes(2)),
    Algorithm("DDP + bf16_compress_hook", lambda c, i: build_ddp(c, i, "bf16_compress_hook"), ddp_bytes(2)),
    Algorithm(
        "post-local SGD + periodic averaging",
        lambda c, i: build_post_local_sgd(c, i, "periodic"),
        post_local_sgd_bytes("periodic"),
    ),
    Algorithm(
        "post-local SGD + hierarchical averaging",
        lambda c, i: build_post_local_sgd(c, i, "hierarchical"),
        post_local_sgd_bytes("hierarchical"),
    ),
    Algorithm(
        "ZeRO overlap: hook_with_zero_step", lambda c, i: build_zero_overlap(c, i, "hook_with_zero_step"), zero_bytes
    ),
    Algorithm(
        "ZeRO overlap: ..._interleaved",
        lambda c, i: build_zero_overlap(c, i, "hook_with_zero_step_interleaved"),
        zero_bytes,
    ),
    Algorithm("FSDP + bf16_compress_hook", build_fsdp_bf16, fsdp_bf16_bytes),
    Algorithm("fully_shard + bf16 reduction", build_fully_shard_bf16, fsdp_bf16_bytes),
]


# --------------------------------------------------------------------------------------------
# Running on every rank


@dataclass
class RunResult:
    """One (algorithm, implementation) run as rank 0 saw it."""

    algorithm: str
    impl: str
    error: str = ""
    loss_before: float = math.nan
    loss_after: float = math.nan
    step_ms: float = math.nan
    comm_bytes: float = math.nan

    @property
    def failed(self) -> bool:
        """A dcomm run fails when it raised or did not reduce the loss; torch's are references."""
        if self.impl != "dcomm":
            return False
        return bool(self.error) or not self.loss_after < self.loss_before


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(ctx: Context, trainee: Trainee, steps: int) -> tuple[float, float, float]:
    """(loss before, loss after, median step milliseconds) of ``steps`` steps."""
    loss_before = ctx.problem.eval_loss(trainee.model)
    times = []
    for step in range(steps):
        x, y = ctx.problem.batch(step)
        synchronize(ctx.device)
        start = time.perf_counter()
        trainee.step(x, y)
        synchronize(ctx.device)
        times.append(time.perf_counter() - start)
    return loss_before, ctx.problem.eval_loss(trainee.model), statistics.median(times) * 1e3


def run_one(ctx: Context, algorithm: Algorithm, impl: str, steps: int, side: dist.ProcessGroup) -> RunResult:
    result = RunResult(algorithm.name, impl)
    error = ""
    try:
        trainee = algorithm.build(ctx, impl)
        params = sum(p.numel() for p in ctx.problem.new_model().parameters())
        result.loss_before, result.loss_after, result.step_ms = train(ctx, trainee, steps)
        result.comm_bytes = algorithm.comm_bytes(ctx, params, steps)
    except Exception as exc:  # a failing run is a result; the others go on
        error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:150]}"
    result.error = agree_on_error(error, side)
    return result


def progress_line(index: int, total: int, result: RunResult) -> str:
    head = f"[{index:>2}/{total}] {result.algorithm:<40} {result.impl:<5}"
    if result.error:
        label = "FAILED" if result.impl == "dcomm" else "not available here"
        return f"{head} {label}: {result.error}"
    return f"{head} loss {result.loss_before:.5f} -> {result.loss_after:.5f}   {result.step_ms:6.2f} ms/step" + (
        "   LOSS DID NOT DECREASE" if result.failed else ""
    )


def rank_main(rank: int, world: int, steps: int, node_size: int) -> list[dict[str, Any]]:
    """Run every algorithm with every implementation; rank 0 prints progress and returns results."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    side = dist.new_group(backend="gloo")
    node_group, _ = dist.new_subgroups(group_size=node_size)
    ctx = Context(Problem(device, rank), world, node_size, node_group)
    runs = [(algorithm, impl) for algorithm in ALGORITHMS for impl in algorithm.impls]
    results = []
    for index, (algorithm, impl) in enumerate(runs, start=1):
        result = run_one(ctx, algorithm, impl, steps, side)
        results.append(result.__dict__)
        if rank == 0:
            print(progress_line(index, len(runs), result), flush=True)
    return results


# --------------------------------------------------------------------------------------------
# The launcher (main process)


def human_bytes(count: float) -> str:
    if math.isnan(count):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def table(results: list[RunResult]) -> str:
    header = ("algorithm", "impl", "eval loss before -> after", "ms/step", "comm bytes/step/rank")
    lines = [header]
    previous = ""
    for r in results:
        name = r.algorithm if r.algorithm != previous else ""
        previous = r.algorithm
        if r.error:
            status = "FAILED: " if r.impl == "dcomm" else "n/a: "
            lines.append((name, r.impl, status + r.error, "", ""))
            continue
        loss = f"{r.loss_before:.5f} -> {r.loss_after:.5f}"
        lines.append((name, r.impl, loss, f"{r.step_ms:.2f}", human_bytes(r.comm_bytes)))
    widths = [max(len(line[col]) for line in lines if len(line[col]) < 60) for col in range(len(header))]
    rendered = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines]
    rendered.insert(1, "-" * len(rendered[0]))
    return "\n".join(line.rstrip() for line in rendered)


def choose_backend(requested: str, world: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def node_size_for(world: int) -> int:
    """Pretend to be two nodes when the world splits evenly (LOCAL_WORLD_SIZE = world / 2)."""
    return world // 2 if world >= 4 and world % 2 == 0 else world


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="ranks to start (default 4)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl with GPUs")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a hung run is stopped")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.steps < 2:
        parser.error("--world-size and --steps must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = choose_backend(args.backend, args.world_size)
    node_size = node_size_for(args.world_size)
    print(
        f"dcomm demo: {args.world_size} {backend} ranks as {args.world_size // node_size} node(s) of {node_size}, "
        f"{args.steps} steps per run, torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    env = {"LOCAL_WORLD_SIZE": str(node_size), **MULTICAST_OFF}
    try:
        per_rank = run_ranks(
            rank_main, args.world_size, args.steps, node_size, backend=backend, timeout=args.timeout, env=env
        )
    except RankFailure as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    results = [RunResult(**fields) for fields in per_rank[0]]
    print()
    print(table(results))
    failed = [r for r in results if r.failed]
    print(
        f"\n{len(results) - len(failed)} of {len(results)} runs ok, {len(failed)} dcomm failures, "
        f"{time.perf_counter() - start:.1f}s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
