"""dcomm in one command: train a small byte-level language model with every algorithm.

Usage (no GPU needed; ``hatch run demo`` runs the same)::

    python -m tools.demo                          # 4 gloo ranks on the CPU, about a minute
    python -m tools.demo --config large --backend nccl   # a larger model, one rank per GPU
    python -m tools.demo --only fp16 post-local   # the runs whose name contains a word
    python -m tools.demo --config diloco          # DDP vs DiLoCo at H = 50 over 1000 steps, about 3 minutes
    python -m tools.demo --check                  # exit 1 when a dcomm run ends above torch's (CI)
    python -m tools.demo --config ft              # DiLoCo on torchft, replicas killed: see tools.demo_ft

The model is a small GPT (:mod:`tools.demo_lm.model`) learning the next byte of the running
interpreter's own standard library sources (:mod:`tools.demo_lm.corpus`): real text on every
machine, no download, the same split and data order for every run. Each algorithm of the table
in :mod:`tools.demo_lm.runs` trains it from the same initial weights: DDP with the built-in
allreduce (the baseline), each dcomm DDP hook and torch's, post-local SGD with the periodic and
hierarchical averagers, ZeRO overlap, FSDP and ``fully_shard`` with bf16 reduction, and DiLoCo
and the int8/fp8/PowerSGD hooks when they are installed.

It measures validation loss over the steps, the bytes each rank hands to collectives (counted
at the dispatcher, :mod:`tools.demo_lm.comm_bytes`) and the wall time, shows a live progress
display, prints what each algorithm saves against DDP's fp32 allreduce (bytes, time per step, the
loss reached) and every run's table, and writes ``demo-report/`` (one chart per family of
algorithms and ``report.md``). It exits 1 when a dcomm run raised or its loss did not fall; with
``--check``, also when one ends more than ``--tolerance`` above torch's run of the same algorithm
(the int8/fp8 hooks, which torch lacks: above DDP's fp32 allreduce). It also prints how far the
int8, fp8 and PowerSGD rank-4 runs (error feedback on) end from fp32 DDP at equal steps against
the same tolerance, and charts them (``compression_vs_fp32.png``); PowerSGD switches on after
``start_powerSGD_iter`` fp32 steps, as torch's documentation advises, for dcomm and torch alike.
Likewise the DiLoCo runs (fp32 and int8 pseudo-gradients) against their goal, within 2% of fp32
DDP at equal tokens (``diloco_vs_fp32.png``), reported without failing the demo; ``--config
diloco`` runs them at H = 50 for 1000 steps, the first 250 as DDP (the paper's synchronous start).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import math
import os
import pathlib
import platform
import sys
import time

import torch

from dcomm_testing import RankFailure, run_ranks
from tools.demo_lm.config import CONFIGS, Config
from tools.demo_lm.corpus import Corpus
from tools.demo_lm.report import convergence_goal, plain_table, savings_table, verdict, write_report
from tools.demo_lm.runs import ALGORITHMS, DILOCO_GOAL, DILOCO_TOLERANCE
from tools.demo_lm.train import RunResult, rank_main
from tools.launch import MULTICAST_OFF

DEFAULT_TOLERANCE = 0.01
"""A dcomm run may end at most 1% (relative) above torch's run of the same algorithm."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model and schedule size")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl with GPUs")
    parser.add_argument("--world-size", type=int, help="ranks to start (default: the configuration's)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the configuration's)")
    parser.add_argument(
        "--diloco-start", type=int, help="DDP steps before DiLoCo takes over (default: the configuration's)"
    )
    parser.add_argument(
        "--diloco-every", type=int, help="DiLoCo's inner steps per sync, H (default: the configuration's)"
    )
    parser.add_argument("--only", nargs="+", metavar="WORD", help="run only algorithms whose name contains a WORD")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("demo-report"), help="report folder")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="relative; default 0.01")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a dcomm run ends more than --tolerance above torch's"
    )
    parser.add_argument("--timeout", type=float, help="seconds before a hung job is stopped (default: by config)")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 2:
        parser.error(f"--world-size: expected at least 2, got {args.world_size}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: expected at least 1, got {args.steps}")
    if args.diloco_start is not None and args.diloco_start < 0:
        parser.error(f"--diloco-start: expected 0 or more, got {args.diloco_start}")
    if args.diloco_every is not None and args.diloco_every < 1:
        parser.error(f"--diloco-every: expected at least 1, got {args.diloco_every}")
    if args.only and not any(word.lower() in name.lower() for name in ALGORITHMS for word in args.only):
        parser.error(f"--only: no algorithm name contains any of {args.only}")
    return args


def choose_backend(requested: str, world: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def node_size_for(world: int) -> int:
    """Pretend to be two nodes when the world splits evenly (LOCAL_WORLD_SIZE = world / 2)."""
    return world // 2 if world >= 4 and world % 2 == 0 else world


def device_name(backend: str) -> str:
    if backend == "nccl":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def diloco_settings(config: Config) -> str:
    """How the DiLoCo runs train, for the output and the report."""
    syncs = (config.steps - config.diloco_start) // config.diloco_every
    start = (
        f"the first {config.diloco_start} steps are DDP's (fp32 gradient allreduce), then {syncs} syncs"
        if config.diloco_start
        else f"from the first step, {syncs} syncs"
    )
    return (
        f"H = {config.diloco_every} inner steps per sync; inner AdamW as above (each rank its own batch); "
        f"outer SGD lr 0.7, Nesterov momentum 0.9; {start}"
    )


def exit_code(results: list[RunResult], tolerance: float, check: bool) -> int:
    """1 when a dcomm run raised or its loss did not fall; with ``check``, also when one ended above
    its reference by more than ``tolerance``. 0 otherwise."""
    return 1 if verdict(results, tolerance if check else math.inf) else 0


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if "--config=ft" in given or any(a == "--config" and b == "ft" for a, b in itertools.pairwise(given)):
        from tools import demo_ft  # DiLoCo on torchft with killed replicas: its own runs and chart

        return demo_ft.main(given)
    args = parse_args(argv)
    # Demos other than the language model plug in here by configuration name.
    config = CONFIGS[args.config]
    config = dataclasses.replace(
        config,
        world_size=args.world_size or config.world_size,
        steps=args.steps or config.steps,
        diloco_start=config.diloco_start if args.diloco_start is None else args.diloco_start,
        diloco_every=args.diloco_every or config.diloco_every,
    )
    if config.diloco_start >= config.steps:
        print(
            f"--steps: {config.steps} leaves no DiLoCo step after {config.diloco_start} DDP steps "
            f"(--diloco-start); pass more steps than that, or a smaller --diloco-start",
            file=sys.stderr,
        )
        return 2
    world = config.world_size
    backend = choose_backend(args.backend, world)
    node_size = node_size_for(world)
    corpus = Corpus.load(config.corpus_bytes)
    params = sum(p.numel() for p in config.new_model().parameters())
    print(
        f"dcomm demo ({config.name}): {world} {backend} ranks as {world // node_size} node(s) of {node_size}; "
        f"GPT {config.layers}x{config.width}, {params / 1e3:.0f}k parameters; {config.steps} steps per run; "
        f"{corpus.source}: {corpus.train.numel() / 1e6:.1f} MB train, {corpus.val.numel() / 1e6:.1f} MB validation",
        flush=True,
    )
    start = time.perf_counter()
    env = {"LOCAL_WORLD_SIZE": str(node_size), **MULTICAST_OFF}
    live = sys.stdout.isatty()
    try:
        per_rank = run_ranks(
            rank_main,
            world,
            config,
            corpus,
            args.only or list(config.only) or None,
            live,
            backend=backend,
            timeout=args.timeout or config.timeout_s,
            env=env,
        )
    except RankFailure as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    results = [RunResult(**fields) for fields in per_rank[0]]
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(backend),
        "world size": f"{world} ranks ({backend}), as {world // node_size} node(s) of {node_size}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": f"GPT, {config.layers} layers, width {config.width}, {config.heads} heads, context "
        f"{config.context}, {params:,} parameters; AdamW lr {config.lr}",
        "data": f"{corpus.source}, sha256 {corpus.digest}; batch {config.batch_size} x {config.context} bytes "
        f"per rank; {config.steps} steps per run",
        "compression": "int8/fp8 hooks with error feedback (QuantizedState); PowerSGD rank 4 "
        f"with error feedback and warm start, start_powerSGD_iter={config.powersgd_start} (fp32 allreduce "
        "before), dcomm and torch alike",
        "diloco": diloco_settings(config),
        "wall time of the ranks": f"{elapsed:.0f} s (start to end, all runs)",
    }
    report = write_report(args.out, results, header, args.tolerance)
    failures = verdict(results, args.tolerance)
    print()
    print(plain_table(results))
    print("\nWhat each algorithm saves against DDP's fp32 allreduce (dcomm's runs):\n")
    print(savings_table(results))
    if backend == "gloo":
        print(
            f"\nOn CPU the {world} ranks share this machine's {os.cpu_count()} cores: the times show the work "
            "each algorithm adds here, not speed on GPUs (docs/benchmarks.md has GPU measurements)."
        )
    goal = convergence_goal(results, args.tolerance)
    if goal:
        print(f"\nCompression with error feedback vs fp32 DDP at equal steps (goal: within {args.tolerance:.0%}):")
        print("\n".join(f"  {line}" for line in goal))
    diloco = convergence_goal(results, DILOCO_TOLERANCE, DILOCO_GOAL)
    if diloco:
        print(f"\nDiLoCo vs fp32 DDP at equal tokens (goal: within {DILOCO_TOLERANCE:.0%}; {header['diloco']}):")
        print("\n".join(f"  {line}" for line in diloco))
    print(f"\n{len(results)} runs in {elapsed:.0f}s; report: {report}")
    code = exit_code(results, args.tolerance, args.check)
    for failure in failures:
        print(f"{'FAILED' if code else 'note'}: {failure}", file=sys.stderr if code else sys.stdout)
    within = f"{args.tolerance:.0%} over torch, or over fp32 DDP for int8/fp8"
    print(f"{len(failures)} dcomm runs outside the tolerance ({within})")
    if failures and not args.check:
        print("On GPUs runs of the same arithmetic differ by about 1%: --check makes this an error.")
    return code


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
