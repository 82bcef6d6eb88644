"""average_parameters on real gloo ranks: exact float64 references, torch parity, memory bound.

Tolerances: fp64 1e-12 and fp32 1e-6 (a sum of at most 4 predivided values), fp16 2e-3 and
bf16 2e-2 relative plus the same absolute (the sum runs in the parameter's own dtype). Where the
arithmetic and the element positions match torch's (fp32 parameters in one bucket) the result must
be bit-identical to torch's ``average_parameters``.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils as torch_utils
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dcomm.averaging import (
    DEFAULT_BUCKET_CAP_MB,
    average_parameters,
    average_parameters_or_parameter_groups,
    get_params_to_average,
)
from dcomm_testing import device_synchronize_forbidden, run_ranks, seeded_normal

TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}
MIB = 2**20

# (shape, dtype, channels_last): every dtype, a zero-size parameter, a permuted layout.
SPECS: list[tuple[tuple[int, ...], torch.dtype, bool]] = [
    ((4, 5), torch.float32, False),
    ((33,), torch.float64, False),
    ((6, 7), torch.bfloat16, False),
    ((0,), torch.float32, False),
    ((3, 3), torch.float16, False),
    ((2, 3, 4, 4), torch.float32, True),
    ((1,), torch.float32, False),
    ((40,), torch.bfloat16, False),
]


def rank_values(rank: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float64 values that differ on every rank."""
    return seeded_normal(seed * 1000 + rank, shape, scale=rank + 1)


def make_params(rank: int, specs: Any = SPECS, seed: int = 0) -> list[torch.nn.Parameter]:
    params = []
    for i, (shape, dtype, channels_last) in enumerate(specs):
        value = rank_values(rank, shape, seed + i).to(dtype)
        if channels_last:
            value = value.contiguous(memory_format=torch.channels_last)
        params.append(torch.nn.Parameter(value))
    return params


def exact_mean(ranks: list[int], specs: Any = SPECS, seed: int = 0) -> list[torch.Tensor]:
    """The float64 mean over ``ranks`` of what ``make_params`` gives each rank."""
    per_rank = [make_params(r, specs, seed) for r in ranks]
    return [torch.stack([ps[i].detach().double() for ps in per_rank]).mean(0) for i in range(len(specs))]


def assert_averaged(params: list[torch.nn.Parameter], expected: list[torch.Tensor]) -> None:
    for p, want in zip(params, expected, strict=True):
        tol = TOL[p.dtype]
        got = p.detach().double()
        # |got - want| <= atol + rtol * |want|, as torch.testing.assert_close (without its imports).
        excess = ((got - want).abs() - tol * (1 + want.abs())).max().item() if got.numel() else 0.0
        assert got.shape == want.shape
        assert excess <= 0, (p.dtype, excess, got, want)


class AllocationTracker(TorchDispatchMode):
    """Bookkeeping of the tensor storages created while active: peak live bytes, largest one."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never compiled; wrapping it would import torch._dynamo (seconds per rank)

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
            weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def _average_parameters_checks(rank: int, world: int) -> None:
    everyone = list(range(world))

    # Mixed dtypes and layouts against the float64 mean, at the default bucket, a bucket smaller
    # than most parameters (64 bytes), and a bucket that holds a single element (1 byte).
    for cap in [DEFAULT_BUCKET_CAP_MB, 64 / MIB, 1 / MIB]:
        params = make_params(rank)
        before = [(p.data_ptr(), p.dtype, p.stride()) for p in params]
        average_parameters(params, None, bucket_cap_mb=cap)
        assert [(p.data_ptr(), p.dtype, p.stride()) for p in params] == before, "not in place"
        assert_averaged(params, exact_mean(everyone))

    # fp32 parameters in one bucket: torch's arithmetic at the same positions, bit-identical.
    fp32 = [((5, 3), torch.float32, False), ((17,), torch.float32, False), ((2, 2), torch.float32, False)]
    ours, theirs = make_params(rank, fp32, seed=7), make_params(rank, fp32, seed=7)
    average_parameters(ours, dist.group.WORLD)
    torch_utils.average_parameters(iter(theirs), dist.group.WORLD)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert_averaged(ours, exact_mean(everyone, fp32, seed=7))

    # fp16 near the top of its range: torch's arithmetic (divide by the group size, then SUM),
    # bit-identical and finite. Dividing only partly before the sum (by divide_factors: 2 at 3 and
    # 4 ranks) made a mean above 65504 * pre / world inf.
    for cap in [DEFAULT_BUCKET_CAP_MB, 4 / MIB]:
        values = [torch.full((6,), 60000.0 - 1000.0 * rank), torch.full((3,), -50000.0 + 7.0 * rank)]
        ours = [torch.nn.Parameter(v.half()) for v in values]
        theirs = [torch.nn.Parameter(v.half()) for v in values]
        average_parameters(ours, None, bucket_cap_mb=cap)
        torch_utils.average_parameters(iter(theirs), dist.group.WORLD)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.isfinite(a).all(), (world, a)
            assert torch.equal(a, b), (world, a, b)

    # A subgroup: its members average among themselves, the others change nothing.
    members = [0, 1] if world > 2 else [0]
    group = dist.new_group(members)
    params = make_params(rank, seed=3)
    average_parameters(params, group, bucket_cap_mb=64 / MIB)
    expected = exact_mean(members if rank in members else [rank], seed=3)
    if rank in members:
        assert_averaged(params, expected)
    else:
        for p, mine in zip(params, make_params(rank, seed=3), strict=True):
            assert torch.equal(p, mine)

    # Peak extra memory: ours stays within the bucket; torch's flat copy holds every byte.
    big = [((2048,), torch.float32, False)] * 6 + [((1000,), torch.float64, False)] * 2
    total = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d, _ in big)
    cap = 16 * 1024
    for chosen_cap in [cap, 3 * 1024]:
        # The first call with a new signature agrees on it in an all_gather_object (world x its
        # pickle); that transient is not staging, so it is spent before the staging is tracked.
        average_parameters(make_params(rank, big, seed=11), None, bucket_cap_mb=chosen_cap / MIB)
        params = make_params(rank, big, seed=11)
        with AllocationTracker() as mem:
            average_parameters(params, None, bucket_cap_mb=chosen_cap / MIB)
        assert 0 < mem.peak <= chosen_cap, (mem.peak, chosen_cap)
        assert mem.largest <= chosen_cap
        assert_averaged(params, exact_mean(everyone, big, seed=11))
    params = make_params(rank, big, seed=11)
    with AllocationTracker() as mem:
        torch_utils.average_parameters(iter(params), dist.group.WORLD)
    assert mem.peak >= total, "the tracker missed torch's flat copy"

    # A single bucket when everything fits: one buffer of exactly the parameter bytes.
    params = make_params(rank, fp32, seed=5)
    with AllocationTracker() as mem:
        average_parameters(params, None)
    assert mem.peak == (15 + 17 + 4) * 4

    # No device synchronize: nothing in average_parameters may call one.
    with device_synchronize_forbidden("average_parameters"):
        average_parameters(make_params(rank), None, bucket_cap_mb=64 / MIB)

    # Parameters without a gradient are skipped, in modules and in param groups, as torch does.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(rank_values(rank, p.shape, 20 + i))
    model[1].bias.requires_grad_(False)
    model(torch.ones(1, 3)).sum().backward()
    model[2].weight.grad = None  # used, but its gradient cleared
    param_groups = [
        {"params": [model[0].weight, model[1].bias]},
        {"params": [model[0].bias, model[1].weight, *model[2].parameters()], "lr": 0.1},
    ]
    for source in [list(model.parameters()), param_groups]:
        assert get_params_to_average(source) == torch_utils.get_params_to_average(source)
    skipped = {id(model[1].bias), id(model[2].weight)}
    assert {id(p) for p in get_params_to_average(model.parameters())} == {
        id(p) for p in model.parameters() if id(p) not in skipped
    }
    clone = [p.detach().clone() for p in model.parameters()]
    twin = [torch.nn.Parameter(c.clone()) for c in clone]
    for p, t in zip(model.parameters(), twin, strict=True):
        t.grad = p.grad
    average_parameters_or_parameter_groups(param_groups, None)
    torch_utils.average_parameters_or_parameter_groups(twin, dist.group.WORLD)
    for p, t, c in zip(model.parameters(), twin, clone, strict=True):
        assert torch.equal(p, t)
        if id(p) in skipped:
            assert torch.equal(p, c), "a parameter without a gradient was averaged"
        else:
            assert not torch.equal(p, c), "a parameter with a gradient was not averaged"

    # Bad input: argument, value and fix in the message.
    for bad, error in [(0, ValueError), (-1.0, ValueError), (True, TypeError), ("25", TypeError), (None, TypeError)]:
        with pytest.raises(error, match=r"bucket_cap_mb: expected a positive number, got"):
            average_parameters(make_params(rank), None, bucket_cap_mb=bad)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"params: an item of type int .*optimizer.param_groups"):
        average_parameters_or_parameter_groups([3], None)  # type: ignore[list-item]
    gappy = torch.nn.Parameter(torch.zeros(4, 4)[:, ::2])
    with pytest.raises(ValueError, match=r"params: a parameter of shape \(4, 2\).*contiguous"):
        average_parameters([gappy], None)


@pytest.mark.parametrize("world", [2, 4])
def test_average_parameters(world: int) -> None:
    run_ranks(_average_parameters_checks, world)
