"""``dcomm.ddp._calibration.Calibration``: blocks of whole passes per path, one choice on every rank.

The times are chosen through its ``clock`` argument, so nothing here depends on the machine and
no timing is asserted.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcomm.ddp._calibration import Calibration
from dcomm_testing import run_ranks

PATHS = ("first", "second")
BLOCKS = ("first", "second", "second", "first")


def _faster(slowest: dict[str, float]) -> str:
    return min(slowest, key=lambda path: slowest[path])


def _agreement(rank: int, world: int) -> list[str]:
    """Ranks that disagree locally still choose one path: the one with the smaller slowest time."""
    chosen = []
    reports: list[tuple[str, dict[str, float]]] = []
    # Case 1: only the last rank finds "first" slow (10 s); it is the slowest, so "second" wins
    # everywhere although the other ranks time "first" faster. Case 2: the reverse. Case 3:
    # "first" leaves 5 s of its work to the next pass: 6 s per steady pass against 4 s. Timing
    # alternating passes would charge that spill to "second" (9 s against 1 s) and choose "first".
    cases = [
        ({"first": 10.0 if rank == world - 1 else 1.0, "second": 5.0}, "second", 0.0),
        ({"first": 5.0, "second": 10.0 if rank == 0 else 1.0}, "first", 0.0),
        ({"first": 1.0, "second": 4.0}, "second", 5.0),
    ]
    for durations, expected, spill in cases:
        now = [0.0]
        calibration = Calibration(
            dist.group.WORLD,
            PATHS,
            _faster,
            lambda path, slowest: reports.append((path, slowest)),
            steps=2,
            warmup=1,
            clock=lambda now=now: now[0],
        )
        paths: list[str] = []
        while calibration.chosen is None:
            path = calibration.next_path(torch.device("cpu"))
            spilled = spill if paths and paths[-1] == "first" else 0.0
            paths.append(path)
            now[0] += durations[path] + spilled  # this pass took that long on this rank
        # Blocks of 4 passes (2 timed intervals each), then the choice at the next.
        assert len(calibration) == 16
        assert paths[:-1] == [path for path in BLOCKS for _ in range(4)], paths
        assert paths[-1] == expected, (durations, paths)
        assert calibration.next_path(torch.device("cpu")) == expected
        every: list[object] = [None] * world
        dist.all_gather_object(every, expected)
        assert every == [expected] * world
        chosen.append(expected)
    if rank == 0:  # reported once, on the first rank, with the slowest rank's medians
        assert reports == [
            ("second", {"first": 10.0, "second": 5.0}),
            ("first", {"first": 5.0, "second": 10.0}),
            ("second", {"first": 6.0, "second": 4.0}),
        ], reports
    else:
        assert reports == []
    return chosen


@pytest.mark.parametrize("world", [2, 3])
def test_calibration_chooses_one_path_on_every_rank(world: int) -> None:
    assert run_ranks(_agreement, world, timeout=120) == [["second", "first", "second"]] * world
