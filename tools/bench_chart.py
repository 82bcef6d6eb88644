"""Draw benchmark JSON as a PNG: dcomm/torch and dcomm/reference ratios with their 95% intervals.

One figure per input file stacked vertically: the left panel shows dcomm over torch's
counterpart, the right one dcomm over the case's reference (built-in allreduce, non-overlapped
ZeRO, raw allreduce, FSDP's default). Each row is one case row on one workload (colour), one
marker per precision; left of the dashed line at 1.0 dcomm is faster. Ratios beyond 0.25-2.0 are
drawn at the edge. Needs matplotlib.

Example::

    python -m tools.bench_chart tools/results/bench-4gpu-h200-zero.json --out bench.png
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tools.bench_results import Ratio, ResultRow, load, rows_of, setup_of

__all__ = ["chart_points", "main", "write_chart"]

PRECISION_MARKERS = {"fp32": "o", "tf32": "s", "bf16-autocast": "D", "-": "o"}
WORKLOAD_COLORS = {
    "mlp-wide": "tab:blue",
    "mlp-deep": "tab:orange",
    "transformer": "tab:green",
    "cnn": "tab:red",
    "gpt-deep": "tab:purple",
    "llama": "tab:brown",
    "-": "tab:gray",
}


Point = tuple[str, str, str, Ratio]
"""(row title, workload, precision, ratio)."""

X_LIMITS = (0.25, 2.0)
"""Ratios outside are drawn at the edge (the interval is clipped)."""


def chart_points(rows: list[ResultRow], kind: str) -> list[Point]:
    """A point for every measured ratio of ``kind`` (``torch`` or ``reference``), in row order."""
    points = []
    for row in rows:
        ratios = [row.vs_torch] if kind == "torch" else row.vs_reference
        for ratio in ratios:
            if ratio is None or ratio.ratio is None:
                continue
            title = row.label if row.workload == "-" else f"{row.label} · {row.workload}"
            if kind == "reference":
                title += f" (vs {ratio.b})"
            points.append((title, row.workload, row.precision, ratio))
    return points


def _clip(value: float) -> float:
    return min(max(value, X_LIMITS[0]), X_LIMITS[1])


def _panel(axis: Any, points: list[Point], xlabel: str) -> None:
    titles = list(dict.fromkeys(point[0] for point in points))
    workloads = list(dict.fromkeys(point[1] for point in points))
    precisions = list(dict.fromkeys(point[2] for point in points))
    offsets = {p: (i - (len(precisions) - 1) / 2) * 0.22 for i, p in enumerate(precisions)}
    for title, workload, precision, ratio in points:
        y = titles.index(title) + offsets[precision]
        middle = _clip(ratio.ratio)
        low = _clip(ratio.low if ratio.low is not None else ratio.ratio)
        high = _clip(ratio.high if ratio.high is not None else ratio.ratio)
        axis.errorbar(
            middle,
            y,
            xerr=[[middle - low], [high - middle]],
            fmt=PRECISION_MARKERS.get(precision, "o"),
            color=WORKLOAD_COLORS.get(workload, "black"),
            markersize=4,
            capsize=2,
            linewidth=1,
        )
    axis.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    axis.set_xlim(X_LIMITS[0] - 0.02, X_LIMITS[1] + 0.02)
    axis.set_yticks(range(len(titles)), titles, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel(xlabel)
    axis.grid(axis="x", alpha=0.3)
    for precision in precisions:
        if precision != "-":
            axis.plot([], [], PRECISION_MARKERS.get(precision, "o"), color="gray", label=precision)
    for workload in workloads:
        if workload != "-":
            axis.plot([], [], "-", linewidth=3, color=WORKLOAD_COLORS.get(workload, "black"), label=workload)
    if points:
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def write_chart(runs: list[dict[str, Any]], out: str) -> None:
    """One PNG at ``out`` with a pair of panels per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(run, rows_of(run)) for run in runs]
    heights = [max(len(chart_points(rows, "torch")), len(chart_points(rows, "reference")), 3) + 4 for _, rows in panels]
    figure, axes = plt.subplots(len(panels), 2, figsize=(14, 0.17 * sum(heights)), squeeze=False, height_ratios=heights)
    for (run, rows), (left, right) in zip(panels, axes, strict=True):
        _panel(left, chart_points(rows, "torch"), "dcomm / torch (median per-round ratio, 95% interval)")
        _panel(right, chart_points(rows, "reference"), "dcomm / reference")
        left.set_title(setup_of(run), fontsize=9, loc="left")
    figure.tight_layout()
    figure.savefig(out, dpi=130)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("json", nargs="+", help="benchmark JSON files (python -m tools.bench --json)")
    parser.add_argument("--out", default="bench.png", help="PNG to write")
    args = parser.parse_args(argv)
    write_chart([load(path) for path in args.json], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
