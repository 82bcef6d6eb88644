"""Uneven input to average_parameters ends on every rank with one error naming the rank, never a hang.

One rank passes something the others do not (no parameters, another dtype, another size, a meta
tensor, another bucket_cap_mb, parameters flattened on that rank only); it is rank 0 in one run
and the last rank in another, at 2 and 3 ranks. Every rank must raise the same message within
20 s, and the group must still work afterwards.
"""

from __future__ import annotations

import time

import pytest
import torch

from dcomm.averaging import PeriodicModelAverager, average_parameters, flatten_parameters
from dcomm.averaging._agreement import CallSignature, Problem, disagreement
from dcomm_testing import run_ranks, seeded_mlp

CASES = ["empty", "dtype", "size", "count", "meta", "bucket_cap_mb", "flattened", "no gradient"]


def _uneven(rank: int, world: int, case: str, odd_rank: int) -> tuple[str, str, float]:
    odd = rank == odd_rank
    params = [torch.nn.Parameter(torch.full((5,), float(rank))), torch.nn.Parameter(torch.ones(3, 2))]
    cap = 25.0
    if case == "empty" and odd:
        params = []
    elif case == "dtype" and odd:
        params[1] = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    elif case == "size" and odd:
        params[0] = torch.nn.Parameter(torch.zeros(6))
    elif case == "count" and odd:
        params = params[:1]
    elif case == "meta" and odd:
        params[1] = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    elif case == "bucket_cap_mb" and odd:
        cap = 8.0
    elif case == "flattened":
        model = seeded_mlp(4, 4, 2)
        if odd:
            flatten_parameters(model)
        params = list(model.parameters())
        cap = 2 * sum(p.nbytes for p in params) / 2**20  # a buffer that size is averaged in place
    start = time.monotonic()
    if case == "no gradient":  # an averager, where one rank left a parameter unused
        for p in params:
            p.grad = None if (odd and p is params[1]) else torch.zeros_like(p)
        with pytest.raises(ValueError) as raised:
            PeriodicModelAverager(period=2).average_parameters(params)
    else:
        with pytest.raises((ValueError, TypeError)) as raised:
            average_parameters(params, None, bucket_cap_mb=cap)
    elapsed = time.monotonic() - start
    # Still in step: the group averages normally afterwards.
    ok = [torch.nn.Parameter(torch.full((2,), float(rank)))]
    average_parameters(ok, None)
    assert torch.equal(ok[0], torch.full((2,), (world - 1) / 2))
    return type(raised.value).__name__, str(raised.value), elapsed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("odd_first", [True, False])
def test_uneven_input_raises_the_same_error_on_every_rank(world: int, odd_first: bool) -> None:
    odd_rank = 0 if odd_first else world - 1
    for case in CASES:
        results = run_ranks(_uneven, world, case, odd_rank, timeout=120)
        kinds = {kind for kind, _, _ in results}
        messages = {message for _, message, _ in results}
        assert len(kinds) == 1, (case, results)
        assert len(messages) == 1, (case, results)
        (message,) = messages
        assert message.startswith(("params: ", "bucket_cap_mb: ")), message
        assert f"rank {odd_rank}" in message, (case, message)
        assert max(elapsed for _, _, elapsed in results) < 20, (case, results)


def test_messages_name_the_rank_and_what_differs() -> None:
    cpu = "cpu"
    two = CallSignature(8.0, ((3, "torch.float32", cpu), (4, "torch.float32", cpu)), ())
    one = CallSignature(8.0, ((3, "torch.float32", cpu),), ())
    other = CallSignature(8.0, ((3, "torch.float32", cpu), (4, "torch.bfloat16", cpu)), ())
    assert disagreement([(None, two)] * 3) is None
    kind, message = disagreement([(None, two), (None, one), (None, two)])  # type: ignore[misc]
    assert kind is ValueError
    assert message.startswith("params: rank 1 passed 1 parameter where ranks [0, 2] passed 2 parameters; pass the same")
    _, message = disagreement([(None, other), (None, two)])  # type: ignore[misc]
    assert (
        "rank 1 passed parameter 1 as 4 torch.float32 elements on cpu where rank 0 passed 4 torch.bfloat16" in message
    )
    problem = Problem("TypeError", "bucket_cap_mb: expected a positive number, got '8'")
    kind, message = disagreement([(None, two), (problem, None), (problem, None)])  # type: ignore[misc]
    assert kind is TypeError
    assert message.endswith("(found on ranks [1, 2]; every rank of the group raises this error)")


def _gpu0_current_on_every_rank(rank: int, world: int) -> tuple[list[float], str]:
    # torch's own distributed tests never call torch.cuda.set_device: GPU 0 is current on every
    # rank while rank r's parameters are on GPU r. The agreement must go through GPU r.
    torch.cuda.set_device(0)
    mine = torch.device("cuda", rank)
    params = [torch.nn.Parameter(torch.full((5,), float(rank), device=mine)) for _ in range(2)]
    average_parameters(params)  # the first call on these parameters agrees them across the ranks
    message = "no error"
    try:
        # Each rank passes a list it has not passed before (an agreed list is not checked again).
        extra = torch.nn.Parameter(torch.zeros(3, device=mine))
        average_parameters(params[:1] if rank == world - 1 else [*params, extra])
    except ValueError as error:
        message = str(error)
    return params[1].tolist(), message


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_agreement_on_nccl_uses_the_parameters_gpu_not_the_current_one() -> None:
    results = run_ranks(_gpu0_current_on_every_rank, 2, backend="nccl", timeout=120)
    assert [values for values, _ in results] == [[0.5] * 5] * 2
    (message,) = {message for _, message in results}  # the same on every rank
    assert "params: rank 1 passed 1 parameter" in message, results
