"""Run the NCCL integration suite at 2, 4 and 8 GPUs (those the host has) and summarise it.

Two parts: the scenarios of ``tests-integration/run.py`` under torchrun at each world size, then
the fault suite (``tests-integration/test_faults.py``, the tests of the chosen backend) through
pytest, which starts its own ranks at 2, 3 and 4 and skips, saying so, those the GPUs cannot hold.
Works on any GPU host without hatch or network (pytest and pytest-timeout must be installed):
when ``dcomm`` is not installed, the packages' and the test helpers' ``src`` folders are put on
``PYTHONPATH``. NVLink multicast stays off in every launched rank.

Example::

    python -m tools.run_gpu_suite --out results/            # 2, 4, 8 GPUs as available, then the faults
    python -m tools.run_gpu_suite --sizes 4 --backend gloo  # CPU ranks, same scenarios
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tools.launch import with_multicast_off

ROOT = Path(__file__).resolve().parent.parent


def rank_env() -> dict[str, str]:
    env = {**with_multicast_off(), "PYTHONUNBUFFERED": "1"}
    src = [str(p) for p in sorted([*(ROOT / "packages").glob("*/src"), *(ROOT / "testing").glob("*/src")])]
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


def run_faults(backend: str, out: Path, timeout: float) -> dict:
    """The fault suite's tests for ``backend`` through pytest; its counts from pytest's JUnit XML."""
    log_path, xml_path = out / f"faults-{backend}.log", out / f"faults-{backend}.xml"
    xml_path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "pytest", str(ROOT / "tests-integration" / "test_faults.py"),
        "-k", backend, "-rA", f"--junitxml={xml_path}",
    ]  # fmt: skip
    print(f"== faults {backend}: {' '.join(cmd)}", flush=True)
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = -1
    print(log_path.read_text()[-6000:], flush=True)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml_path.exists():
        suite = ET.parse(xml_path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in counts} if suite is not None else counts
    failed = counts["failures"] + counts["errors"]
    return {
        "exit_code": code,
        "passed": counts["tests"] - failed - counts["skipped"],
        "failed": failed,
        "skipped": counts["skipped"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8", help="world sizes to try (those above the GPU count are skipped)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per world size (and for the faults)")
    parser.add_argument("--no-faults", action="store_true", help="skip tests-integration/test_faults.py")
    args = parser.parse_args()

    import torch

    available = torch.cuda.device_count() if args.backend == "nccl" else os.cpu_count() or 1
    sizes = [s for s in map(int, args.sizes.split(",")) if s <= available]
    skipped = [s for s in map(int, args.sizes.split(",")) if s > available]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run_size(s, args.backend, args.out, args.timeout) for s in sizes]
    faults = None if args.no_faults else run_faults(args.backend, args.out, args.timeout)
    summary = {
        "date": dt.date.today().isoformat(),
        "backend": args.backend,
        "skipped_sizes": skipped,
        "runs": runs,
        "faults": faults,
    }
    (args.out / f"integration-{args.backend}-summary.json").write_text(json.dumps(summary, indent=2))
    print("\n| backend | GPUs | device | torch | passed | failed |\n|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {args.backend} | {r['world_size']} | {r['device']} | {r['torch']} | {r['passed']} | {r['failed']} |")
    for s in skipped:
        print(f"| {args.backend} | {s} | not run: only {available} available | | | |")
    if faults is not None:
        print(
            f"| {args.backend} | faults (test_faults.py, 2-4 ranks) | | | {faults['passed']} | {faults['failed']} "
            f"({faults['skipped']} skipped; see faults-{args.backend}.log) |"
        )
    total_failed = sum(r["failed"] for r in runs) + sum(r["exit_code"] != 0 for r in runs)
    total_passed = sum(r["passed"] for r in runs)
    if faults is not None:
        total_failed += faults["failed"] or int(faults["exit_code"] != 0)
        total_passed += faults["passed"]
    print(f"{total_passed} passed, {total_failed} failed")
    return 1 if total_failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
