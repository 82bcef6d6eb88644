"""Render benchmark JSON (from ``python -m tools.bench --json``) as Markdown tables for the README.

One table per file, headed by its setup (GPUs, device, link, torch, date). Each row gives the
dcomm/torch ratio and the dcomm/reference ratios with their 95% intervals, the median step
times and the peak extra memory of dcomm's and torch's variants.

Example::

    python -m tools.bench_table tools/results/bench-4gpu-h200-zero.json tools/results/bench-4gpu-h200-averaging.json
"""

from __future__ import annotations

import argparse
import sys

from tools.bench_results import Ratio, ResultRow, load, rows_of, setup_of

__all__ = ["format_ratio", "main", "table"]

HEADER = (
    "| row | workload | precision | dcomm/torch | dcomm/reference | dcomm ms | torch ms | dcomm MiB | torch MiB |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def format_ratio(ratio: Ratio | None, name_reference: bool = False) -> str:
    """``0.98 (0.97-0.99)``, with ``vs <reference>`` when asked; the error's first words when unmeasured."""
    if ratio is None:
        return ""
    if ratio.ratio is None:
        return "n/a: " + ratio.error.split(": ")[-1][:40] if ratio.error else "n/a"
    text = f"{ratio.ratio:.2f} ({ratio.low:.2f}-{ratio.high:.2f})"
    return f"{text} vs {ratio.b}" if name_reference else text


def _cell(values: dict[str, float | None], name: str | None, digits: int) -> str:
    value = values.get(name) if name else None
    return "" if value is None else f"{value:.{digits}f}"


def line(row: ResultRow) -> str:
    dcomm = row.vs_torch.a if row.vs_torch else (row.vs_reference[0].a if row.vs_reference else None)
    torch_ = row.vs_torch.b if row.vs_torch else None
    references = "<br>".join(format_ratio(r, name_reference=True) for r in row.vs_reference)
    cells = [
        row.label,
        row.workload,
        row.precision,
        format_ratio(row.vs_torch),
        references,
        _cell(row.milliseconds, dcomm, 2),
        _cell(row.milliseconds, torch_, 2),
        _cell(row.extra_mib, dcomm, 0),
        _cell(row.extra_mib, torch_, 0),
    ]
    return "| " + " | ".join(cells) + " |"


def table(run: dict) -> str:
    rows = [line(row) for row in rows_of(run) if row.vs_torch or row.vs_reference]
    return "\n".join([f"**{setup_of(run)}**", "", HEADER, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("json", nargs="+", help="benchmark JSON files")
    args = parser.parse_args(argv)
    print("\n\n".join(table(load(path)) for path in args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
