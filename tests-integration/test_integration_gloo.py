"""The integration scenarios on 2 and 4 gloo ranks (CI); NCCL runs them through run.py."""

from __future__ import annotations

import pytest
from harness import load_all

from dcomm_testing import run_ranks

CASES = [
    pytest.param(sc, world, id=f"{sc.name}-w{world}")
    for sc in load_all()
    for world in (2, 4)
    if sc.runs_at(world, "gloo")
]


@pytest.mark.parametrize(("sc", "world"), CASES)
def test_scenario_on_gloo(sc, world: int) -> None:
    run_ranks(sc.fn, world, timeout=300)
