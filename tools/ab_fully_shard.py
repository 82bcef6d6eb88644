"""A/B of fully_shard low-precision reduction: dcomm vs torch's ``reduce_dtype``, interleaved rounds.

The main benchmark times each variant in its own block, so slow drifts of the machine (clocks,
other tenants) land on one side. Here every variant is built once and the rounds alternate them
in a shuffled order, a few steps each; the per-round ratio dcomm/torch then compares steps taken
seconds apart. Rank 0 prints each variant's median step, the median per-round ratio with a 95%
bootstrap interval, and with ``--profile`` the GPU time per step by kernel kind (NCCL
reduce-scatter, all-gather, GEMM, elementwise/copy), which tells whether one side does more
work. Run under torchrun, one rank per GPU (NCCL), or per CPU process (gloo, small sizes)::

    torchrun --standalone --nproc-per-node 4 tools/ab_fully_shard.py --rounds 60 --profile
    torchrun --standalone --nproc-per-node 2 tools/ab_fully_shard.py --rounds 3   # CPU
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import init_distributed
from bench_cases import SIZES, build_fully_shard_step
from bench_timing import Bench, Step

VARIANTS: dict[str, tuple[str, str] | None] = {
    "default fp32": None,
    "torch fp16": ("torch", "fp16"),
    "dcomm fp16": ("dcomm", "fp16"),
    "torch bf16": ("torch", "bf16"),
    "dcomm bf16": ("dcomm", "bf16"),
}


def timed_rounds(bench: Bench, steps: dict[str, Step], rounds: int, per_round: int) -> dict[str, list[float]]:
    """Seconds per step of each variant, one entry per round; the order is shuffled each round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    shuffle = random.Random(0)  # the same order on every rank
    for _ in range(rounds):
        shuffle.shuffle(order)
        for name in order:
            dist.barrier(group=bench.side_group)
            bench.sync()
            start = time.perf_counter()
            for _ in range(per_round):
                steps[name]()
            bench.sync()
            times[name].append((time.perf_counter() - start) / per_round)
    return times


def bootstrap_median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values``."""
    sample = random.Random(1)
    medians = sorted(statistics.median(sample.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if "reducescatter" in lowered:
        return "nccl reduce-scatter"
    if "allgather" in lowered:
        return "nccl all-gather"
    if "nccl" in lowered:
        return "nccl other"
    if "gemm" in lowered or "cutlass" in lowered or "sm90" in lowered:
        return "gemm"
    return "elementwise/copy"


def gpu_time_by_kind(step: Step, steps: int = 3) -> dict[str, float]:
    """Microseconds of GPU time per step of ``step``, by kernel kind."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        micros = getattr(event, "self_device_time_total", 0) or 0
        if micros > 0:
            kind = kernel_kind(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + micros / steps
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--profile", action="store_true", help="also print GPU time per kernel kind")
    args = parser.parse_args()
    backend = init_distributed("auto", 300.0)
    bench = Bench.create(warmup=3, iters=1, cap_s=1.0)
    sizes = SIZES["large" if backend == "nccl" else "small"]
    steps = {name: build_fully_shard_step(bench, sizes, reduction) for name, reduction in VARIANTS.items()}
    for step in steps.values():
        for _ in range(3):
            step()
    times = timed_rounds(bench, steps, args.rounds, args.steps)
    profiled = args.profile and bench.is_cuda
    profiles = {name: gpu_time_by_kind(step) for name, step in steps.items()} if profiled else {}
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if bench.is_cuda else f"CPU ({backend})"
        print(
            f"{dist.get_world_size()}x {device}, torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps"
        )
        for name, values in times.items():
            print(f"{name:14s} median {statistics.median(values) * 1e3:7.3f} ms per step")
        for dtype in ("fp16", "bf16"):
            ratios = [a / b for a, b in zip(times[f"dcomm {dtype}"], times[f"torch {dtype}"], strict=True)]
            low, high = bootstrap_median_interval(ratios)
            faster = sum(r < 1 for r in ratios)
            print(
                f"{dtype}: dcomm/torch per-round median {statistics.median(ratios):.4f} "
                f"(95% interval {low:.4f}-{high:.4f}); dcomm faster in {faster}/{len(ratios)} rounds"
            )
        for name, kinds in profiles.items():
            print(f"GPU us per step, {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items())))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
