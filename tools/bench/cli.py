"""The command line of :mod:`tools.bench`: parse flags, run the matrix, print and save results.

Example::

    torchrun --standalone --nproc-per-node 2 -m tools.bench --size small --quick --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tools.bench import __doc__ as bench_doc
from tools.bench.ab import CaseResult, Policy, VariantResult, keep_variants, run_case, with_control
from tools.bench.cases import CASES, PER_RUN_CASES, PER_WORKLOAD_CASES, Context
from tools.bench.cases.common import DEFAULT_SYNC_EVERY
from tools.bench.report import table_lines
from tools.bench.timing import Bench, release_memory
from tools.bench.workloads import PRECISIONS, WORKLOADS, set_tf32
from tools.launch import init_rank, short_error

__all__ = ["main", "parse_args"]

LINK_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE")
DISTRIBUTIONS = ("dcomm-core", "dcomm-ddp", "dcomm-fsdp", "dcomm-averaging")

# Seconds of timed rounds per case, bounds on the rounds, steps per variant per round; by --quick.
POLICIES = {
    False: Policy(budget_s=6.0, min_rounds=5, max_rounds=60, steps=3),
    True: Policy(budget_s=1.0, min_rounds=3, steps=1),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=(bench_doc or "").splitlines()[0])
    parser.add_argument("--json", default="", help="write the results here (rank 0)")
    parser.add_argument("--chart", default="", help="also draw the results as a PNG here (needs matplotlib)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="cases to run")
    parser.add_argument(
        "--workload", nargs="+", choices=[*WORKLOADS, "all"], default=["all"], help="workloads (default: all)"
    )
    parser.add_argument(
        "--precision", nargs="+", choices=[*PRECISIONS, "all"], default=["tf32"], help="precisions (default: tf32)"
    )
    parser.add_argument(
        "--variants", nargs="+", default=[], help="only variants matching these globs, e.g. 'dcomm *' 'no overlap'"
    )
    parser.add_argument("--link", choices=["fast", "slow"], default="fast", help="label of the link under test")
    parser.add_argument("--size", choices=["auto", "large", "small"], default="auto", help="auto: large on GPUs")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="auto: nccl on GPUs")
    parser.add_argument("--quick", action="store_true", help="1 s of rounds per case, at least 3 rounds")
    parser.add_argument("--case-budget-s", type=float, default=None, help="seconds of timed rounds per case")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per variant per round (default 3; post-local SGD: periods of 4)"
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=DEFAULT_SYNC_EVERY,
        help=f"DiLoCo's H: inner steps per sync (default {DEFAULT_SYNC_EVERY}; a round is one period)",
    )
    parser.add_argument("--min-rounds", type=int, default=None, help="rounds per case at least")
    parser.add_argument("--max-rounds", type=int, default=None, help="rounds per case at most")
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="seconds after start when the remaining cases are skipped"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="GPU time per step by kernel kind, and the compute stream's busy and idle time, per variant",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="add an A/A pair per case: its reference built twice, timed against itself (the noise floor)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when any dcomm variant failed")
    args = parser.parse_args(argv)
    if args.min_rounds is not None and args.max_rounds is not None and args.min_rounds > args.max_rounds:
        parser.error(f"--min-rounds {args.min_rounds} is above --max-rounds {args.max_rounds}; lower it")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: must be at least 1")
    if args.sync_every < 1:
        parser.error(f"--sync-every {args.sync_every}: must be at least 1")
    for flag in ("min_rounds", "max_rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 2:
            parser.error(f"--{flag.replace('_', '-')} must be at least 2 (an interval needs two rounds)")
    args.workload = list(WORKLOADS) if "all" in args.workload else list(dict.fromkeys(args.workload))
    args.precision = list(PRECISIONS) if "all" in args.precision else list(dict.fromkeys(args.precision))
    return args


def policy_of(args: argparse.Namespace) -> Policy:
    policy = POLICIES[args.quick]
    overrides = {"budget_s": args.case_budget_s, "min_rounds": args.min_rounds, "max_rounds": args.max_rounds}
    overrides.update(steps=args.steps, profile=args.profile or None)
    fields = {key: value for key, value in overrides.items() if value is not None}
    return Policy(**{**policy.__dict__, **fields})


def size_tier(args: argparse.Namespace, backend: str) -> str:
    size = args.size if args.size != "auto" else ("large" if backend == "nccl" else "small")
    return "large-slow" if size == "large" and args.link == "slow" else size


def planned_runs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(case, workload, precision) in run order; per-workload cases once, per-run cases once at the end."""
    runs = []
    for workload in args.workload:
        for index, precision in enumerate(args.precision):
            for case in args.cases:
                if case in PER_RUN_CASES or (case in PER_WORKLOAD_CASES and index > 0):
                    continue
                label = "-" if case in PER_WORKLOAD_CASES else precision
                runs.append((case, workload, label))
    runs += [(case, "-", "-") for case in args.cases if case in PER_RUN_CASES]
    return runs


def skipped(case: str, workload: str, precision: str, reason: str) -> CaseResult:
    return CaseResult(case, workload, precision, 0, 0, 0.0, {}, {"all variants": VariantResult(error=reason)}, [])


def run_one(
    bench: Bench,
    tier: str,
    policy: Policy,
    case: str,
    workload: str,
    precision: str,
    variants: Sequence[str] = (),
    control: bool = False,
    sync_every: int = DEFAULT_SYNC_EVERY,
) -> CaseResult:
    """One case on one workload and precision; a failure outside its variants becomes an error.

    ``variants``: globs of the variants to keep; ``control``: add the case's A/A pair (:func:`with_control`);
    ``sync_every``: the DiLoCo variants' H.
    """
    # Per-run cases ("-") ignore the workload and precision; they get mlp-wide in fp32.
    model = WORKLOADS[workload if workload != "-" else "mlp-wide"][tier]
    set_tf32(precision not in ("fp32", "-"))
    ctx = Context(bench, model, precision if precision != "-" else "fp32", sync_every)
    try:
        kept = keep_variants(CASES[case](ctx), variants)
        return run_case(bench, with_control(kept) if control else kept, policy, workload, precision)
    except Exception as exc:  # reported in the table
        release_memory()
        return skipped(case, workload, precision, f"error: {short_error(exc)}")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # run from source (PYTHONPATH), not installed
        module = importlib.import_module("dcomm." + name.removeprefix("dcomm-"))
        return getattr(module, "__version__", None)


def run_metadata(args: argparse.Namespace, backend: str, tier: str, policy: Policy) -> dict[str, Any]:
    cuda = backend == "nccl"
    nccl = torch.cuda.nccl.version() if cuda else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "world_size": dist.get_world_size(),
        "backend": backend,
        "link": args.link,
        "link_env": {key: os.environ.get(key) for key in LINK_ENV},
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "dcomm": {name: _version(name) for name in DISTRIBUTIONS},
        "size": tier,
        "workloads": {name: WORKLOADS[name][tier].__dict__ for name in args.workload},
        "precisions": args.precision,
        "policy": policy.__dict__,
        "method": "interleaved A/B: shuffled rounds, slowest rank per round, median per-round ratio, 95% bootstrap",
    }


def write_chart_or_say_why(meta: dict[str, Any], path: str) -> None:
    """Draw the chart; a missing matplotlib is reported, never left to stop rank 0 alone."""
    try:
        from tools.bench_chart import write_chart

        write_chart([meta], path)
        print(f"[bench] chart: {path}", flush=True)
    except Exception as exc:  # the JSON is written; python -m tools.bench_chart can draw it later
        print(f"[bench] no chart: {short_error(exc)}", flush=True)


def write_json(path: str, meta: dict[str, Any], results: list[CaseResult]) -> None:
    """Write the run's metadata and the results so far to ``path`` (nothing when it is empty)."""
    if path:
        meta["results"] = [result.to_json() for result in results]
        with open(path, "w") as f:
            json.dump(meta, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    backend = init_rank(args.backend, args.timeout_s)
    bench = Bench.create(deadline=started + args.budget_s, timeout_s=args.timeout_s)
    tier, policy = size_tier(args, backend), policy_of(args)
    meta = run_metadata(args, backend, tier, policy)
    if bench.rank == 0:
        print(f"[bench] {meta['device']} x{meta['world_size']} {backend} link={args.link} size={tier}", flush=True)
    results: list[CaseResult] = []
    for case, workload, precision in planned_runs(args):
        if bench.out_of_time():
            results.append(skipped(case, workload, precision, "skipped: the benchmark's time budget was spent"))
            continue
        result = run_one(bench, tier, policy, case, workload, precision, args.variants, args.control, args.sync_every)
        results.append(result)
        if bench.rank == 0:
            print(f"[bench] {case} {workload} {precision}: {result.rounds} rounds, {result.seconds:.1f}s", flush=True)
            write_json(args.json, meta, results)  # after every case: a run cut short keeps what it measured
    if bench.rank == 0:
        print("\n".join(table_lines(results)), flush=True)
        print(f"[bench] total {time.perf_counter() - started:.1f}s", flush=True)
        write_json(args.json, meta, results)
        if args.chart:
            write_chart_or_say_why(meta, args.chart)
    bench.barrier()
    dist.destroy_process_group()
    failed = any(v.error.startswith("error") for r in results for n, v in r.variants.items() if "dcomm" in n)
    return 1 if args.strict and failed else 0
