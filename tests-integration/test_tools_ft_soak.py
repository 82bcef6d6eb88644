"""The CI-sized fault soak: DiLoCo on torchft, a replica SIGKILLed and restarted, no hang, all equal.

The full soak (60 syncs, a kill every 5-10 syncs) is ``python -m tools.ft_soak``; this runs 24
syncs with one kill (about 45 s on 2 cores). A hang fails by the timeout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchft")

from tools import ft_soak


@pytest.mark.timeout(240)
def test_soak_survives_a_killed_and_restarted_replica(tmp_path: Path) -> None:
    summary = ft_soak.run(tmp_path, syncs=24, kills=1)  # raises when replicas differ or a sync is missing
    assert summary["failures_survived"] == 1
    (kill,) = summary["kills"]
    assert kill["heal_s"] is not None, "the restarted replica never committed a sync"
    assert kill["rejoined_at_step"] > kill["after_sync"] * ft_soak.SYNC_EVERY
