"""dcomm.averaging scenarios: post-local SGD against torch, hierarchy, topology, resume, errors.

The DDP side always uses torch's own ``post_localSGD_hook``; only the averaging is dcomm's. fp32
parity with torch is exact on gloo; on NCCL the two sides run the same kernels on the same bytes
and are held to 1e-6 relative.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness import device, scenario
from torch.distributed.algorithms.model_averaging import utils as torch_utils

import dcomm.averaging as dcomm_averaging
from dcomm.core import intra_node_subgroups
from dcomm_testing import PostLocalSGDRun, implementation

WARMUP = 3
STEPS = 9


def _assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for a, b in zip(ours, theirs, strict=True):
        if dist.get_backend() == "nccl":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=what)
        else:
            assert torch.equal(a, b), what


def _train_against_torch(rank: int, make_averager: Callable[[Any], Any], name: str) -> None:
    subgroup, _ = intra_node_subgroups()
    theirs = PostLocalSGDRun(implementation("torch"), make_averager, subgroup, warmup=WARMUP, layers=2, device=device())
    ours = PostLocalSGDRun(implementation("dcomm"), make_averager, subgroup, warmup=WARMUP, layers=2, device=device())
    for step in range(STEPS):
        theirs.step(rank, step)
        ours.step(rank, step)
        _assert_same(ours.params(), theirs.params(), f"{name}: step {step}")
        assert ours.averager.step == theirs.averager.step == step + 1


@scenario(min_world_size=2)
def scenario_averaging_periodic_post_local_sgd(rank: int, world_size: int) -> None:
    _train_against_torch(rank, lambda lib: lib.PeriodicModelAverager(period=2, warmup_steps=WARMUP), "periodic")


@scenario(min_world_size=2, world_size_multiple=2)
def scenario_averaging_hierarchical_two_level(rank: int, world_size: int) -> None:
    sizes = {2: world_size // 2, 4: world_size}
    _train_against_torch(rank, lambda lib: lib.HierarchicalModelAverager(sizes, WARMUP), "2-level")


@scenario(min_world_size=8, world_size_multiple=8)
def scenario_averaging_hierarchical_three_level(rank: int, world_size: int) -> None:
    sizes = {2: 2, 4: world_size // 2, 8: world_size}  # {2: 2, 4: 4, 8: 8} on 8 ranks
    _train_against_torch(rank, lambda lib: lib.HierarchicalModelAverager(sizes, WARMUP), "3-level")


@scenario(min_world_size=2)
def scenario_averaging_intra_node_groups(rank: int, world_size: int) -> None:
    mine, _ = intra_node_subgroups()  # the nodes every rank agrees on
    node = dist.get_world_size(mine)
    sizes = {1: node, 2: world_size} if node < world_size else {2: world_size}
    averager = dcomm_averaging.HierarchicalModelAverager(sizes)
    if node < world_size:
        inner = averager.period_process_group_dict[1]
        assert dist.get_process_group_ranks(inner) == dist.get_process_group_ranks(mine)
    # Step 0 averages over everyone, step 1 within the node: check step 1 against float64.
    averager.step = 1
    node_ranks = list(range(rank // node * node, rank // node * node + node)) if node < world_size else []
    values = {r: torch.arange(7, dtype=torch.float64) * (r + 1) for r in range(world_size)}
    params = [torch.nn.Parameter(values[rank].float().to(device()))]
    params[0].grad = torch.zeros_like(params[0])
    averager.average_parameters(params)
    expected = torch.stack([values[r] for r in (node_ranks or [rank])]).mean(0)
    torch.testing.assert_close(params[0].double().cpu(), expected, rtol=1e-6, atol=1e-6)


@scenario(min_world_size=2)
def scenario_averaging_lean_mixed_dtypes(rank: int, world_size: int) -> None:
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32]
    values = [
        [torch.randn(257, generator=torch.Generator().manual_seed(10 * r + i), dtype=torch.float64) for i in range(4)]
        for r in range(world_size)
    ]
    params = [
        torch.nn.Parameter(v.to(dtype).to(device(), copy=True)) for v, dtype in zip(values[rank], dtypes, strict=True)
    ]
    pointers = [p.data_ptr() for p in params]
    cap_bytes = 256  # smaller than every parameter: many buckets through two 128-byte halves
    on_gpu = device().type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    dcomm_averaging.average_parameters(params, None, bucket_cap_mb=cap_bytes / 2**20)
    if on_gpu:
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= 512, f"extra device memory {extra} bytes for a {cap_bytes}-byte bucket (512-byte blocks)"
    assert [p.data_ptr() for p in params] == pointers
    tolerance = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2}
    for i, (p, dtype) in enumerate(zip(params, dtypes, strict=True)):
        assert p.dtype == dtype
        expected = torch.stack([values[r][i].to(dtype).double() for r in range(world_size)]).mean(0)
        tol = tolerance[dtype]
        torch.testing.assert_close(p.detach().double().cpu(), expected, rtol=tol, atol=tol)


@scenario(min_world_size=2)
def scenario_averaging_in_place_and_buckets(rank: int, world_size: int) -> None:
    """A model-like list: large parameters in their own storage, small ones through the buckets.

    150 small fp32 parameters, a channels-last one and two of 2 MiB, against torch's
    ``average_parameters`` (bit for bit on gloo at 2 ranks, 1e-6 elsewhere: the messages differ)
    and the float64 mean; the parameters keep their storage, and the staging stays within the
    cap. Then the same values flattened into one buffer: averaged in place, no staging at all.
    """
    shapes = [(4 + i % 7, 3 + i % 5) for i in range(150)] + [(2**19,), (512, 1024)]
    values = [
        [
            torch.randn(s, generator=torch.Generator().manual_seed(1000 * r + i), dtype=torch.float64)
            for i, s in enumerate(shapes)
        ]
        for r in range(world_size)
    ]
    conv = [torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(77 + r)) for r in range(world_size)]

    def build() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(v.float().to(device(), copy=True)) for v in values[rank]]
        layout = conv[rank].to(device()).contiguous(memory_format=torch.channels_last)
        return [*params, torch.nn.Parameter(layout)]

    theirs = build()
    torch_utils.average_parameters(iter(theirs), dist.group.WORLD)
    cap_mb = 1.0
    dcomm_averaging.average_parameters(build(), None, bucket_cap_mb=cap_mb)  # the first call checks the list
    params = build()
    pointers = [(p.data_ptr(), p.stride()) for p in params]
    on_gpu = device().type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    dcomm_averaging.average_parameters(params, None, bucket_cap_mb=cap_mb)
    if on_gpu:
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= cap_mb * 2**20, f"{extra} bytes of staging for a {cap_mb} MiB cap"
    assert [(p.data_ptr(), p.stride()) for p in params] == pointers, "a parameter moved"
    if world_size == 2:
        _assert_same([p.detach() for p in params], [p.detach() for p in theirs], "vs torch")
    expected = [torch.stack([values[r][i] for r in range(world_size)]).mean(0) for i in range(len(shapes))]
    expected.append(torch.stack(conv).double().mean(0))
    for p, want in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach().double().cpu(), want, rtol=1e-6, atol=1e-6)

    # Flattened: one buffer averaged in its own storage (the cap below its size: no bucket fits it).
    flat = torch.cat([v.reshape(-1) for v in values[rank]]).float().to(device())
    numels = [torch.Size(shape).numel() for shape in shapes]
    carved = [torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(flat.split(numels), shapes, strict=True)]
    dcomm_averaging.average_parameters(carved, None, bucket_cap_mb=cap_mb)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.no_grad():
        for p, value in zip(carved, values[rank], strict=True):
            p.copy_(value.float())
    dcomm_averaging.average_parameters(carved, None, bucket_cap_mb=cap_mb)
    if on_gpu:
        assert torch.cuda.max_memory_allocated() - base == 0, "the flattened buffer was staged"
    for p, want in zip(carved, expected, strict=False):
        torch.testing.assert_close(p.detach().double().cpu(), want, rtol=1e-6, atol=1e-6)


@scenario(min_world_size=2)
def scenario_averaging_uneven_input_fails_everywhere(rank: int, world_size: int) -> None:
    """One rank passes a bf16 parameter where the others pass fp32: every rank raises the same error."""
    odd = world_size - 1
    dtype = torch.bfloat16 if rank == odd else torch.float32
    params = [
        torch.nn.Parameter(torch.ones(5, device=device())),
        torch.nn.Parameter(torch.ones(3, device=device(), dtype=dtype)),
    ]
    try:
        dcomm_averaging.average_parameters(params, None)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("uneven parameters were averaged")
    assert message.startswith(f"params: rank {odd} passed parameter 1 as 3 torch.bfloat16"), message
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, message)
    assert len(set(gathered)) == 1, gathered
