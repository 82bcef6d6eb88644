"""Averager schedules against explicit tables and torch, state dicts, and every bad input.

Which ranks averaged at a step is read off the data: every rank holds the one-hot vector of its
rank, so after averaging over a group the nonzero entries are exactly that group's ranks.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hier

from dcomm.averaging import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from dcomm_testing import run_ranks

# step -> period of the group that averages (None: no averaging). Written out by hand from the
# rule "past warm-up, the largest period dividing the step"; periodic: (step - warmup) % period.
PERIODIC_3_WARMUP_2 = {s: (3 if s in (2, 5, 8, 11) else None) for s in range(13)}
TWO_LEVEL_WARMUP_3 = {
    0: None, 1: None, 2: None, 3: None, 4: 4, 5: None, 6: 2,
    7: None, 8: 4, 9: None, 10: 2, 11: None, 12: 4,
}  # fmt: skip
THREE_LEVEL_WARMUP_0 = {
    0: 4, 1: None, 2: 2, 3: 3, 4: 4, 5: None, 6: 3,
    7: None, 8: 4, 9: 3, 10: 2, 11: None, 12: 4,
}  # fmt: skip


def one_hot(rank: int, world: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(world, dtype=torch.float64))
    with torch.no_grad():
        p[rank] = 1.0
    p.grad = torch.zeros_like(p)
    return p


def mixed_ranks(averager: object, rank: int, world: int) -> list[int]:
    """Call ``averager`` once on the one-hot vector; return the ranks it was averaged with."""
    p = one_hot(rank, world)
    averager.average_parameters([p])  # type: ignore[attr-defined]
    return [int(r) for r in torch.nonzero(p).flatten()]


def block(rank: int, size: int) -> list[int]:
    start = rank // size * size
    return list(range(start, start + size))


def _schedules(rank: int, world: int) -> None:
    two_level = {2: world // 2, 4: world}
    three_level = {2: 1, 3: world // 2, 4: world}
    cases = [
        (PeriodicModelAverager(3, warmup_steps=2), torch_averagers.PeriodicModelAverager(3, 2), {3: world}, 2,
         PERIODIC_3_WARMUP_2),
        (HierarchicalModelAverager(two_level, warmup_steps=3), torch_hier.HierarchicalModelAverager(two_level, 3),
         two_level, 3, TWO_LEVEL_WARMUP_3),
        (HierarchicalModelAverager(three_level), torch_hier.HierarchicalModelAverager(three_level), three_level, 0,
         THREE_LEVEL_WARMUP_0),
    ]  # fmt: skip
    for ours, theirs, sizes, warmup, table in cases:
        assert ours.warmup_steps == theirs.warmup_steps == warmup
        assert ours.process_group is theirs.process_group is dist.group.WORLD
        if isinstance(ours, PeriodicModelAverager):
            assert ours.period == theirs.period == 3
        else:
            assert list(ours.period_process_group_dict) == list(theirs.period_process_group_dict)
            for period, group in ours.period_process_group_dict.items():
                torch_group = theirs.period_process_group_dict[period]
                assert dist.get_process_group_ranks(group) == dist.get_process_group_ranks(torch_group)
                assert dist.get_process_group_ranks(group) == block(rank, sizes[period])
        for step, period in table.items():
            assert ours.step == theirs.step == step
            expected = block(rank, sizes[period]) if period is not None else [rank]
            if isinstance(ours, HierarchicalModelAverager):
                group = ours.process_group_at(step)
                assert (group is None) == (period is None)
                assert group is None or group is ours.period_process_group_dict[period]
            assert mixed_ranks(ours, rank, world) == expected, (step, period)
            assert mixed_ranks(theirs, rank, world) == expected, (step, period)

    # state_dict / load_state_dict: the counter and the settings; a fresh averager resumes.
    periodic = PeriodicModelAverager(3, warmup_steps=2)
    for _ in range(5):
        periodic.average_parameters([one_hot(rank, world)])
    state = periodic.state_dict()
    assert state == {"step": 5, "period": 3, "warmup_steps": 2}
    resumed = PeriodicModelAverager(3, warmup_steps=2)
    resumed.load_state_dict(state)
    assert resumed.step == 5
    for step in range(5, 13):
        assert mixed_ranks(resumed, rank, world) == mixed_ranks(periodic, rank, world), step
    hier = HierarchicalModelAverager(three_level)
    hier.step = 7
    assert hier.state_dict() == {"step": 7, "period_group_size_dict": three_level, "warmup_steps": 0}
    other = HierarchicalModelAverager(three_level)
    other.load_state_dict(hier.state_dict())
    assert other.step == 7
    differs = r"state_dict: saved period=3 differs from this PeriodicModelAverager's period=5"
    with pytest.warns(UserWarning, match=differs):
        PeriodicModelAverager(5, warmup_steps=2).load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PeriodicModelAverager(3, warmup_steps=2).load_state_dict({"step": 4})  # torch-style: step only
    for bad, error in [
        ({}, ValueError),
        ({"step": -1}, ValueError),
        ({"step": "3"}, TypeError),
        ({"step": True}, TypeError),
        ({"step": torch.tensor(3)}, TypeError),  # the same policy as every other load_state_dict
        ([("step", 1)], TypeError),
    ]:
        for averager in (PeriodicModelAverager(3), HierarchicalModelAverager(three_level)):
            averager.step = 2
            with pytest.raises(error, match=r"^state_dict"):
                averager.load_state_dict(bad)  # type: ignore[arg-type]
            assert averager.step == 2  # a rejected load changes nothing

    # A subclass of the base class works like torch's (abstract average_parameters).
    with pytest.raises(TypeError):
        ModelAverager()  # type: ignore[abstract]


@pytest.mark.parametrize("world", [2, 4])
def test_schedules_match_table_and_torch(world: int) -> None:
    run_ranks(_schedules, world)


def warning_texts(build: object) -> list[tuple[type[Warning], str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()  # type: ignore[operator]
    return [(w.category, str(w.message)) for w in caught]


def _bad_inputs(rank: int, world: int) -> None:
    assert world == 4
    # A wrong type is a TypeError, a wrong value a ValueError; both name argument, value and fix.
    for bad, error in [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError)]:
        with pytest.raises(error, match=rf"period: expected a positive int, got {bad!r}; pass how many steps"):
            PeriodicModelAverager(bad)  # type: ignore[arg-type]
    for bad, error in [(-1, ValueError), (0.5, TypeError), (None, TypeError)]:
        message = rf"warmup_steps: expected a non-negative int, got {bad!r}; pass 0 for no warm-up"
        with pytest.raises(error, match=message):
            PeriodicModelAverager(2, warmup_steps=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match=message):
            HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=bad)  # type: ignore[arg-type]
    for bad, error in [(0, ValueError), (-1, ValueError), ("25", TypeError)]:
        message = rf"bucket_cap_mb: expected a positive number, got {bad!r}; pass a bound in MiB"
        with pytest.raises(error, match=message):
            PeriodicModelAverager(2, bucket_cap_mb=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match=message):
            HierarchicalModelAverager({2: 2, 4: 4}, bucket_cap_mb=bad)  # type: ignore[arg-type]

    # Period 1 and a largest period of 1 warn exactly as torch does.
    ours = warning_texts(lambda: PeriodicModelAverager(1))
    assert ours
    assert ours == warning_texts(lambda: torch_averagers.PeriodicModelAverager(1))
    ours = warning_texts(lambda: HierarchicalModelAverager({1: 4}))
    assert ours
    assert ours == warning_texts(lambda: torch_hier.HierarchicalModelAverager({1: 4}))
    assert warning_texts(lambda: HierarchicalModelAverager({1: 2, 2: 4})) == []

    # Every bad map: argument, value and fix; the exact message for the brief's example.
    with pytest.raises(ValueError) as err:
        HierarchicalModelAverager({2: 3, 4: 4})
    assert str(err.value) == (
        "period_group_size_dict: group size 3 does not divide the world size 4; use sizes that divide 4, "
        "e.g. {2: 2, 4: 4}"
    )
    cases: list[tuple[Any, type[Exception], str]] = [
        ({}, ValueError, r"expected a non-empty mapping of period to group size, got \{\}.*e\.g\. \{2: 2, 4: 4\}"),
        (None, ValueError, r"expected a non-empty mapping of period to group size, got None.*e\.g\. \{2: 2, 4: 4\}"),
        ([(2, 4)], TypeError, r"expected a non-empty mapping .*got \[\(2, 4\)\].*e\.g\. \{2: 2, 4: 4\}"),
        ({0: 2, 4: 4}, ValueError, r"period 0 is not a positive int.*e\.g\. \{2: 2, 4: 4\}"),
        ({-3: 4}, ValueError, r"period -3 is not a positive int"),
        ({2.0: 4}, TypeError, r"period 2\.0 is not a positive int"),
        ({True: 4}, TypeError, r"period True is not a positive int"),
        ({4: 2, 2: 4}, ValueError, r"periods must increase, but 2 comes after 4.*e\.g\. \{2: 2, 4: 4\}"),
        ({2: 2, 2.5: 4}, TypeError, r"period 2\.5 is not a positive int"),
        ({2: 0, 4: 4}, ValueError, r"group size 0 is not a positive int"),
        ({2: "2", 4: 4}, TypeError, r"group size '2' is not a positive int.*e\.g\. \{2: 2, 4: 4\}"),
        (
            {2: 8, 4: 4},
            ValueError,
            r"group size 8 does not divide the world size 4; use sizes that divide 4, e\.g\. \{2: 4",
        ),
        (
            {2: 2, 4: 2},
            ValueError,
            r"the last group size 2 must be the size of process_group \(4\).*e\.g\. \{2: 2, 4: 4\}",
        ),
        ({8: 4, 2: 2}, ValueError, r"periods must increase, but 2 comes after 8"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=r"^period_group_size_dict: " + message):
            HierarchicalModelAverager(bad)  # type: ignore[arg-type]
    # Torch accepts some of these and fails later or averages wrongly; ours fails before creating
    # any group, so the world is still usable: a collective right after completes.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world


def test_bad_inputs_fail_clearly() -> None:
    run_ranks(_bad_inputs, 4)
