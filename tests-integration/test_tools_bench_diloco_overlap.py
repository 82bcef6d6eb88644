"""``python -m tools.bench.diloco_overlap`` end to end on 2 gloo ranks (small transformer, few steps), and its pieces.

No timing is asserted: the run must find every kind of sync step, count the bytes, and write the
JSON the lead reads.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tools.bench.diloco_chart import chart_rows, write_chart
from tools.bench.diloco_overlap import (
    Run,
    Setting,
    least_waiting_view,
    parse_setting,
    slowest_rank_view,
    step_kinds,
    summarize,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_gloo_ranks_find_every_sync_step_kind_and_write_the_json(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "overlap.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "tools.bench.diloco_overlap", "--sync-every", "8", "--steps", "8", "--json", str(out)]
    command += ["--settings", "2:1", "2:2:int8", "1:8", "4:1", "--batch", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "a fragment every H/F = 4 steps, tau < H" in proc.stdout
    run = json.loads(out.read_text())
    assert (run["device"], run["world_size"], run["backend"], run["link"]) == ("cpu", 2, "gloo", "fast")
    assert (run["workload"]["size"], run["precision"], run["nccl"]) == ("small", "fp32", None)
    assert (run["workload"]["name"], run["workload"]["batch"]) == ("transformer", 3)
    assert run["torch"]
    assert run["date"]
    assert run["link_env"]["NCCL_NVLS_ENABLE"] == "0"  # tools.launch turns multicast off
    assert run["baseline"]["before"]["plain steps"] == 8
    results = run["results"]
    assert set(results) == {"F2 tau1 fp32 H8", "F2 tau2 int8 H8", "F1 tau8 fp32 H8", "F4 tau1 fp32 H8"}
    assert results["F1 tau8 fp32 H8"] == {"error": "skipped: tau=8 is not below H=8"}
    # A fragment every 2 steps, applied 1 step later: every step syncs, and no view has a plain step to divide by.
    every_step = results.pop("F4 tau1 fp32 H8")
    assert (every_step["plain steps"], every_step["plain ms"]) == (0, None)
    assert {kind: k["count"] for kind, k in every_step["kinds"].items()} == {"launch": 4, "apply": 4}
    assert every_step["least waiting rank view"] == {}
    assert "sync/plain" not in every_step
    assert "sync/plain" not in every_step["slowest rank view"]
    # Offsets 4 and 0 of 8: launches at steps 4 and 8, applied tau later; int8 advances between.
    expected = {
        "F2 tau1 fp32 H8": {"launch": 2, "apply": 2},
        "F2 tau2 int8 H8": {"launch": 2, "advance": 2, "apply": 2},
    }
    for label, kinds in expected.items():
        result = results[label]
        assert {kind: k["count"] for kind, k in result["kinds"].items()} == kinds, label
        assert result["plain steps"] == 8 - sum(kinds.values()), label
        assert result["worst kind"] in kinds, label
        low, high = result["sync/plain 95%"]
        assert 0 < low <= result["sync/plain"] <= high, label
        assert result["throughput ratio"] > 0, label
        assert result["slowest rank"] in (0, 1), label
        assert len(result["rank totals ms"]) == 2, label
        assert result["bytes/inner step"] > 0, label
        view = result["slowest rank view"]
        assert view["rank"] == result["slowest rank"], label
        assert view["worst kind"] in kinds, label
        low, high = view["sync/plain 95%"]
        assert 0 < low <= view["sync/plain"] <= high, label
        assert view["throughput ratio"] > 0, label
        assert view["run/own plain"] > 0, label
        least = result["least waiting rank view"]
        assert least["worst kind"] in kinds, label
        low, high = least["sync/plain 95%"]
        assert 0 < low <= least["sync/plain"] <= high, label
        assert [len(times) for times in result["rank step ms"]] == [8, 8], label
    fp32, int8 = (results[label]["bytes/inner step"] for label in expected)
    assert fp32 / 5 < int8 < fp32 / 3  # int8 codes plus scales: about a quarter of fp32's bytes
    # The chart: a row per setting with a ratio (not the skipped one, nor the one without plain steps).
    rows = chart_rows(json.loads(out.read_text()))
    assert [label.split(" (")[0] for label, _ in rows] == list(expected)
    assert all(len(views) == 3 for _, views in rows)
    write_chart([run, run], str(tmp_path / "overlap.png"))
    assert (tmp_path / "overlap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_settings_parse_with_their_defaults_and_reject_bad_text() -> None:
    assert parse_setting("2:9", 20) == Setting(2, 9, None, 20)
    assert parse_setting("4:4:int4:50", 20) == Setting(4, 4, "int4", 50)
    assert parse_setting("1:0:none", 8).label == "F1 tau0 fp32 H8"
    assert Setting(2, 20, None, 20).problem() == "tau=20 is not below H=20"
    for text, reason in (("4", "F:tau"), ("4:1:zip", "compression"), ("a:1", "whole numbers"), ("0:1", "F >= 1")):
        with pytest.raises(ValueError, match=reason):
            parse_setting(text, 20)


def test_step_kinds_follow_the_schedule_of_launches() -> None:
    # F=4, H=20, tau=4 with int8: launches every 5 steps; advance 2 steps and apply 4 steps after each.
    kinds = step_kinds([5, 10, 15, 20], Setting(4, 4, "int8", 20), 21)
    assert kinds[4:10] == ["launch", "plain", "advance", "plain", "apply", "launch"]
    assert kinds[20] == "plain"  # step 21: nothing launched at 20 is due yet
    on_nccl = step_kinds([5, 10, 15, 20], Setting(4, 4, "int8", 20), 21, advance_midway=False)
    assert on_nccl == [kind.replace("advance", "plain") for kind in kinds]  # queued at the launch
    # tau=0: the launch and the apply are the same step; fp32 never advances.
    assert step_kinds([3], Setting(1, 0, None, 3), 3) == ["plain", "plain", "apply+launch"]
    assert "advance" not in step_kinds([1], Setting(1, 4, None, 8), 8)
    # A launch in the warm-up (before the list starts) still marks its apply in the timed steps.
    assert step_kinds([2], Setting(2, 3, None, 4), 6)[4] == "apply"


def test_summary_medians_and_the_worst_kind_over_plain() -> None:
    times = [1.0, 3.0, 1.0, 2.0, 1.0, 2.0]
    kinds = ["plain", "launch", "plain", "apply", "plain", "apply"]
    out = summarize(times, kinds, baseline_s=0.5)
    assert (out["plain ms"], out["plain steps"]) == (1000.0, 3)
    assert out["kinds"] == {"launch": {"median ms": 3000.0, "count": 1}, "apply": {"median ms": 2000.0, "count": 2}}
    assert (out["worst kind"], out["sync/plain"]) == ("launch", 3.0)
    assert out["sync/plain 95%"] == [3.0, 3.0]  # every resample of one launch and three equal plain steps
    assert out["slowest sync step/plain"] == 3.0
    assert out["throughput ratio"] == round(10.0 / (6 * 0.5), 4)
    assert "worst kind" not in summarize([1.0], ["plain"], None)


def test_the_slowest_rank_view_leaves_out_a_faster_rank_waiting_at_its_apply() -> None:
    # Rank 0 is faster (0.9 per plain step) and waits 0.5 at its apply for rank 1 to launch the sync;
    # rank 1 sets the pace (1.0 per plain step, its apply costs 0.05 more) and never waits.
    kinds = ["plain", "launch", "plain", "apply", "plain"]
    run = Run([[0.9, 0.9, 0.9, 1.4, 0.9], [1.0, 1.0, 1.0, 1.05, 1.0]], kinds)
    assert run.slowest_rank == 1
    assert run.times_s == [1.0, 1.0, 1.0, 1.4, 1.0]
    assert summarize(run.times_s, kinds, 1.0)["sync/plain"] == 1.4  # each step's slowest rank: the wait shows
    view = slowest_rank_view(run, Run([[0.9] * 5, [1.0] * 5], ["plain"] * 5))
    assert (view["rank"], view["worst kind"], view["sync/plain"]) == (1, "apply", 1.05)
    assert view["throughput ratio"] == view["run/own plain"] == 1.01


def test_the_least_waiting_view_keeps_the_syncs_own_cost_whichever_rank_waits() -> None:
    # Two syncs: rank 0 waits 0.5 at the first, rank 1 at the second; each apply costs 0.05 more
    # on the rank that launched last. The slowest rank (by total) waited once; the minimum did not.
    kinds = ["plain", "apply", "plain", "apply", "plain"]
    run = Run([[1.0, 1.55, 1.0, 1.05, 1.0], [1.0, 1.05, 1.0, 1.6, 1.0]], kinds)
    assert least_waiting_view(run)["sync/plain"] == 1.05
    assert slowest_rank_view(run, Run([[1.0], [1.0]], ["plain"]))["sync/plain"] == 1.325  # median of 1.05, 1.6
