"""Benchmark dcomm against torch.distributed.algorithms, side by side in one run.

Run under torchrun, one rank per GPU (NCCL) or per CPU process (gloo)::

    torchrun --standalone --nproc-per-node 4 tools/bench.py --json tools/results/4xgpu-fast.json
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \\
        torchrun --standalone --nproc-per-node 4 tools/bench.py --link slow --json slow.json
    torchrun --standalone --nproc-per-node 2 tools/bench.py --size small --quick   # gloo, CPU

Cases (``--cases`` picks some): ``averaging`` (average_parameters vs a raw allreduce of the
same bytes), ``ddp`` (each DDP hook vs the built-in allreduce and a no-communication floor),
``post-local-sgd`` (periodic and hierarchical averaging), ``zero`` (ZeRO with Adam, with and
without each overlap hook) and ``fsdp`` (each FSDP hook vs the default reduction). Each row
gives the median step time of dcomm and of torch, their ratio, the peak device memory above the
step's starting level, and the case's reference points. Rank 0 prints the table and writes the
JSON (device, GPU count, torch version, date, link, every sample). A variant that raises is an
``error: ...`` cell; the run goes on. ``--link slow`` only labels the run (and shrinks sizes):
the slow link itself is the NCCL environment above, set by the caller. NVLink multicast
(NCCL_NVLS_ENABLE) is always off.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_cases import CASES, SIZES, Row, Sizes
from bench_timing import Bench, Failure, Measurement, Outcome, release_memory

# Never NVLink multicast (NVLS): the lent machines must not use it.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LINK_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE")
DISTRIBUTIONS = ("dcomm-core", "dcomm-ddp", "dcomm-fsdp", "dcomm-averaging")

# (warmup steps, max timed samples, seconds a variant may spend on timed samples)
ITERATIONS = {
    ("large", False): (5, 50, 6.0),
    ("large", True): (2, 8, 1.5),
    ("large-slow", False): (2, 8, 3.0),
    ("large-slow", True): (1, 4, 1.5),
    ("small", False): (2, 10, 1.0),
    ("small", True): (1, 3, 0.3),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="", help="write the results here (rank 0)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="cases to run")
    parser.add_argument("--link", choices=["fast", "slow"], default="fast", help="label of the link under test")
    parser.add_argument("--size", choices=["auto", "large", "small"], default="auto", help="auto: large on GPUs")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="auto: nccl on GPUs")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (about half the time)")
    parser.add_argument(
        "--budget-s", type=float, default=150.0, help="seconds after start when remaining variants are skipped"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any dcomm variant failed")
    return parser.parse_args(argv)


def init_distributed(backend: str, timeout_s: float) -> str:
    """Start the process group of this torchrun rank (its GPU from LOCAL_RANK under NCCL)."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ[key] = value
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_id = None
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device_id = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return backend


def choose_sizes(args: argparse.Namespace, backend: str) -> tuple[str, Sizes]:
    size = args.size if args.size != "auto" else ("large" if backend == "nccl" else "small")
    if size == "large" and args.link == "slow":
        size = "large-slow"
    return size, SIZES[size]


def run_case(name: str, bench: Bench, sizes: Sizes) -> list[Row]:
    """The case's rows; a failure outside its variants becomes one error row."""
    try:
        return CASES[name](bench, sizes)
    except Exception as exc:  # reported in the table
        release_memory()
        failure = Failure(f"error: {type(exc).__name__}: {exc}")
        return [Row(name, failure, failure)]


# --------------------------------------------------------------------------------------------
# Reporting (rank 0)


def fmt_ms(outcome: Outcome | None) -> str:
    if outcome is None:
        return "-"
    if isinstance(outcome, Failure):
        return "skipped" if outcome.reason.startswith("skipped") else "error"
    return f"{outcome.median_s * 1e3:.3f}"


def fmt_bytes(outcome: Outcome | None) -> str:
    if not isinstance(outcome, Measurement):
        return "-"
    if outcome.peak_extra_bytes is None:
        return "n/a"
    return f"{outcome.peak_extra_bytes / 2**20:.1f} MiB"


def fmt_details(row: Row) -> str:
    parts = [
        f"{name}={fmt_ms(outcome)}" + ("ms" if isinstance(outcome, Measurement) else "")
        for name, outcome in row.baselines.items()
    ]
    parts += [f"{key}={value}" for key, value in row.details.items()]
    return "  ".join(parts)


def failure_notes(outcomes: dict[str, Outcome | None]) -> list[str]:
    """One indented line per error; a single line when variants were skipped for time."""
    failures = {who: o.reason for who, o in outcomes.items() if isinstance(o, Failure)}
    notes = [f"    {who}: {reason}" for who, reason in failures.items() if not reason.startswith("skipped")]
    skipped = [who for who, reason in failures.items() if reason.startswith("skipped")]
    if skipped:
        notes.append(f"    skipped (time budget spent): {', '.join(skipped)}")
    return notes


def table_lines(rows: list[Row]) -> list[str]:
    """An aligned table, one row per case line, each failure's reason on the lines below it."""
    header = ("case", "dcomm ms", "torch ms", "dcomm/torch", "dcomm mem", "torch mem", "reference points and ratios")
    cells = [header]
    notes: dict[int, list[str]] = {}
    for index, row in enumerate(rows, start=1):
        ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
        cells.append(
            (
                row.case,
                fmt_ms(row.dcomm),
                fmt_ms(row.torch),
                ratio,
                fmt_bytes(row.dcomm),
                fmt_bytes(row.torch),
                fmt_details(row),
            )
        )
        outcomes = {"dcomm": row.dcomm, "torch": row.torch, **row.baselines}
        notes[index] = failure_notes(outcomes)
    widths = [max(len(line[col]) for line in cells) for col in range(len(header) - 1)]
    lines = []
    for index, line in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + "  " + line[-1])
        if index == 0:
            lines.append("-" * len(lines[0]))
        lines.extend(notes.get(index, []))
    return lines


def nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def run_metadata(args: argparse.Namespace, backend: str, size: str, sizes: Sizes) -> dict[str, object]:
    versions = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # run from source (PYTHONPATH), not installed
            module = importlib.import_module("dcomm." + name.removeprefix("dcomm-"))
            versions[name] = getattr(module, "__version__", None)
    cuda = backend == "nccl"
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
        "nccl": nccl_version() if cuda else None,
        "dcomm": versions,
        "size": size,
        "sizes": sizes.__dict__,
        "quick": args.quick,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    backend = init_distributed(args.backend, args.timeout_s)
    size, sizes = choose_sizes(args, backend)
    warmup, iters, cap_s = ITERATIONS[(size, args.quick)]
    bench = Bench.create(warmup=warmup, iters=iters, cap_s=cap_s)
    bench.deadline = started + args.budget_s
    rank = dist.get_rank()
    meta = run_metadata(args, backend, size, sizes)
    if rank == 0:
        print(f"[bench] {meta['device']} x{meta['world_size']} {backend} link={args.link} size={size}", flush=True)
    rows: list[Row] = []
    for name in args.cases:
        case_start = time.perf_counter()
        rows.extend(run_case(name, bench, sizes))
        if rank == 0:
            print(f"[bench] {name}: {time.perf_counter() - case_start:.1f}s", flush=True)
    if rank == 0:
        print("\n".join(table_lines(rows)), flush=True)
        print(f"[bench] total {time.perf_counter() - started:.1f}s", flush=True)
        if args.json:
            meta["cases"] = [row.to_json() for row in rows]
            with open(args.json, "w") as f:
                json.dump(meta, f, indent=2)
    dist.barrier(group=bench.side_group)
    dist.destroy_process_group()
    failed = any(isinstance(row.dcomm, Failure) for row in rows)
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
