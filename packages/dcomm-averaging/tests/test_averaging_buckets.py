"""average_parameters against torch's, bit for bit on gloo: every dtype, mixed lists, in place and in buckets.

torch's ``average_parameters`` concatenates the list into one flat tensor (promoting mixed
dtypes), divides it by the group size and sums it. gloo's ring sums an element in an order that
depends on its position in the message, so the bits can match torch's at 3 or more ranks only
where dcomm's message is torch's (one bucket holding the whole list in order); at 2 ranks the sum
is one addition and every layout matches. Elsewhere the results are held to the float64 mean
with the dtype's tolerance (see test_averaging_parameters).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils as torch_utils
from test_averaging_parameters import MIB, AllocationTracker, assert_averaged, exact_mean, make_params

import dcomm.averaging._buckets as buckets
from dcomm.averaging import average_parameters, flatten_parameters
from dcomm_testing import device_synchronize_forbidden, recorded_calls, run_ranks, seeded_mlp

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16

# (shape, dtype, channels_last) lists: each dtype alone, and mixed.
DTYPE_LISTS: dict[str, list[tuple[tuple[int, ...], torch.dtype, bool]]] = {
    name: [((4, 5), dtype, False), ((33,), dtype, False), ((0,), dtype, False), ((2, 3, 2, 2), dtype, True)]
    for name, dtype in [("fp32", F32), ("fp64", F64), ("bf16", BF16), ("fp16", F16)]
}
DTYPE_LISTS["mixed"] = [((4, 5), F32, False), ((7,), BF16, False), ((3, 3), F16, False), ((2, 3, 2, 2), F32, True)]
DTYPE_LISTS["mixed-64"] = [((6,), F64, False), ((5, 2), F32, False), ((9,), BF16, False)]


def _torch_average(params: list[torch.nn.Parameter], group: Any = None) -> list[torch.Tensor]:
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_utils.average_parameters(iter(clones), group if group is not None else dist.group.WORLD)
    return [c.detach() for c in clones]


def _same_bits(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype, (what, index)
        assert torch.equal(a, b), (what, index, a, b)


def _torch_parity_checks(rank: int, world: int) -> None:
    everyone = list(range(world))
    for name, specs in DTYPE_LISTS.items():
        for cap, always_same in [(25.0, True), (64 / MIB, world == 2), (1 / MIB, world == 2)]:
            params = make_params(rank, specs, seed=3)
            before = [(p.data_ptr(), p.dtype, p.stride()) for p in params]
            expected = _torch_average(params)
            average_parameters(params, None, bucket_cap_mb=cap)
            assert [(p.data_ptr(), p.dtype, p.stride()) for p in params] == before, (name, cap, "not in place")
            if always_same:
                _same_bits([p.detach() for p in params], expected, f"{name} cap {cap}")
            assert_averaged(params, exact_mean(everyone, specs, seed=3))

    # fp16 near the top of its range: divided by the group size before the SUM, as torch (a sum
    # first, or a partial pre-division, overflowed to inf at 3 and 4 ranks).
    values = [torch.full((6,), 60000.0 - 1000.0 * rank), torch.full((3,), -50000.0 + 7.0 * rank)]
    ours = [torch.nn.Parameter(v.half()) for v in values]
    expected = _torch_average(ours)
    average_parameters(ours, None)
    assert all(torch.isfinite(p).all() for p in ours)
    _same_bits([p.detach() for p in ours], expected, "fp16 near its limit")

    # Changing lists: a subset, then the whole list again, each equal to torch's (each a new plan).
    params = make_params(rank, DTYPE_LISTS["mixed"], seed=4)
    for chosen in [params, params[1:3], params[::2], params]:
        expected = _torch_average(chosen)
        average_parameters(chosen, None)
        _same_bits([p.detach() for p in chosen], expected, "changing list")

    # A tied parameter passed twice is averaged once (torch averages both copies alike).
    tied = make_params(rank, DTYPE_LISTS["fp32"], seed=5)
    expected = _torch_average([tied[0], tied[1], tied[0], tied[3]])
    average_parameters([tied[0], tied[1], tied[0], tied[3]], None)
    if world == 2:
        _same_bits(
            [tied[0].detach(), tied[1].detach(), tied[3].detach()], [expected[0], expected[1], expected[3]], "tied"
        )
    assert_averaged(
        [tied[0], tied[1], tied[3]], [exact_mean(everyone, DTYPE_LISTS["fp32"], seed=5)[i] for i in (0, 1, 3)]
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bit_identical_to_torch(world: int) -> None:
    run_ranks(_torch_parity_checks, world, timeout=240)


def _in_place_checks(rank: int, world: int) -> None:
    everyone = list(range(world))
    # Tensors of at least half the cap are averaged in their own storage: no byte allocated.
    # (Each list's first call checks it across ranks, which allocates: the tracked call is a second one.)
    specs = [((64,), F32, False), ((16, 8), F32, False), ((2, 4, 3, 3), F32, True)]
    average_parameters(make_params(rank, specs, seed=6), None, bucket_cap_mb=256 / MIB)
    params = make_params(rank, specs, seed=6)
    with AllocationTracker() as mem, recorded_calls(buckets, "start_allreduce", lambda *a, **k: a[0]) as sent:
        average_parameters(params, None, bucket_cap_mb=256 / MIB)
    assert mem.peak == 0, mem.peak
    assert [t.numel() for t in sent] == [64, 128, 72]
    assert_averaged(params, exact_mean(everyone, specs, seed=6))

    # A flattened model is one run per dtype: one allreduce of the whole buffer, no staging.
    torch.manual_seed(0)
    model = seeded_mlp(6, 8, 4)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(rank)
    expected = [p.detach().double() - rank + (world - 1) / 2 for p in model.parameters()]
    (buffer,) = flatten_parameters(model)
    twin = seeded_mlp(6, 8, 4)
    flatten_parameters(twin)
    average_parameters(twin.parameters(), None, bucket_cap_mb=2 * buffer.nbytes / MIB)
    with AllocationTracker() as mem, recorded_calls(buckets, "start_allreduce", lambda *a, **k: a[0]) as sent:
        average_parameters(model.parameters(), None, bucket_cap_mb=2 * buffer.nbytes / MIB)
    assert mem.peak == 0
    assert [t.numel() for t in sent] == [buffer.numel()]
    for param, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach().double(), want, rtol=1e-6, atol=1e-6)

    # The same parameters, not flattened, go through one staging bucket of their bytes.
    for _ in range(2):
        model = seeded_mlp(6, 8, 4)
        with AllocationTracker() as mem, recorded_calls(buckets, "start_allreduce", lambda *a, **k: a[0]) as sent:
            average_parameters(model.parameters(), None, bucket_cap_mb=2 * buffer.nbytes / MIB)
    assert mem.peak == buffer.nbytes
    assert [t.numel() for t in sent] == [buffer.numel()]

    # Parameters that share memory are copied out and back, each averaged once.
    storage = (torch.arange(12, dtype=torch.float64) * (rank + 1)).float()
    aliased = [torch.nn.Parameter(storage[0:8]), torch.nn.Parameter(storage[4:12])]
    with recorded_calls(buckets, "start_allreduce", lambda *a, **k: a[0]) as sent:
        average_parameters(aliased, None, bucket_cap_mb=8 / MIB)
    assert max(t.numel() for t in sent) <= 2, "aliasing parameters reduced in place"  # 8-byte buckets
    torch.testing.assert_close(storage.double(), torch.arange(12, dtype=torch.float64) * (world + 1) / 2)

    # No device synchronize, on either path.
    with device_synchronize_forbidden("average_parameters"):
        average_parameters(make_params(rank, specs, seed=6), None, bucket_cap_mb=256 / MIB)
        average_parameters(make_params(rank, specs, seed=6), None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_large_parameters_in_place(world: int) -> None:
    run_ranks(_in_place_checks, world, timeout=240)


def _cuda_checks(rank: int, world: int) -> None:
    # CUDA tensors on gloo (one GPU is enough): the staging, the spans and the casts run on the
    # device; the results must still be torch's, bit for bit at 2 ranks.
    device = torch.device("cuda", 0)
    for name, specs in DTYPE_LISTS.items():
        for cap in [25.0, 64 / MIB]:
            params = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(rank, specs, seed=8)]
            pointers = [p.data_ptr() for p in params]
            expected = _torch_average(params)
            average_parameters(params, None, bucket_cap_mb=cap)
            assert [p.data_ptr() for p in params] == pointers
            _same_bits([p.detach() for p in params], expected, f"cuda {name} cap {cap}")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU suite runs it)")
def test_cuda_tensors_bit_identical_to_torch() -> None:
    run_ranks(_cuda_checks, 2, timeout=240)
