"""Every script in examples/ runs as written on 2 gloo ranks, as ``torchrun --nproc-per-node 2`` runs it.

The ranks start from the README runner's fork server (conftest.py), which has imported torch
once, so each example costs seconds. PowerSGD's resume is checked against a run that never
stopped: the restored state keeps counting where the stopped run left it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_block

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(path.name for path in EXAMPLES.glob("*.py"))


def run_example(name: str, *args: str) -> None:
    path = EXAMPLES / name
    run_block(path.read_text(), str(path), 2, argv=[str(path), *args])


def test_there_is_an_example_per_algorithm() -> None:
    assert len(SCRIPTS) >= 7, SCRIPTS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name in SCRIPTS if name != "powersgd_resume.py"])
def test_example_runs(name: str) -> None:
    run_example(name, "--steps", "12")


@pytest.mark.timeout(300)
def test_powersgd_resumes_where_it_stopped(tmp_path: Path) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_example("powersgd_resume.py", "--steps", "12", "--checkpoint-dir", str(whole))
    run_example("powersgd_resume.py", "--steps", "12", "--stop-after", "7", "--checkpoint-dir", str(resumed))
    assert torch.load(resumed / "rank0.pt", weights_only=False)["step"] == 7
    run_example("powersgd_resume.py", "--steps", "12", "--checkpoint-dir", str(resumed))
    for rank in (0, 1):
        a = torch.load(whole / f"rank{rank}.pt", weights_only=False)
        b = torch.load(resumed / f"rank{rank}.pt", weights_only=False)
        assert a["step"] == b["step"] == 12
        # The PowerSGD state continued (a fresh one would count 5 iterations and 5 steps' elements).
        for key in ("iter", "total_numel_before_compression", "total_numel_after_compression"):
            assert b["powersgd"][key] == a["powersgd"][key], (rank, key, b["powersgd"][key], a["powersgd"][key])
