"""The benchmarks page is what the kept results give, and tools/results/ keeps only what the docs show."""

from __future__ import annotations

from tools import bench_page


def test_the_page_is_generated_from_the_kept_results() -> None:
    assert bench_page.PAGE.read_text() == bench_page.render(), (
        "docs/benchmarks.md is stale: run python -m tools.bench_page"
    )
    for section in bench_page.SECTIONS:
        assert (bench_page.IMAGES / section.chart).is_file(), f"{section.chart} missing: run python -m tools.bench_page"


def test_results_hold_only_what_the_docs_show() -> None:
    shown = {section.file for section in bench_page.SECTIONS} | {bench_page.DEMO}
    kept = {path.name for path in bench_page.RESULTS.iterdir()}
    assert shown <= kept, f"the page reads files that are gone: {sorted(shown - kept)}"
    unshown = sorted(kept - shown - {bench_page.DEMO.replace(".json", ".md")})
    assert not unshown, f"tools/results/ holds files no page shows: {unshown}; git rm them (history keeps them)"


def test_the_demo_table_compares_each_run_with_the_first() -> None:
    report = {
        "runs": [
            {
                "algorithm": "DDP",
                "impl": "torch",
                "error": "",
                "skipped": "",
                "val_loss": [5.0, 2.0],
                "steps": [0, 10],
                "bytes_sent": [0.0, 10 * 2**20],
            },
            {
                "algorithm": "int8",
                "impl": "dcomm",
                "error": "",
                "skipped": "",
                "val_loss": [5.0, 2.02],
                "steps": [0, 10],
                "bytes_sent": [0.0, 2.5 * 2**20],
            },
            {
                "algorithm": "broken",
                "impl": "dcomm",
                "error": "boom",
                "skipped": "",
                "val_loss": [],
                "steps": [],
                "bytes_sent": [],
            },
        ]
    }
    lines = bench_page.demo_table(report).splitlines()
    assert lines[2] == "| DDP | torch | 2.0000 | +0.00% | 1.0 MiB |"
    assert lines[3] == "| int8 | dcomm | 2.0200 | +1.00% | 0.2 MiB |"
    assert len(lines) == 4
