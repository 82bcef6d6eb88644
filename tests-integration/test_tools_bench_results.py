"""Merging benchmark runs of one setup into one file: their cases in order, a different setup refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools import bench_results


def run(date: str, cases: list[tuple[str, str, str]], link: str = "fast", **extra: Any) -> dict[str, Any]:
    pair = {"label": "x", "a": "dcomm", "b": "torch", "kind": "dcomm/torch", "ratio": 0.9, "low": 0.8, "high": 1.0}
    return {
        "date": date,
        "device": "NVIDIA H200",
        "world_size": 2,
        "backend": "nccl",
        "link": link,
        "torch": "2.11.0",
        "size": "large",
        "workloads": {workload: {"name": workload} for _, workload, _ in cases},
        "precisions": sorted({precision for *_, precision in cases if precision != "-"}),
        "policy": {"budget_s": 5.0},
        "results": [
            {"case": case, "workload": workload, "precision": precision, "variants": {}, "pairs": [pair]}
            for case, workload, precision in cases
        ],
        **extra,
    }


def test_merge_keeps_every_case_in_order_under_the_earliest_header() -> None:
    ddp = run("2026-11-29T13:33:10+00:00", [("ddp", "llama", "tf32"), ("ddp", "llama", "bf16-autocast")])
    averaging = run("2026-11-29T13:23:59+00:00", [("averaging", "cnn", "-")])
    merged = bench_results.merge([ddp, averaging])
    assert [(c["case"], c["precision"]) for c in merged["results"]] == [
        ("ddp", "tf32"),
        ("ddp", "bf16-autocast"),
        ("averaging", "-"),
    ]
    assert merged["date"] == "2026-11-29T13:23:59+00:00"
    assert list(merged["workloads"]) == ["llama", "cnn"]
    assert merged["precisions"] == ["bf16-autocast", "tf32"]
    assert "policy" not in merged
    assert [(r["date"][11:16], r["cases"]) for r in merged["runs"]] == [("13:33", 2), ("13:23", 1)]
    assert bench_results.setup_of(merged) == "2x NVIDIA H200, fast link, torch 2.11.0, 2026-11-29 13:23 UTC"
    assert len(bench_results.rows_of(merged)) == 3


def test_merging_a_merged_file_keeps_its_runs() -> None:
    first = bench_results.merge([run("2026-11-29T10:00:00+00:00", [("ddp", "llama", "tf32")])])
    second = run("2026-11-29T11:00:00+00:00", [("zero", "llama", "tf32")])
    merged = bench_results.merge([first, second])
    assert [r["date"][11:13] for r in merged["runs"]] == ["10", "11"]


def test_merge_refuses_other_setups_and_cases_measured_twice() -> None:
    fast = run("2026-11-29T10:00:00+00:00", [("ddp", "llama", "tf32")])
    with pytest.raises(ValueError, match="link 'slow' != 'fast'"):
        bench_results.merge([fast, run("2026-11-29T11:00:00+00:00", [("zero", "llama", "tf32")], link="slow")])
    with pytest.raises(ValueError, match="ddp llama tf32"):
        bench_results.merge([fast, run("2026-11-29T11:00:00+00:00", [("ddp", "llama", "tf32")])])
    with pytest.raises(ValueError, match="no runs"):
        bench_results.merge([])


def test_the_merge_command_writes_the_merged_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs = []
    for index, case in enumerate(["ddp", "zero"]):
        path = tmp_path / f"{case}.json"
        path.write_text(json.dumps(run(f"2026-11-29T1{index}:00:00+00:00", [(case, "llama", "tf32")])))
        inputs.append(str(path))
    out = tmp_path / "merged.json"
    assert bench_results.main(["merge", str(out), *inputs]) == 0
    assert [c["case"] for c in bench_results.load(out)["results"]] == ["ddp", "zero"]
    assert "2 cases from 2 runs" in capsys.readouterr().out
