"""Run every integration scenario on the process group that torchrun launched.

Usage (any host; NCCL needs one GPU per rank)::

    torchrun --standalone --nproc-per-node 4 tests-integration/run.py --backend nccl --json out.json

Every rank runs the scenarios in the same order; after each one the ranks agree on its outcome
over a gloo side group, so a failing rank is reported and never leaves the others waiting in the
next scenario. Rank 0 prints a table and the closing line ``N passed, N failed``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

# This folder (the scenarios) and the repository root (the tools package, for the launch helpers).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import load_all

from tools.launch import gather_errors, init_rank, side_group


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("-k", default="", help="run only scenarios whose name contains this")
    parser.add_argument("--json", default="", help="write the per-scenario outcomes here (rank 0)")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    args = parser.parse_args()

    init_rank(args.backend, args.timeout)  # NVLink multicast off, one GPU per rank under NCCL
    rank, world = dist.get_rank(), dist.get_world_size()
    side = side_group(args.timeout)

    outcomes = []
    for sc in load_all():
        if args.k not in sc.name or not sc.runs_at(world, args.backend):
            continue
        start = time.perf_counter()
        try:
            sc.fn(rank, world)
            if args.backend == "nccl":
                torch.cuda.synchronize()
            error = ""
        except Exception:
            error = traceback.format_exc()
        seconds = time.perf_counter() - start
        failed = gather_errors(error, side)
        outcomes.append({"scenario": sc.name, "passed": not failed, "seconds": round(seconds, 3)})
        if rank == 0:
            status = "PASS" if not failed else f"FAIL on ranks {sorted(failed)}"
            print(f"[{args.backend} x{world}] {sc.name:<48} {status} ({seconds:.1f}s)", flush=True)
            for r, e in failed.items():
                print(f"--- rank {r} ---\n{e}", flush=True)

    passed = sum(o["passed"] for o in outcomes)
    failed_count = len(outcomes) - passed
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "backend": args.backend,
                        "world_size": world,
                        "torch": torch.__version__,
                        "device": torch.cuda.get_device_name() if args.backend == "nccl" else "cpu",
                        "outcomes": outcomes,
                    },
                    f,
                    indent=2,
                )
        print(f"{passed} passed, {failed_count} failed")
    dist.destroy_process_group()
    return 0 if failed_count == 0 and outcomes else 1


if __name__ == "__main__":
    sys.exit(main())
