"""The printed table of a run: one line per compared pair, each variant's error below its case.

Example::

    >>> print("\\n".join(table_lines(results)))  # doctest: +SKIP
    workload     precision  row        a            b         a ms    b ms    a/b    95% interval   ...
"""

from __future__ import annotations

from tools.bench.ab import CaseResult, VariantResult

__all__ = ["format_interval", "table_lines"]

HEADER = ("workload", "precision", "row", "a", "b", "a ms", "b ms", "a/b", "95% interval", "a MiB", "b MiB", "faster")


def _ms(result: VariantResult | None) -> str:
    median = None if result is None else result.median_s
    return "-" if median is None else f"{median * 1e3:.3f}"


def _mib(result: VariantResult | None) -> str:
    if result is None or result.error:
        return "-"
    return "n/a" if result.peak_extra_bytes is None else f"{result.peak_extra_bytes / 2**20:.1f}"


def format_interval(low: float | None, high: float | None) -> str:
    return "-" if low is None or high is None else f"{low:.3f}-{high:.3f}"


def table_lines(results: list[CaseResult]) -> list[str]:
    """An aligned table of every pair; errors and skipped variants on indented lines after their case."""
    cells: list[tuple[str, ...]] = [HEADER]
    notes: dict[int, list[str]] = {}
    for result in results:
        for pair in result.pairs:
            a, b = result.variants.get(pair.pair.a), result.variants.get(pair.pair.b)
            ratio = "-" if pair.ratio is None else f"{pair.ratio:.3f}"
            faster = f"{pair.faster_rounds}/{pair.rounds}" if pair.rounds else "-"
            cells.append(
                (
                    result.workload,
                    result.precision,
                    pair.pair.label,
                    pair.pair.a,
                    pair.pair.b,
                    _ms(a),
                    _ms(b),
                    ratio,
                    format_interval(pair.low, pair.high),
                    _mib(a),
                    _mib(b),
                    faster,
                )
            )
        errors = [f"    {name}: {v.error}" for name, v in result.variants.items() if v.error]
        details = {f"{name} {key}": value for name, v in result.variants.items() for key, value in v.details.items()}
        extra = {**result.details, **details}
        if extra:
            errors.insert(0, "    " + "  ".join(f"{key}={value}" for key, value in extra.items()))
        notes[len(cells) - 1] = errors
    widths = [max(len(line[col]) for line in cells) for col in range(len(HEADER))]
    lines = []
    for index, line in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("-" * len(lines[0]))
        lines.extend(notes.get(index, []))
    return lines
