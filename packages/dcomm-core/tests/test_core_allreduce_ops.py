"""Every reduce op through dcomm's direct allreduce path is bit-identical to ``dist.all_reduce``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcomm.core import allreduce_future, start_allreduce
from dcomm.core.torch_private import make_nccl_premul_sum
from dcomm_testing import run_ranks, seeded_batch

R = dist.ReduceOp
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGERS = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool)
COMPLEX = (torch.complex64, torch.complex128)
# What gloo reduces (AVG too on torch >= 2.13; older gloo refuses it, as it refuses PREMUL_SUM, and
# then dcomm's direct path must refuse it the same way).
GLOO_REDUCES = {
    "SUM": FLOATS + INTEGERS + COMPLEX,
    "PRODUCT": FLOATS + INTEGERS,
    "MIN": FLOATS + INTEGERS,
    "MAX": FLOATS + INTEGERS,
    "BAND": INTEGERS,
    "BOR": INTEGERS,
    "BXOR": INTEGERS,
}
REAL_ONLY = ("PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def rank_data(rank: int, dtype: torch.dtype, numel: int = 37) -> torch.Tensor:
    """Different values on every rank: normal floats, small signed or unsigned integers, random bools."""
    if dtype.is_floating_point or dtype.is_complex:
        return seeded_batch(rank, 0, (numel,), dtype=dtype)
    gen = torch.Generator().manual_seed(rank)
    low, high = (0, 2) if dtype == torch.bool else (0, 200) if dtype == torch.uint8 else (-60, 60)
    return torch.randint(low, high, (numel,), generator=gen).to(dtype)


def outcome(reduce: object, tensor: torch.Tensor) -> torch.Tensor | str:
    """The reduced tensor, or the error's type and first line."""
    try:
        reduce(tensor)  # type: ignore[operator]
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return tensor


def _every_gloo_op(rank: int, world: int) -> list[str]:
    compared = []
    ops = {name: getattr(R, name) for name in (*GLOO_REDUCES, "AVG")} | {"PREMUL_SUM": make_nccl_premul_sum(0.5)}
    for name, op in ops.items():
        for dtype in FLOATS + INTEGERS + COMPLEX:
            if name in REAL_ONLY and dtype.is_complex:
                continue  # refused below
            theirs = outcome(lambda t, op=op: dist.all_reduce(t, op=op), rank_data(rank, dtype))
            ours = outcome(lambda t, op=op: allreduce_future(t, op=op).wait(), rank_data(rank, dtype))
            direct = outcome(lambda t, op=op: start_allreduce(t, dist.group.WORLD, op).wait(), rank_data(rank, dtype))
            what = f"{name} {dtype}"
            if name in GLOO_REDUCES and dtype in GLOO_REDUCES[name]:
                assert isinstance(theirs, torch.Tensor), f"{what}: dist.all_reduce failed: {theirs}"
            for path, result in (("allreduce_future", ours), ("start_allreduce", direct)):
                if isinstance(theirs, str):  # refused by gloo (bitwise ops on floats, say): refused the same way
                    assert isinstance(result, str), f"{what}: {path} reduced what dist.all_reduce refused"
                    assert theirs in result, (what, path, theirs, result)  # a future's error wraps it
                else:
                    assert isinstance(result, torch.Tensor), (what, path, result)
                    assert torch.equal(result, theirs), f"{what}: {path} differs from dist.all_reduce"
            if isinstance(theirs, torch.Tensor):
                compared.append(what)
    total = rank_data(rank, torch.int64)
    allreduce_future(total).wait()  # the data really differs between ranks and gets combined
    assert torch.equal(total, sum(rank_data(r, torch.int64) for r in range(world)))
    return compared


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.timeout(300)
def test_every_gloo_op_is_bit_identical_to_dist_all_reduce(world: int) -> None:
    compared = run_ranks(_every_gloo_op, world, timeout=240)
    assert len(set(map(tuple, compared))) == 1
    assert len(compared[0]) >= sum(len(dtypes) for dtypes in GLOO_REDUCES.values())


def _divided(rank: int, world: int) -> None:
    pre, post = 2.0, world / 2.0
    for name in ("SUM", "PRODUCT", "MIN", "MAX"):
        for dtype in FLOATS + (COMPLEX if name == "SUM" else ()):
            ours, theirs = rank_data(rank, dtype), rank_data(rank, dtype)
            allreduce_future(ours, predivide=pre, postdivide=post, op=getattr(R, name)).wait()
            theirs.div_(pre)
            dist.all_reduce(theirs, op=getattr(R, name))
            theirs.div_(post)
            assert torch.equal(ours, theirs), f"{name} {dtype} with predivide {pre}, postdivide {post}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(300)
def test_divisions_around_every_op_match_dividing_by_hand(world: int) -> None:
    run_ranks(_divided, world, timeout=240)


def _complex_refusals(rank: int, world: int) -> None:
    for name in REAL_ONLY:
        op = getattr(R, name)
        for reduce in (
            lambda t, op=op: allreduce_future(t, predivide=2.0, op=op),
            lambda t, op=op: start_allreduce(t, dist.group.WORLD, op),
            lambda t, op=op: allreduce_future(t, op=R(op)),  # a ReduceOp object, which torch lets through
        ):
            tensor = rank_data(rank, torch.complex64)
            with pytest.raises(ValueError, match=rf"op: .*{name} is not defined for complex tensors.*use ReduceOp.SUM"):
                reduce(tensor)
            assert torch.equal(tensor, rank_data(rank, torch.complex64)), f"{name}: changed before refusing"
        with pytest.raises(ValueError, match="does not support"):
            dist.all_reduce(rank_data(rank, torch.complex64), op=op)
    dist.barrier()  # no rank started a collective: the group still works


def test_real_only_ops_refuse_complex_tensors_before_changing_them() -> None:
    run_ranks(_complex_refusals, 2)


def _nccl_premul_and_avg(rank: int, world: int) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64):
        for what, make_op in (("PREMUL_SUM", lambda: make_nccl_premul_sum(1.0 / world)), ("AVG", lambda: R.AVG)):
            ours, theirs = rank_data(rank, dtype).to(device), rank_data(rank, dtype).to(device)
            allreduce_future(ours, op=make_op()).wait()
            dist.all_reduce(theirs, op=make_op())
            assert torch.equal(ours, theirs), f"{what} {dtype}: differs from dist.all_reduce"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL's PREMUL_SUM and AVG need 2 GPUs")
@pytest.mark.timeout(300)
def test_nccl_premul_sum_and_avg_are_bit_identical_to_dist_all_reduce() -> None:
    run_ranks(_nccl_premul_and_avg, 2, backend="nccl", timeout=240)
