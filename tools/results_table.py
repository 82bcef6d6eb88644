"""Render benchmark JSON files (from ``tools/bench.py --json``) as one Markdown table.

Example::

    python tools/results_table.py tools/results/bench-4gpu-fast.json tools/results/bench-2gpu-fast.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The ratio that says whether a case meets its goal, per case family.
GOAL_RATIO = {
    "averaging": ("dcomm/raw", "≤ 1.05"),
    "ddp/allreduce": ("dcomm/builtin", "≤ 1.00"),
    "ddp/fp16": ("dcomm/builtin", "≤ 1.00"),
    "ddp/bf16": ("dcomm/builtin", "≤ 1.00"),
    "zero/": ("dcomm/plain", "≤ 0.90"),
    "fsdp/": ("dcomm/default", "≤ torch"),
    "fully_shard/": ("dcomm/default", "≤ torch"),
    "post-local-sgd/": ("dcomm/ddp", "≤ torch"),
}


def goal(case: str, details: dict) -> str:
    for prefix, (key, target) in GOAL_RATIO.items():
        if case.startswith(prefix) and key in details:
            return f"{key} {details[key]} (goal {target})"
    return ""


def mib(side: dict) -> str:
    extra = side.get("peak_extra_bytes")
    return "n/a" if extra is None else f"{extra / 2**20:.0f}"


def rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    setup = f"{data['world_size']}x {data['device']}, {data['link']}"
    out = []
    for case in data["cases"]:
        dcomm, torch_ = case.get("dcomm") or {}, case.get("torch") or {}
        d_ms = None if dcomm.get("median_ms") is None else round(dcomm["median_ms"], 2)
        t_ms = None if torch_.get("median_ms") is None else round(torch_["median_ms"], 2)
        ratio = case.get("ratio_dcomm_torch")
        out.append(
            f"| {setup} | {case['case']} | {d_ms if d_ms is not None else dcomm.get('error', '')} "
            f"| {t_ms if t_ms is not None else torch_.get('error', '')[:40]} | {ratio if ratio is not None else ''} "
            f"| {mib(dcomm)} | {mib(torch_)} | {goal(case['case'], case.get('details', {}))} |"
        )
    return out


def main(paths: list[str]) -> int:
    print("| GPUs, link | case | dcomm ms | torch ms | dcomm/torch | dcomm extra MiB | torch extra MiB | goal ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        print("\n".join(rows(Path(path))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
