"""plan_average: which reduce op and divisors each dtype gets, and that NCCL's ops keep the bits of dividing first."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcomm.core import average_plan, plan_average
from dcomm_testing import run_ranks

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _nccl_world(monkeypatch: pytest.MonkeyPatch, world: int) -> object:
    """A stand-in group of ``world`` ranks that NCCL reduces (no process group is started)."""
    monkeypatch.setattr(average_plan, "reduced_by_nccl", lambda group, device: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    return object()


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", FLOATS)
def test_premul_only_where_it_is_the_quotient_and_never_for_bf16(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, world: int
) -> None:
    group = _nccl_world(monkeypatch, world)
    plan = plan_average(group, dtype, torch.device("cuda"), arithmetic="predivide", nccl_average=False)  # type: ignore[arg-type]
    power_of_two = world & (world - 1) == 0
    if power_of_two and dtype != torch.bfloat16:
        assert (plan.pre, plan.post) == (1.0, 1.0)
        assert plan.op != dist.ReduceOp.SUM  # NCCL's pre-multiplied sum
    else:  # torch's bf16 pre-multiplied sum gets a float factor; a factor 1/3 is not the quotient
        assert plan == (dist.ReduceOp.SUM, float(world), 1.0)


def test_fp16_split_division_keeps_its_power_of_two_premul(monkeypatch: pytest.MonkeyPatch) -> None:
    group = _nccl_world(monkeypatch, 6)  # torch's FSDP factors for 6 ranks: 4 before the sum, 1.5 after
    plan = plan_average(group, torch.float16, torch.device("cuda"), arithmetic="split", nccl_average=False)  # type: ignore[arg-type]
    assert plan.op != dist.ReduceOp.SUM
    assert (plan.pre, plan.post) == (1.0, 1.5)


def _plans_on_nccl_keep_the_bits(rank: int, world: int) -> None:
    # One rank applies each plan's op (NCCL still multiplies by a pre-multiplied sum's factor at
    # one rank): every op plan_average picks for a group of n ranks must give x / n exactly.
    import unittest.mock

    gen = torch.Generator().manual_seed(0)
    for dtype in FLOATS:
        x = torch.randn(4096, generator=gen).to(dtype).cuda()
        for n in (2, 3, 4, 6, 8):
            with unittest.mock.patch.object(dist, "get_world_size", lambda group=None, n=n: n):
                plan = plan_average(None, dtype, x.device, arithmetic="predivide", nccl_average=False)
            y = x.clone()
            if plan.pre != 1.0:
                y.div_(plan.pre)
            dist.all_reduce(y, op=plan.op)
            if plan.post != 1.0:
                y.div_(plan.post)
            assert torch.equal(y, x.clone().div_(float(n))), (dtype, n, plan)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (NCCL)")
def test_every_op_picked_on_nccl_gives_the_quotient() -> None:
    run_ranks(_plans_on_nccl_keep_the_bits, 1, backend="nccl", timeout=240)
