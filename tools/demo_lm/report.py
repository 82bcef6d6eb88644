"""The end of the demo: the verdict, the final table, the charts and ``report.md``.

A dcomm run fails the demo when it raised, when its validation loss did not fall, or when it
ended more than ``tolerance`` (relative) above torch's run of the same algorithm. Runs that torch
cannot do here (its ZeRO overlap refuses gloo) and dcomm pieces not installed yet are listed
with their reason and fail nothing.

Example::

    >>> failures = verdict(results, tolerance=0.02)  # doctest: +SKIP
    >>> write_report(pathlib.Path("demo-report"), results, header, 0.02)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable
from dataclasses import asdict

from .runs import BASELINE
from .train import RunResult

__all__ = ["CHARTS", "human_bytes", "table_rows", "verdict", "write_report"]

CHARTS = {
    "loss_vs_step.png": ("steps", "training step"),
    "loss_vs_bytes.png": ("bytes_sent", "bytes sent per rank (counted, log scale)"),
    "loss_vs_time.png": ("wall_s", "training wall time (s)"),
}
"""File -> (x values of each run, x-axis label); the y axis is always the validation loss."""


def human_bytes(count: float) -> str:
    if math.isnan(count):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _counterpart(result: RunResult, results: Iterable[RunResult]) -> RunResult | None:
    return next((r for r in results if r.algorithm == result.algorithm and r.impl == "torch" and r.ok), None)


def _baseline(results: Iterable[RunResult]) -> RunResult | None:
    return next((r for r in results if r.algorithm == BASELINE and r.ok), None)


def verdict(results: list[RunResult], tolerance: float) -> list[str]:
    """Why the demo fails: one line per failing dcomm run (empty when all passed)."""
    failures = []
    for result in results:
        if result.impl != "dcomm" or result.skipped:
            continue
        name = f"{result.algorithm} [dcomm]"
        if result.error:
            failures.append(f"{name} failed: {result.error}")
        elif not result.val_loss[-1] < result.val_loss[0]:
            failures.append(
                f"{name}: validation loss did not fall ({result.val_loss[0]:.4f} -> {result.final_loss:.4f})"
            )
        elif (torch_run := _counterpart(result, results)) and result.final_loss > torch_run.final_loss * (
            1 + tolerance
        ):
            failures.append(
                f"{name}: final validation loss {result.final_loss:.4f} is more than {tolerance:.0%} above "
                f"torch's {torch_run.final_loss:.4f}"
            )
    return failures


def _relative(value: float, reference: RunResult | None) -> str:
    if reference is None or math.isnan(value):
        return ""
    return f"{(value / reference.final_loss - 1) * 100:+.2f}%"


TABLE_HEADER = ("algorithm", "impl", "val loss", "vs baseline", "vs torch", "sent/step/rank", "ms/step", "note")


def table_rows(results: list[RunResult]) -> list[tuple[str, ...]]:
    """The final table, one row per run (see :data:`TABLE_HEADER`)."""
    baseline = _baseline(results)
    rows = []
    for r in results:
        if not r.ok:
            note = (r.skipped and f"skipped: {r.skipped}") or (
                f"FAILED: {r.error}" if r.impl == "dcomm" else f"n/a: {r.error}"
            )
            rows.append((r.algorithm, r.impl, "", "", "", "", "", note))
            continue
        torch_run = _counterpart(r, results) if r.impl == "dcomm" else None
        per_step = r.bytes_sent[-1] / r.steps[-1]
        rows.append(
            (
                r.algorithm,
                r.impl,
                f"{r.val_loss[0]:.3f} -> {r.final_loss:.4f}",
                _relative(r.final_loss, baseline),
                _relative(r.final_loss, torch_run),
                human_bytes(per_step),
                f"{r.step_ms:.1f}",
                "",
            )
        )
    return rows


def plain_table(results: list[RunResult]) -> str:
    """The final table as aligned text."""
    lines = [TABLE_HEADER, *table_rows(results)]
    widths = [max(len(line[col]) for line in lines) for col in range(len(TABLE_HEADER) - 1)] + [0]
    rendered = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    rendered.insert(1, "-" * max(len(line) for line in rendered[:1]))
    return "\n".join(rendered)


def markdown_table(results: list[RunResult]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + " --- |" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def draw_charts(folder: pathlib.Path, results: list[RunResult]) -> list[str]:
    """Validation loss against step, bytes and time: a colour per algorithm, torch dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algorithms = list(dict.fromkeys(r.algorithm for r in results if r.ok))
    colours = [*plt.get_cmap("tab10").colors, *plt.get_cmap("Dark2").colors]
    written = []
    for filename, (attribute, label) in CHARTS.items():
        figure, axes = plt.subplots(figsize=(13, 6))
        for r in results:
            if not r.ok:
                continue
            xs, ys = getattr(r, attribute), r.val_loss
            if attribute == "bytes_sent":  # log scale: leave out the start (0 bytes)
                xs, ys = zip(*[(x, y) for x, y in zip(xs, ys, strict=True) if x > 0], strict=True) or ([], [])
            baseline = r.algorithm == BASELINE
            axes.plot(
                xs,
                ys,
                label=f"{r.algorithm} [{r.impl}]",
                color="black" if baseline else colours[algorithms.index(r.algorithm) % len(colours)],
                linestyle=":" if baseline else "-" if r.impl == "dcomm" else "--",
                linewidth=2.2 if baseline else 1.4,
                marker="o" if attribute == "bytes_sent" else None,
                markersize=3,
            )
        if attribute == "bytes_sent":
            axes.set_xscale("log")
        axes.set_xlabel(label)
        axes.set_ylabel("validation loss (nats per byte)")
        axes.set_title(f"validation loss vs {label.split(' (')[0]} (dcomm solid, torch dashed, baseline dotted)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        figure.tight_layout()
        figure.savefig(folder / filename, dpi=110)
        plt.close(figure)
        written.append(filename)
    return written


def write_report(
    folder: pathlib.Path, results: list[RunResult], header: dict[str, str], tolerance: float
) -> pathlib.Path:
    """Write the charts, ``report.md`` (facts, tolerance, table, charts) and ``results.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    charts = draw_charts(folder, results)
    failures = verdict(results, tolerance)
    lines = ["# dcomm demo: a byte-level language model trained with every algorithm", ""]
    lines += [f"- **{key}:** {value}" for key, value in header.items()]
    lines += [
        f"- **tolerance:** a dcomm run passes when its final validation loss is at most {tolerance:.0%} above "
        "torch's run of the same algorithm (and its loss fell); runs without a torch counterpart must "
        "run and lower the loss.",
        "- **bytes sent:** counted, not estimated: every `c10d` collective this rank called during the "
        "training steps (hooks, FSDP, the averagers and DDP's built-in C++ allreduce alike), summing the "
        "bytes of the tensors it sent (inputs; a broadcast's tensor on its root), averaged over ranks.",
        "- **wall time:** the training steps only (evaluation excluded), slowest rank.",
        "",
        "## Result",
        "",
        "All dcomm runs passed." if not failures else "Failed:\n\n" + "\n".join(f"- {f}" for f in failures),
        "",
        markdown_table(results),
        "",
        "## Charts",
        "",
    ]
    lines += [f"![{name}]({name})\n" for name in charts]
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    record = {"header": header, "tolerance": tolerance, "failures": failures, "runs": [asdict(r) for r in results]}
    (folder / "results.json").write_text(json.dumps(record, indent=1))
    return path
