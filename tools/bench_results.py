"""Reading benchmark JSON (from ``python -m tools.bench --json``): one line per row and workload.

A row (``ddp/fp16`` on ``transformer`` in ``bf16-autocast``) has a dcomm/torch ratio and one or
more dcomm/reference ratios, each with its 95% interval; :func:`rows_of` collects them, for
the chart (:mod:`tools.bench_chart`) and the Markdown table (:mod:`tools.bench_table`).

Example::

    >>> rows = rows_of(json.load(open("bench-4gpu-fast.json")))  # doctest: +SKIP
    >>> rows[0].label, rows[0].vs_torch.ratio  # doctest: +SKIP
    ('averaging', 0.98)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Ratio", "ResultRow", "load", "rows_of", "setup_of"]


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
