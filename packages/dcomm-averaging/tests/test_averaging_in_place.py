"""The in-place (NCCL) path of average_parameters, exercised on CPU.

gloo has no NCCL-style ``startCoalescing``, but torch's ``_coalescing_manager`` without a device
sends the recorded allreduces through gloo's ``allreduce_coalesced``: the same Python path, the
same in-place division and post-division, the same tensors (the parameters' own storage). So the
in-place code runs for real here with the manager's device forced to None; the decision (which
devices and backends take it) is checked against fakes, and the fallback to buckets against
gloo's real refusal to start coalescing with a device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils as torch_utils
from test_averaging_parameters import MIB, SPECS, AllocationTracker, assert_averaged, exact_mean, make_params

import dcomm.averaging.parameters as impl
from dcomm.averaging import average_parameters
from dcomm.core.testing import run_ranks

# More parameters than one coalesced group holds once the limits are lowered, every dtype.
MANY = [((3, 5), torch.float32, False)] * 9 + [((7,), torch.bfloat16, False)] * 5 + [((4,), torch.float16, False)] * 4


@contextmanager
def patched(**attrs: Any) -> Iterator[None]:
    """Set attributes of the implementation module for the duration of the block."""
    saved = {name: getattr(impl, name) for name in attrs}
    for name, value in attrs.items():
        setattr(impl, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(impl, name, value)


@contextmanager
def forced_in_place(calls: list[list[torch.Tensor]] | None = None) -> Iterator[None]:
    """Every device takes the in-place path, its manager without a device (what gloo supports)."""
    real = impl._average_in_place

    def in_place(flats: list[torch.Tensor], group: Any, world: int, device: Any) -> list[torch.Tensor]:
        rest = real(flats, group, world, None)
        if calls is not None:
            calls.append(rest)
        return rest

    with patched(_averages_in_place=lambda device, group: True, _average_in_place=in_place):
        yield


def _pointers(params: list[torch.nn.Parameter]) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
    return [(p.data_ptr(), p.dtype, p.stride()) for p in params]


def _in_place_checks(rank: int, world: int) -> None:
    everyone = list(range(world))

    # Mixed dtypes and a channels-last layout, in place, against the float64 mean: nothing left
    # for the buckets, no parameter moved, not one byte allocated (no bucket, no flat copy).
    for limits in [{}, {"_COALESCE_MAX_TENSORS": 3}, {"_COALESCE_MAX_BYTES": 64}]:
        for specs, seed in [(SPECS, 0), (MANY, 1)]:
            params = make_params(rank, specs, seed)
            before = _pointers(params)
            calls: list[list[torch.Tensor]] = []
            with patched(**limits), forced_in_place(calls), AllocationTracker() as mem:
                average_parameters(params, None, bucket_cap_mb=64 / MIB)
            assert calls, "the in-place path was not taken"
            assert all(rest == [] for rest in calls), "a group fell back to the buckets"
            assert mem.peak == 0, f"the in-place path allocated {mem.peak} bytes"
            assert _pointers(params) == before, "not in place"
            assert_averaged(params, exact_mean(everyone, specs, seed))

    # fp32: torch's arithmetic (divide, then SUM), against torch's average_parameters (bit for bit
    # on gloo, whose coalesced allreduce sums the same concatenation torch builds).
    fp32 = [((5, 3), torch.float32, False), ((17,), torch.float32, False), ((2, 2), torch.float32, False)]
    ours, theirs = make_params(rank, fp32, seed=7), make_params(rank, fp32, seed=7)
    with forced_in_place():
        average_parameters(ours, None)
    torch_utils.average_parameters(iter(theirs), dist.group.WORLD)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)

    # The internal function directly: every flat averaged, none returned, pointers unchanged.
    params = make_params(rank, [((6,), torch.float32, False)] * 4, seed=9)
    flats = [p.detach().view(-1) for p in params]
    before = [f.data_ptr() for f in flats]
    with torch.no_grad():
        assert impl._average_in_place(flats, dist.group.WORLD, world, None) == []
    assert [f.data_ptr() for f in flats] == before == [p.data_ptr() for p in params]
    assert_averaged(params, exact_mean(everyone, [((6,), torch.float32, False)] * 4, seed=9))

    # A subgroup on the in-place path: members average among themselves, others change nothing.
    members = [0, 1] if world > 2 else [0]
    group = dist.new_group(members)
    params = make_params(rank, seed=3)
    with forced_in_place():
        average_parameters(params, group)
    if rank in members:
        assert_averaged(params, exact_mean(members, seed=3))
    else:
        for p, mine in zip(params, make_params(rank, seed=3), strict=True):
            assert torch.equal(p, mine)

    # The manager refuses to start (gloo has no startCoalescing for a device): nothing was
    # touched, everything goes through the buckets, and the group still communicates normally.
    params = make_params(rank, MANY, seed=4)
    calls = []
    real = impl._average_in_place

    def with_device(flats: list[torch.Tensor], group: Any, world: int, device: Any) -> list[torch.Tensor]:
        rest = real(flats, group, world, torch.device("cpu"))
        calls.append(rest)
        return rest

    with patched(_averages_in_place=lambda device, group: True, _average_in_place=with_device):
        average_parameters(params, None, bucket_cap_mb=64 / MIB)
    assert calls, "the in-place path was not tried"
    assert all(len(rest) > 0 for rest in calls), "gloo started coalescing with a device?"
    assert_averaged(params, exact_mean(everyone, MANY, seed=4))
    assert dist.group.WORLD not in dist.distributed_c10d._world.pg_coalesce_state
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world

    # A coalescing manager that is not there, or has another signature: the buckets, as before.
    for stand_in in [None, lambda group=None: None]:
        saved = dist._coalescing_manager
        dist._coalescing_manager = stand_in  # type: ignore[assignment]
        try:
            assert impl._coalescing_manager() is None
            params = make_params(rank, seed=5)
            with forced_in_place(calls := []):
                average_parameters(params, None)
            assert [len(rest) for rest in calls] == [3, 1, 2, 1]  # every flat of every group back
            assert_averaged(params, exact_mean(everyone, seed=5))
        finally:
            dist._coalescing_manager = saved

    # Parameters that alias each other are divided once each through the buckets, never in place.
    base = torch.arange(12, dtype=torch.float64) * (rank + 1)
    storage = base.float()
    params = [torch.nn.Parameter(storage[0:8]), torch.nn.Parameter(storage[4:12])]
    calls = []
    with forced_in_place(calls):
        average_parameters(params, None)
    assert calls == []
    mean = torch.arange(12, dtype=torch.float64) * (world + 1) / 2
    torch.testing.assert_close(storage.double(), mean)

    # No device synchronize on the in-place path either.
    def forbidden() -> None:
        raise AssertionError("average_parameters synchronized the device")

    saved_sync = torch.cuda.synchronize, torch.accelerator.synchronize
    torch.cuda.synchronize = torch.accelerator.synchronize = forbidden  # type: ignore[assignment]
    try:
        with forced_in_place():
            average_parameters(make_params(rank), None)
    finally:
        torch.cuda.synchronize, torch.accelerator.synchronize = saved_sync


@pytest.mark.parametrize("world", [2, 4])
def test_in_place_path(world: int) -> None:
    run_ranks(_in_place_checks, world)


def _decision_checks(rank: int, world: int) -> None:
    world_group = dist.group.WORLD
    cuda = torch.device("cuda", 0)
    # gloo: never in place, on the CPU or for CUDA tensors (its backend does not coalesce).
    assert not impl._averages_in_place(torch.device("cpu"), world_group)
    assert not impl._averages_in_place(cuda, world_group)

    # A group whose backend for the device coalesces (NCCL): in place; CPU tensors never are.
    def fake_group(get_backend: Callable[[torch.device], Any]) -> Any:
        return SimpleNamespace(_get_backend=get_backend)

    nccl_like = fake_group(lambda device: SimpleNamespace(supports_coalescing=True))
    assert impl._averages_in_place(cuda, nccl_like)
    assert not impl._averages_in_place(torch.device("cpu"), nccl_like)
    no_flag = fake_group(lambda device: SimpleNamespace())
    assert not impl._averages_in_place(cuda, no_flag)

    def refuse(device: torch.device) -> Any:
        raise RuntimeError("no backend for this device")

    assert not impl._averages_in_place(cuda, fake_group(refuse))
    with patched(_coalescing_manager=lambda: None):
        assert not impl._averages_in_place(cuda, nccl_like)

    # gloo, unpatched: the bucket path, exactly as before (one staging buffer of the bytes).
    params = make_params(rank, [((5, 3), torch.float32, False), ((17,), torch.float32, False)], seed=2)
    with AllocationTracker() as mem:
        average_parameters(params, None)
    assert mem.peak == (15 + 17) * 4


def test_decision() -> None:
    run_ranks(_decision_checks, 2)


def test_coalesced_chunks() -> None:
    flats = [torch.empty(n, dtype=torch.float32) for n in [10, 10, 100, 1, 1, 1, 1]]
    with patched(_COALESCE_MAX_TENSORS=3, _COALESCE_MAX_BYTES=80):
        chunks = [(start, [f.numel() for f in chunk]) for start, chunk in impl._coalesced_chunks(flats)]
    # 80 bytes = 20 fp32: [10, 10]; the 100-element flat alone; then at most 3 per chunk.
    assert chunks == [(0, [10, 10]), (2, [100]), (3, [1, 1, 1]), (6, [1])]
    with patched(_COALESCE_MAX_TENSORS=64, _COALESCE_MAX_BYTES=256 * MIB):
        assert [len(c) for _, c in impl._coalesced_chunks([torch.empty(1)] * 130)] == [64, 64, 2]
    assert list(impl._coalesced_chunks([])) == []


def test_overlap() -> None:
    flat = torch.zeros(20)
    assert not impl._overlap([flat[0:10], flat[10:20], torch.zeros(3)])  # a flattened model
    assert impl._overlap([flat[0:10], flat[9:20]])
    assert impl._overlap([flat[0:20], flat[2:3], flat[15:16]])
    assert impl._overlap([flat.view(4, 5)[1].view(-1), flat.view(-1)])
    assert not impl._overlap([torch.zeros(5), torch.zeros(5)])
