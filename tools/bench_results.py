"""Reading benchmark JSON (from ``python -m tools.bench --json``): one line per row and workload.

A row (``ddp/fp16`` on ``transformer`` in ``bf16-autocast``) has a dcomm/torch ratio and one or
more dcomm/reference ratios, each with its 95% interval; :func:`rows_of` collects them, for
the chart (:mod:`tools.bench_chart`) and the Markdown table (:mod:`tools.bench_table`).

Runs of one setup (device, world size, backend, link, torch) kept in one file: :func:`merge`
puts several runs' cases under one header, as ``python -m tools.bench_results merge``.

Example::

    >>> rows = rows_of(json.load(open("bench-4gpu-fast.json")))  # doctest: +SKIP
    >>> rows[0].label, rows[0].vs_torch.ratio  # doctest: +SKIP
    ('averaging', 0.98)

    python -m tools.bench_results merge tools/results/bench-2gpu-h200.json ddp.json averaging.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SETUP", "Ratio", "ResultRow", "load", "main", "merge", "rows_of", "setup_of"]

SETUP = ("device", "world_size", "backend", "link", "torch", "size")
"""What runs must share to be merged into one file."""


@dataclass(frozen=True)
class Ratio:
    """``a`` over ``b``: the median per-round ratio and its 95% interval (None when not measured)."""

    a: str
    b: str
    ratio: float | None
    low: float | None
    high: float | None
    error: str = ""


@dataclass
class ResultRow:
    """One row of one case on one workload and precision."""

    label: str
    workload: str
    precision: str
    vs_torch: Ratio | None = None
    vs_reference: list[Ratio] = field(default_factory=list)
    milliseconds: dict[str, float | None] = field(default_factory=dict)
    extra_mib: dict[str, float | None] = field(default_factory=dict)


def load(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def setup_of(run: dict[str, Any]) -> str:
    """``4x NVIDIA H100 80GB HBM3, fast link, torch 2.11.0, 2026-11-26 07:00 UTC``: runs of a day apart.

    A run that names the dcomm code it measured (``"code"``, e.g. in an A/B of two commits) ends
    with it: ``..., 07:00 UTC, dcomm 31cb92c``.
    """
    when = run["date"][:16].replace("T", " ")
    setup = f"{run['world_size']}x {run['device']}, {run['link']} link, torch {run['torch']}, {when} UTC"
    return f"{setup}, dcomm {run['code']}" if run.get("code") else setup


def _ratio(pair: dict[str, Any]) -> Ratio:
    return Ratio(pair["a"], pair["b"], pair.get("ratio"), pair.get("low"), pair.get("high"), pair.get("error", ""))


def rows_of(run: dict[str, Any]) -> list[ResultRow]:
    """Every row of a run, in run order (torch/reference pairs only fill in the torch side's times)."""
    rows: dict[tuple[str, str, str], ResultRow] = {}
    for case in run["results"]:
        variants = case["variants"]
        for pair in case["pairs"]:
            key = (pair["label"], case["workload"], case["precision"])
            row = rows.setdefault(key, ResultRow(*key))
            if pair["kind"] == "dcomm/torch":
                row.vs_torch = _ratio(pair)
            elif pair["kind"] in ("dcomm/reference", "A/A"):  # an A/A row: a variant over its own copy
                row.vs_reference.append(_ratio(pair))
            for name in (pair["a"], pair["b"]):
                variant = variants.get(name, {})
                row.milliseconds[name] = variant.get("median_ms")
                extra = variant.get("peak_extra_bytes")
                row.extra_mib[name] = None if extra is None else round(extra / 2**20, 1)
    return list(rows.values())


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    return {"date": run["date"], "policy": run.get("policy"), "cases": len(run["results"])}


def merge(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run holding the cases of ``runs`` (same :data:`SETUP`, else ValueError), in their order.

    The header is the earliest run's, with the workloads and precisions of all; ``"runs"`` keeps
    each input's date, policy and number of cases (a merged input's own ``"runs"``). A case
    (case, workload, precision) in two runs is a ValueError: rows would overwrite each other.
    """
    if not runs:
        raise ValueError("no runs to merge")
    first = runs[0]
    for run in runs[1:]:
        differ = [f"{key} {run.get(key)!r} != {first.get(key)!r}" for key in SETUP if run.get(key) != first.get(key)]
        if differ:
            raise ValueError(f"runs of different setups: {', '.join(differ)}")
    results = [case for run in runs for case in run["results"]]
    keys = [(case["case"], case["workload"], case["precision"]) for case in results]
    if len(set(keys)) < len(keys):
        twice = sorted({" ".join(key) for key in keys if keys.count(key) > 1})
        raise ValueError(f"cases in more than one run: {', '.join(twice)}")
    merged = {key: value for key, value in min(runs, key=lambda run: run["date"]).items() if key != "policy"}
    merged["workloads"] = {name: spec for run in runs for name, spec in run["workloads"].items()}
    merged["precisions"] = list(dict.fromkeys(p for run in runs for p in run["precisions"]))
    merged["runs"] = [entry for run in runs for entry in run.get("runs") or [_summary(run)]]
    merged["results"] = results
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Merge benchmark JSON files of one setup into one.")
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="write OUT with the cases of every IN (same setup)")
    merging.add_argument("out", help="the merged JSON file to write")
    merging.add_argument("inputs", nargs="+", help="JSON files from python -m tools.bench --json")
    args = parser.parse_args(argv)
    try:
        merged = merge([load(path) for path in args.inputs])
    except ValueError as exc:
        parser.error(str(exc))
    Path(args.out).write_text(json.dumps(merged, indent=2) + "\n")
    print(f"{args.out}: {len(merged['results'])} cases from {len(args.inputs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
