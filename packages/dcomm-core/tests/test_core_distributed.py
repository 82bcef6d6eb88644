"""State, collectives and intra-node groups on real gloo ranks, against exact float64 references."""

from __future__ import annotations

import os
import re
import socket
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks as torch_fsdp_hooks

from dcomm.core import (
    DefaultState,
    LowPrecisionState,
    allreduce_future,
    divide_factors,
    host_identity,
    intra_node_subgroups,
    reduce_scatter_future,
    start_all_gather,
    start_reduce_scatter,
)
from dcomm_testing import RankFailure, run_ranks


def rank_grad(rank: int, numel: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A gradient that differs on every rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * (rank + 1)).to(dtype)


def _state_and_collectives(rank: int, world: int) -> None:
    state = DefaultState(dist.group.WORLD)
    torch_state = torch_fsdp_hooks.DefaultState(dist.group.WORLD)
    assert state.world_size == world
    assert state.gradient_predivide_factor == torch_state.gradient_predivide_factor
    assert state.gradient_postdivide_factor == torch_state.gradient_postdivide_factor

    exact = torch.stack([rank_grad(r, 12) for r in range(world)]).mean(0)
    pre, post = divide_factors(world)
    for dtype, tol in [(torch.float32, 1e-6), (torch.float64, 1e-12)]:
        grad = rank_grad(rank, 12, dtype)
        out = allreduce_future(grad, predivide=pre, postdivide=post).wait()
        assert out.data_ptr() == grad.data_ptr()
        torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol)

        # Same arithmetic as torch's FSDP allreduce hook: bit-identical.
        ours, theirs = rank_grad(rank, 12, dtype), rank_grad(rank, 12, dtype)
        allreduce_future(ours, predivide=pre, postdivide=post).wait()
        torch_fsdp_hooks.allreduce_hook(torch_state, theirs)
        assert torch.equal(ours, theirs)

        shard = torch.empty(3, dtype=dtype)
        full = rank_grad(rank, 3 * world, dtype)
        reduce_scatter_future(shard, full, predivide=pre, postdivide=post).wait()
        exact_full = torch.stack([rank_grad(r, 3 * world) for r in range(world)]).mean(0)
        torch.testing.assert_close(shard.double(), exact_full[3 * rank : 3 * rank + 3], rtol=tol, atol=tol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_state_and_collectives(world: int) -> None:
    run_ranks(_state_and_collectives, world)


def _low_precision_state(rank: int, world: int) -> None:
    state = LowPrecisionState(dist.group.WORLD, parameter_type=torch.float64)
    assert state.parameter_type is torch.float64
    with pytest.raises(ValueError, match=r"parameter_type: expected a floating-point torch.dtype, got torch.int32"):
        LowPrecisionState(dist.group.WORLD, parameter_type=torch.int32)
    with pytest.raises(TypeError, match=r"parameter_type: expected a floating-point torch.dtype, got 'float32'; pass"):
        LowPrecisionState(dist.group.WORLD, parameter_type="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="process_group: expected a ProcessGroup for DefaultState, got None; pass"):
        DefaultState(None)  # type: ignore[arg-type]


def test_low_precision_state_validation() -> None:
    run_ranks(_low_precision_state, 2)


def _reduce_scatter_bad_size(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="tensor: expected 8 elements"):
        reduce_scatter_future(torch.empty(4), torch.empty(7))


def test_reduce_scatter_rejects_wrong_input_size() -> None:
    run_ranks(_reduce_scatter_bad_size, 2)


def _intra_node(rank: int, world: int) -> list[int]:
    mine, groups = intra_node_subgroups()
    ones = torch.ones(1)
    dist.all_reduce(ones, group=mine)
    assert ones.item() == dist.get_world_size(mine)
    assert len(groups) == world // dist.get_world_size(mine)
    return dist.get_process_group_ranks(mine)


@pytest.mark.parametrize(
    ("world", "local", "expected"),
    [
        (4, "2", [[0, 1], [0, 1], [2, 3], [2, 3]]),
        (4, "4", [[0, 1, 2, 3]] * 4),
        (4, "1", [[0], [1], [2], [3]]),
    ],
)
def test_intra_node_subgroups_follow_local_world_size(world: int, local: str, expected: list[list[int]]) -> None:
    assert run_ranks(_intra_node, world, env={"LOCAL_WORLD_SIZE": local}) == expected


def test_intra_node_subgroups_reject_non_dividing_node_size() -> None:
    with pytest.raises(RankFailure, match=r"LOCAL_WORLD_SIZE: 3 does not divide the 4 ranks \[0, 1, 2, 3\]"):
        run_ranks(_intra_node, 4, env={"LOCAL_WORLD_SIZE": "3"})


def _layout_on_simulated_hosts(rank: int, world: int, hosts: list[str], sizes: list[str | None]) -> object:
    """``node_layout`` with this rank's host given as a parameter and its own LOCAL_WORLD_SIZE."""
    if sizes[rank] is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = sizes[rank]
    try:
        mine, _ = intra_node_subgroups(host_id=hosts[rank])
    except ValueError as error:
        return str(error)  # every rank must raise, with the same message
    ones = torch.ones(1)
    dist.all_reduce(ones, group=mine)  # the groups really work
    assert ones.item() == dist.get_world_size(mine)
    return dist.get_process_group_ranks(mine)


@pytest.mark.parametrize(
    ("hosts", "sizes", "expected"),
    [
        # LOCAL_WORLD_SIZE unset: the hosts decide (never the GPU count).
        (["a", "a", "b", "b"], [None] * 4, [[0, 1], [0, 1], [2, 3], [2, 3]]),
        (["a", "b", "a", "b"], [None] * 4, [[0, 2], [1, 3], [0, 2], [1, 3]]),
        (["a"] * 4, [None] * 4, [[0, 1, 2, 3]] * 4),
        # Set and equal everywhere: hosts cut into nodes of that size (two launcher nodes per host).
        (["a"] * 4, ["2"] * 4, [[0, 1], [0, 1], [2, 3], [2, 3]]),
        (["a", "a", "b", "b"], ["2"] * 4, [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ],
)
@pytest.mark.timeout(300)
def test_node_layout_agreed_from_hosts(hosts: list[str], sizes: list[str | None], expected: object) -> None:
    assert run_ranks(_layout_on_simulated_hosts, 4, hosts, sizes) == expected


@pytest.mark.parametrize(
    ("hosts", "sizes", "message"),
    [
        # The reported defect: node sizes 2 and 4 in one job built groups that paired wrongly.
        (["a"] * 4, ["2", "2", "4", "4"], r"LOCAL_WORLD_SIZE: the ranks disagree \(2 on ranks \[0, 1\], 4 on"),
        (["a"] * 4, ["2", "2", None, None], r"LOCAL_WORLD_SIZE: the ranks disagree \(2 on ranks \[0, 1\], unset"),
        (["a", "a", "a", "b"], ["2"] * 4, r"LOCAL_WORLD_SIZE: 2 does not divide the 3 ranks \[0, 1, 2\] .* host 'a'"),
        (["a"] * 4, ["two"] * 4, r"LOCAL_WORLD_SIZE: expected a positive integer, got 'two'"),
    ],
)
@pytest.mark.timeout(300)
def test_node_layout_disagreement_raises_on_every_rank(hosts: list[str], sizes: list[str | None], message: str) -> None:
    errors = run_ranks(_layout_on_simulated_hosts, 4, hosts, sizes)
    assert all(isinstance(e, str) for e in errors), errors
    assert len(set(errors)) == 1, errors
    assert re.search(message, errors[0]), errors[0]
    assert "GPU" not in errors[0]


def test_host_identity_names_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCOMM_HOST_ID", raising=False)
    assert host_identity().startswith(socket.gethostname() + "/")
    monkeypatch.setenv("DCOMM_HOST_ID", "rack3-node7")
    assert host_identity() == "rack3-node7"


def _hang_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()


def test_run_ranks_reports_failure_without_hanging() -> None:
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_ranks(_hang_on_rank_one, 2, timeout=60)


LATE_S = 3.0


def _fails_late_on_rank_zero(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 failed first")
    time.sleep(LATE_S)  # as an NCCL rank does until its collective times out
    raise RuntimeError("rank 0 failed by itself, later")


@pytest.mark.timeout(300)
def test_run_ranks_gives_the_other_ranks_grace_seconds_to_fail_by_themselves() -> None:
    with pytest.raises(RankFailure) as killed:
        run_ranks(_fails_late_on_rank_zero, 2, timeout=60, grace=0.5)
    assert "rank 1 failed first" in str(killed.value)
    assert "ranks [0] returned nothing" in str(killed.value)
    with pytest.raises(RankFailure) as reported:
        run_ranks(_fails_late_on_rank_zero, 2, timeout=60, grace=LATE_S + 30)
    assert "rank 1 failed first" in str(reported.value)
    assert "rank 0 failed by itself, later" in str(reported.value)
    assert "returned nothing" not in str(reported.value)


def _ends_its_own_group(rank: int, world: int) -> int:
    dist.destroy_process_group()  # as a rank that aborts its NCCL group after an error
    return rank


@pytest.mark.timeout(300)
def test_run_ranks_leaves_a_group_that_the_function_ended() -> None:
    assert run_ranks(_ends_its_own_group, 2) == [0, 1]


def _nccl_check(rank: int, world: int) -> None:
    from dcomm.core import reduced_by_nccl

    assert not reduced_by_nccl(dist.group.WORLD, torch.ones(1))  # CPU tensor on gloo


def test_reduced_by_nccl_is_false_for_cpu_tensors_on_gloo() -> None:
    run_ranks(_nccl_check, 2)


def _direct_starters(rank: int, world: int) -> None:
    """The direct reduce-scatter and all-gather give torch's results bit for bit, in place."""
    g = torch.Generator().manual_seed(rank)
    flat = torch.randn(world * 5, generator=g)
    ours, theirs = torch.empty(5), torch.empty(5)
    start_reduce_scatter(ours, flat.clone(), dist.group.WORLD).wait()
    dist.reduce_scatter_tensor(theirs, flat.clone())
    assert torch.equal(ours, theirs)
    gathered, expected = torch.empty(world * 5), torch.empty(world * 5)
    start_all_gather(gathered, ours, dist.group.WORLD).wait()
    dist.all_gather_into_tensor(expected, theirs)
    assert torch.equal(gathered, expected)
    assert not torch.equal(gathered[:5], gathered[5:10]), "every rank's shard differs"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_direct_reduce_scatter_and_all_gather(world: int) -> None:
    run_ranks(_direct_starters, world)


def _gather_and_rank_device(rank: int, world: int, backend: str) -> tuple[list[object], str | None]:
    from dcomm.core import gather_objects, rank_device

    device = rank_device(dist.group.WORLD)
    gathered = gather_objects(("rank", rank), dist.group.WORLD, device)
    return gathered, None if device is None else str(device)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_gather_objects_in_rank_order_and_no_rank_device_off_nccl(world: int) -> None:
    results = run_ranks(_gather_and_rank_device, world, "gloo")
    assert results == [([("rank", r) for r in range(world)], None)] * world


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_rank_device_on_nccl_is_the_bound_gpu() -> None:
    results = run_ranks(_gather_and_rank_device, 2, "nccl", backend="nccl")
    assert results == [([("rank", r) for r in range(2)], f"cuda:{rank}") for rank in range(2)]


def test_rank_device_without_a_bound_gpu_is_the_local_rank_then_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Global rank 5 on a host of 4 GPUs, as an NCCL job sees it (the CUDA and backend queries faked)."""
    from dcomm.core import collectives

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(collectives, "reduced_by_nccl", lambda group, device: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    unbound = object()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert collectives.rank_device(unbound) == torch.device("cuda", 1)  # type: ignore[arg-type]
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun, 1 rank per host of 4 GPUs
    assert collectives.rank_device(unbound) == torch.device("cuda", 0)  # type: ignore[arg-type]
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert collectives.rank_device(unbound) == torch.device("cuda", 2)  # type: ignore[arg-type]
    monkeypatch.setenv("LOCAL_RANK", "not a number")
    assert collectives.rank_device(unbound) == torch.device("cuda", 1)  # type: ignore[arg-type]

    class Bound:
        bound_device_id = torch.device("cuda", 3)

    assert collectives.rank_device(Bound()) == torch.device("cuda", 3)  # type: ignore[arg-type]
