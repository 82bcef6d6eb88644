"""Run the NCCL integration suite at 2, 4 and 8 GPUs (those the host has) and summarise it.

Works on any GPU host without hatch or network: when ``dcomm`` is not installed, the packages'
``src`` folders are put on ``PYTHONPATH``. NVLink multicast stays off in every launched rank.

Example::

    python -m tools.run_gpu_suite --out results/            # 2, 4, 8 GPUs as available
    python -m tools.run_gpu_suite --sizes 4 --backend gloo  # CPU ranks, same scenarios
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

from tools.launch import with_multicast_off

ROOT = Path(__file__).resolve().parent.parent


def rank_env() -> dict[str, str]:
    env = {**with_multicast_off(), "PYTHONUNBUFFERED": "1"}
    src = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_size(size: int, backend: str, out: Path, timeout: float) -> dict:
    json_path = out / f"integration-{backend}-x{size}.json"
    log_path = out / f"integration-{backend}-x{size}.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}",
        str(ROOT / "tests-integration" / "run.py"), "--backend", backend, "--json", str(json_path),
    ]  # fmt: skip
    print(f"== {backend} x{size}: {' '.join(cmd)}", flush=True)
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(cmd, env=rank_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = -1
    print(log_path.read_text()[-6000:], flush=True)
    result = json.loads(json_path.read_text()) if json_path.exists() else {"outcomes": []}
    passed = sum(o["passed"] for o in result["outcomes"])
    return {
        "world_size": size,
        "exit_code": code,
        "passed": passed,
        "failed": len(result["outcomes"]) - passed,
        "device": result.get("device"),
        "torch": result.get("torch"),
        "outcomes": result["outcomes"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8", help="world sizes to try (those above the GPU count are skipped)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per world size")
    args = parser.parse_args()

    import torch

    available = torch.cuda.device_count() if args.backend == "nccl" else os.cpu_count() or 1
    sizes = [s for s in map(int, args.sizes.split(",")) if s <= available]
    skipped = [s for s in map(int, args.sizes.split(",")) if s > available]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run_size(s, args.backend, args.out, args.timeout) for s in sizes]
    summary = {
        "date": dt.date.today().isoformat(),
        "backend": args.backend,
        "skipped_sizes": skipped,
        "runs": runs,
    }
    (args.out / f"integration-{args.backend}-summary.json").write_text(json.dumps(summary, indent=2))
    print("\n| backend | GPUs | device | torch | passed | failed |\n|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {args.backend} | {r['world_size']} | {r['device']} | {r['torch']} | {r['passed']} | {r['failed']} |")
    for s in skipped:
        print(f"| {args.backend} | {s} | not run: only {available} available | | | |")
    total_failed = sum(r["failed"] for r in runs) + sum(r["exit_code"] != 0 for r in runs)
    print(f"{sum(r['passed'] for r in runs)} passed, {total_failed} failed")
    return 1 if total_failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
