"""Draw ``tools.bench.diloco_overlap`` JSON as a PNG: each setting's worst sync step over a plain step.

One panel per input file (a device and world size). Each setting is a row with three views of
the same steps, each a median with its 95% interval: the rank that waited least (the sync's own
cost), the slowest rank's own steps (the job's pace) and each step's slowest rank (an upper
bound that charges every straggler's wait to the sync). The dashed line at 1.10 is issue 16's
goal for ``F >= 2`` and ``tau >= 1``. Needs matplotlib.

Example::

    python -m tools.bench.diloco_chart diloco-overlap.json --out diloco.png
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["VIEWS", "chart_rows", "main", "write_chart"]

GOAL = 1.10
VIEWS = (
    ("least waiting rank view", "rank that waited least", "tab:green", "o"),
    ("slowest rank view", "slowest rank's own steps", "tab:blue", "s"),
    ("", "each step's slowest rank", "tab:gray", "D"),
)
"""(key in a setting's result, '' for the top level; legend label; colour; marker)."""

Row = tuple[str, list[tuple[str, float, float, float]]]
"""(setting label with its transfer estimate, [(view label, ratio, low, high)])."""


def chart_rows(run: dict[str, Any]) -> list[Row]:
    """The settings of one ``diloco_overlap`` JSON that have a sync/plain ratio, in run order.

    Example::

        >>> result = {"sync/plain": 1.2, "sync/plain 95%": [1.1, 1.3], "transfer steps (estimate)": 0.5}
        >>> chart_rows({"results": {"F2 tau1 int8 H20": result}})
        [('F2 tau1 int8 H20 (transfer ~0.5 steps)', [("each step's slowest rank", 1.2, 1.1, 1.3)])]
    """
    rows = []
    for label, result in run.get("results", {}).items():
        views = []
        for key, name, _, _ in VIEWS:
            view = result.get(key, {}) if key else result
            if "sync/plain" in view:
                low, high = view["sync/plain 95%"]
                views.append((name, view["sync/plain"], low, high))
        if views:
            transfer = result.get("transfer steps (estimate)")
            rows.append((label + (f" (transfer ~{transfer:g} steps)" if transfer is not None else ""), views))
    return rows


def _title(run: dict[str, Any]) -> str:
    workload = run.get("workload", {})
    return (
        f"{run.get('device', '?')} x{run.get('world_size', '?')}, {run.get('link', '?')} link, "
        f"{workload.get('name', '?')} batch {workload.get('batch', '?')}, {run.get('precision', '?')}, "
        f"torch {run.get('torch', '?')}, {str(run.get('date', '?'))[:16]}"
    )


def write_chart(runs: list[dict[str, Any]], out: str) -> None:
    """One PNG at ``out`` with a panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(run, chart_rows(run)) for run in runs]
    heights = [max(len(rows), 2) + 2 for _, rows in panels]
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 0.42 * sum(heights)), squeeze=False, height_ratios=heights)
    colors = {name: (color, marker) for _, name, color, marker in VIEWS}
    for (run, rows), (axis,) in zip(panels, axes, strict=True):
        for y, (_, views) in enumerate(rows):
            for i, (name, ratio, low, high) in enumerate(views):
                color, marker = colors[name]
                axis.errorbar(
                    ratio,
                    y + (i - 1) * 0.22,
                    xerr=[[ratio - low], [high - ratio]],
                    fmt=marker,
                    color=color,
                    markersize=4,
                    capsize=2,
                    label=name if y == 0 else None,
                )
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.axvline(GOAL, color="tab:red", linestyle="--", linewidth=0.8, label=f"goal {GOAL:.2f}")
        axis.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("worst sync step kind / plain step (median, 95% interval)")
        axis.set_title(_title(run), fontsize=9, loc="left")
        axis.grid(axis="x", alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(out, dpi=130)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("json", nargs="+", help="python -m tools.bench.diloco_overlap --json files")
    parser.add_argument("--out", default="diloco-overlap.png", help="PNG to write")
    args = parser.parse_args(argv)
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    write_chart(runs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
