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
from dcomm.core import intra_node_subgroups, reduced_by_nccl
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
def scenario_averaging_in_place_coalesced(rank: int, world_size: int) -> None:
    """NCCL: every parameter averaged in its own storage by one grouped launch, zero extra bytes.

    With staging and packing of small parameters off (with packing on, at most ``PACK_MAX_BYTES`` per
    dtype; staging: ``scenario_averaging_in_place_staged``). 150
    fp32 parameters (one grouped launch), bf16 ones (NCCL AVG on NCCL) and a
    channels-last one, against the float64 mean and torch's ``average_parameters``; then a
    flattened model (parameters carved back to back out of one buffer), which is one allreduce.
    Under gloo the same calls take the bucket path and must give the same answers.
    """
    from dcomm.averaging import _in_place as in_place
    from dcomm.averaging import _recipes as recipes
    from dcomm.averaging import parameters as impl

    on_nccl = dist.get_backend() == "nccl"
    assert reduced_by_nccl(dist.group.WORLD, device()) == on_nccl
    shapes = [(4 + i % 7, 3 + i % 5) for i in range(150)] + [(33,)] * 3
    dtypes = [torch.float32] * 150 + [torch.bfloat16] * 3
    values = [
        [
            torch.randn(s, generator=torch.Generator().manual_seed(1000 * r + i), dtype=torch.float64)
            for i, s in enumerate(shapes)
        ]
        for r in range(world_size)
    ]
    conv = [
        torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(77 + r), dtype=torch.float64)
        for r in range(world_size)
    ]

    def build() -> list[torch.nn.Parameter]:
        params = [
            torch.nn.Parameter(v.to(d).to(device(), copy=True)) for v, d in zip(values[rank], dtypes, strict=True)
        ]
        layout = conv[rank].float().to(device()).contiguous(memory_format=torch.channels_last)
        return [*params, torch.nn.Parameter(layout)]

    theirs = [p for p in build() if p.dtype == torch.float32]
    torch_utils.average_parameters(iter(theirs), dist.group.WORLD)

    params = build()
    pointers = [(p.data_ptr(), p.stride()) for p in params]
    calls: list[list[torch.Tensor]] = []
    observed = recipes._Paths(
        on_in_place=lambda tensors: calls.append(list(tensors)), pack_max_bytes=0, stage_below_bytes=0
    )

    def averaged_without_memory(params: list[torch.nn.Parameter], paths: Any = observed, bound: int = 0) -> None:
        if on_nccl:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
        if on_nccl:
            extra = torch.cuda.max_memory_allocated() - base
            assert extra <= bound, f"the in-place path allocated {extra} bytes of device memory (bound {bound})"

    # Small parameters packed, within PACK_MAX_BYTES per dtype (without Triton), same averages.
    packed = build()
    averaged_without_memory(packed, recipes._Paths(stage_below_bytes=0), 2 * in_place.PACK_MAX_BYTES)
    averaged_without_memory(params)
    assert [len(c) for c in calls] == ([151, 3] if on_nccl else []), "fp32 + bf16 in place on NCCL only"
    # The flattened model: one buffer, one allreduce of all of it, no extra memory.
    flat = torch.cat([v.reshape(-1) for v in values[rank][:150]]).float().to(device())
    numels = [torch.Size(shape).numel() for shape in shapes[:150]]
    carved = [
        torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(flat.split(numels), shapes[:150], strict=True)
    ]
    calls.clear()
    averaged_without_memory(carved)
    if on_nccl:
        assert len(calls) == 1
        assert [t.numel() for t in calls[0]] == [flat.numel()], "the carved parameters were not joined"
    for p, i in zip(carved, range(150), strict=True):
        want = torch.stack([values[r][i] for r in range(world_size)]).mean(0)
        torch.testing.assert_close(p.detach().double().cpu(), want, rtol=1e-6, atol=1e-6)
    assert [(p.data_ptr(), p.stride()) for p in params] == pointers, "a parameter moved"
    expected = [torch.stack([values[r][i] for r in range(world_size)]).mean(0) for i in range(len(shapes))]
    expected.append(torch.stack(conv).mean(0))
    for p, q, want in zip(params, packed, expected, strict=True):
        tol = 2e-2 if p.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(p.detach().double().cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(q.detach().double().cpu(), want, rtol=tol, atol=tol)
    _assert_same([p.detach() for p in params if p.dtype == torch.float32], [p.detach() for p in theirs], "vs torch")


@scenario(min_world_size=2, backends=("nccl",))
def scenario_averaging_in_place_joins_allocations(rank: int, world_size: int) -> None:
    """NCCL: separate parameters laid back to back in one CUDA allocation are averaged as one allreduce.

    Six 2 MiB parameters allocated in turn from a fresh memory pool lie back to back in one
    segment. Rank 0 allocates a spacer after the third, so only the links every rank has are
    kept: two joined spans of three on every rank (with each rank joining what it alone could,
    the allreduces would not match). Against the float64 mean, eager and replayed as a CUDA
    graph, with the parameters' storage kept and no extra device memory in eager or replayed calls.
    Then the last rank alone gives the fifth parameter new storage: it remakes its recipe with
    no collective of its own (the others keep theirs; a collective on one rank would hang) and
    averages the broken span through a buffer, still two spans of three, eager and replayed.
    """
    from dcomm.averaging import _recipes as recipes
    from dcomm.averaging import parameters as impl

    pool = torch.cuda.MemPool()
    shape = (512, 1024)  # 2 MiB of fp32: carved from the allocator's 20 MiB segments, no rounding gap

    def values(r: int, call: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 * r + call)
        return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(6)]

    params: list[torch.nn.Parameter] = []
    spacers = []  # kept alive: freed, the next parameter would take its place
    with torch.cuda.use_mem_pool(pool):
        for index in range(6):
            params.append(torch.nn.Parameter(torch.empty(shape, device=device())))
            if index == 2 and rank == 0:
                spacers.append(torch.empty(2**18 + 128, device=device()))  # 1 MiB and a bit: the same segment
    ends = [p.data_ptr() + p.nbytes for p in params]
    local_links = sum(ends[i] == params[i + 1].data_ptr() for i in range(5))
    assert local_links == (4 if rank == 0 else 5), f"rank {rank}: {local_links} back-to-back pairs"
    calls: list[list[torch.Tensor]] = []
    observed = recipes._Paths(on_in_place=lambda tensors: calls.append(list(tensors)))
    pointers = [p.data_ptr() for p in params]

    def average_and_check(call: int, allocates: bool) -> None:
        """Average call ``call``'s values; the float64 mean, and no extra device memory unless ``allocates``."""
        with torch.no_grad():
            for param, value in zip(params, values(rank, call), strict=True):
                param.copy_(value.float())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, observed)
        if not allocates:
            assert torch.cuda.max_memory_allocated() == base, f"call {call}: extra device memory on rank {rank}"
        everyone = [values(r, call) for r in range(world_size)]
        for i, param in enumerate(params):
            want = torch.stack([v[i] for v in everyone]).mean(0)
            torch.testing.assert_close(
                param.detach().double().cpu(), want, rtol=1e-6, atol=1e-6, msg=f"call {call} #{i}"
            )

    for call in range(5):  # the third call is captured as a CUDA graph, the later ones replay it
        average_and_check(call, allocates=call in (0, 2))  # the first call (its agreement), the capture
    assert [p.data_ptr() for p in params] == pointers, "a parameter moved"
    assert calls, "the in-place path was not taken"
    assert all([t.numel() for t in c] == [3 * 512 * 1024] * 2 for c in calls), [[t.numel() for t in c] for c in calls]

    mover = world_size - 1
    if rank == mover:
        params[4].data = params[4].data.clone()  # its own storage now, outside the others' allocation
    calls.clear()
    for call in range(5, 10):  # remade on the mover (eager, eager, captured, replayed...), replayed elsewhere
        average_and_check(call, allocates=rank == mover)
    if rank == mover:  # elsewhere the kept graph replays: no Python call to observe
        assert calls, "the in-place path was not taken"
    assert all([t.numel() for t in c] == [3 * 512 * 1024] * 2 for c in calls), [[t.numel() for t in c] for c in calls]


@scenario(min_world_size=2)
def scenario_averaging_in_place_staged(rank: int, world_size: int) -> None:
    """NCCL: parameters under 4 MiB streamed through the staging cap by the Triton table, the rest in place.

    A model-like mix per dtype (fp32, bf16, fp16): hundreds of small and medium tensors, two
    above ``STAGE_BELOW_BYTES`` (averaged in their own storage), a channels-last one and views of
    one buffer at odd offsets (unaligned rows). Against the float64 mean, with the parameters'
    storage kept, at the default cap (one buffer) and at a cap that forces many runs through two
    alternating halves, the peak extra memory within the cap (plus 1 MiB: the table itself). Under
    gloo the same calls take the bucket path and must give the same answers.
    """
    from dcomm.averaging import _in_place as in_place
    from dcomm.averaging import _recipes as recipes
    from dcomm.averaging import parameters as impl
    from dcomm.core import tensor_table

    on_nccl = dist.get_backend() == "nccl"
    big = in_place.STAGE_BELOW_BYTES // 4 + 1000  # fp32 elements: just above the threshold
    shapes = [(3 + i % 11, 5 + (7 * i) % 13) for i in range(300)] + [(2048, 129), (big,), (5,), (big + 3,)]

    def values(r: int, dtype: torch.dtype) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * r + len(str(dtype)))
        return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).double() for s in shapes]

    shared = torch.zeros(40_003, device=device())  # views at odd offsets, apart: not merged, not aligned
    offsets = [(1, 9_001), (10_003, 30_000)]
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        mine = values(rank, dtype)
        params = [torch.nn.Parameter(v.to(dtype).to(device())) for v in mine]
        conv = torch.randn(4, 6, 5, 5, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        params.append(torch.nn.Parameter(conv.to(dtype).to(device()).contiguous(memory_format=torch.channels_last)))
        if dtype == torch.float32:
            for start, stop in offsets:
                shared[start:stop] = torch.arange(start, stop, dtype=torch.float32) * (rank + 1)
            params += [torch.nn.Parameter(shared[start:stop]) for start, stop in offsets]
        everyone = [values(r, dtype) for r in range(world_size)]
        expected = [torch.stack([v[i] for v in everyone]).mean(0) for i in range(len(shapes))]
        convs = [
            torch.randn(4, 6, 5, 5, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
            for r in range(world_size)
        ]
        expected.append(torch.stack([c.to(dtype).double() for c in convs]).mean(0))
        if dtype == torch.float32:
            mean_rank = sum(r + 1 for r in range(world_size)) / world_size
            expected += [torch.arange(a, b, dtype=torch.float64) * mean_rank for a, b in offsets]
        starts = [v.to(dtype) for v in mine] + [conv.to(dtype)]
        starts += [torch.arange(a, b, dtype=torch.float32) * (rank + 1) for a, b in offsets if dtype == torch.float32]
        for cap_mb in (impl.DEFAULT_BUCKET_CAP_MB, 0.125):
            with torch.no_grad():
                for param, start in zip(params, starts, strict=True):
                    param.copy_(start)
            pointers = [(p.data_ptr(), p.stride()) for p in params]
            if on_nccl:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            dcomm_averaging.average_parameters(params, None, bucket_cap_mb=cap_mb)
            if on_nccl:
                extra = torch.cuda.max_memory_allocated() - base
                assert extra <= cap_mb * 2**20 + 2**20, f"{extra} bytes of staging over a {cap_mb} MiB cap"
            assert [(p.data_ptr(), p.stride()) for p in params] == pointers, "a parameter moved"
            for i, (p, want) in enumerate(zip(params, expected, strict=True)):
                got = p.detach().double().cpu()
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{dtype} cap {cap_mb}: parameter {i}")
    if on_nccl and tensor_table.triton is not None:
        # The staged path was taken: the recipe of the last call holds a table.
        (_, recipe), *_ = reversed(recipes._RECIPES.values())
        assert any(table is not None for d in recipe.devices for table in d.tables), "nothing was staged"


@scenario(min_world_size=2)
def scenario_averaging_replayed_as_graphs(rank: int, world_size: int) -> None:
    """NCCL: repeated calls on the same parameters are replayed as one CUDA graph, with the same answers.

    A model-like mix (fp32 and bf16 above and below the staging threshold, fp16 small ones, an
    integer counter) gets new values on every rank before each of 20 calls, written into the
    same storage; every call must give the float64 mean, including those replayed from the
    graph, the eager ones every eighth call, calls made on a side stream, and after a parameter
    is replaced (a new recipe, captured in turn), under ``DCOMM_CUDA_GRAPHS=0`` (nothing captured),
    over a new group after its predecessor was destroyed (which releases every graph first), and
    with the switch set to ``1`` as with it unset (on by default). Under gloo
    the same calls take the bucket path and must give the same answers.
    """
    import os

    from dcomm.averaging import _in_place as in_place
    from dcomm.averaging import _recipes as recipes
    from dcomm.core import captured_average

    on_nccl = dist.get_backend() == "nccl"
    recipes._GRAPHS.clear()  # earlier scenarios' graphs: counted from none
    big = in_place.STAGE_BELOW_BYTES // 4 + 333
    specs = [((big,), torch.float32), ((64, 33), torch.float32), ((300,), torch.bfloat16)]
    specs += [((big // 2 + 7,), torch.bfloat16)]
    specs += [((5 + i % 7, 3), torch.float16) for i in range(40)] + [((17 + i,), torch.float32) for i in range(60)]
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device())) for shape, dtype in specs]
    counter = torch.zeros((), dtype=torch.int64, device=device())
    params.append(counter)

    def values(r: int, call: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(7919 * call + r)
        return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).double() for shape, dtype in specs]

    def check(call: int, stream: Any = None, group: Any = None) -> None:
        with torch.no_grad():
            for param, value in zip(params, values(rank, call), strict=False):
                param.copy_(value)
            counter.fill_(10 * call + rank)
        if stream is None:
            dcomm_averaging.average_parameters(params, group)
        else:  # the caller's stream is a side stream: the average is ordered on it
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dcomm_averaging.average_parameters(params, None)
            torch.cuda.current_stream().wait_stream(stream)
        everyone = [values(r, call) for r in range(world_size)]
        for i, (param, (_, dtype)) in enumerate(zip(params, specs, strict=False)):
            want = torch.stack([v[i] for v in everyone]).mean(0)
            tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
            torch.testing.assert_close(param.detach().double().cpu(), want, rtol=tol, atol=tol, msg=f"call {call}: {i}")
        assert counter.item() == sum(10 * call + r for r in range(world_size)) // world_size, f"call {call}: counter"

    try:
        os.environ.pop(captured_average.SWITCH, None)  # unset: on by default
        for call in range(20):
            check(call, torch.cuda.Stream() if on_nccl and call in (9, 10) else None)
        graphs = recipes._GRAPHS.get(torch.device(device())) if on_nccl else None
        if graphs is not None:
            assert len(graphs[0]) == 1, "the repeated average was never captured"
            assert graphs[0]._watched_calls >= 20 - captured_average.CAPTURE_AFTER - 1, "the graph was not replayed"
        params[1] = torch.nn.Parameter(torch.zeros(specs[1][0], device=device()))  # a new tensor: a new recipe
        for call in range(20, 25):
            check(call)
        if graphs is not None:
            assert len(graphs[0]) == 2, "the new recipe was not captured"
        os.environ[captured_average.SWITCH] = "0"
        try:
            for call in range(25, 28):
                check(call)
            params[1] = torch.nn.Parameter(torch.zeros(specs[1][0], device=device()))
            for call in range(28, 32):
                check(call)  # switched off: a third recipe, never captured
        finally:
            del os.environ[captured_average.SWITCH]
        if on_nccl:
            assert len(recipes._GRAPHS[torch.device(device())][0]) == 2, "captured while switched off"
        # A group destroyed and replaced by a new one: the new group's calls are its own (never the
        # old communicator's graph), captured in turn; destroy_process_group releases every graph
        # first (a graph holding NCCL collectives alive through it hangs it).
        registry = recipes._GRAPHS[torch.device(device())][0] if on_nccl else None
        for _ in range(2):
            subgroup = dist.new_group(list(range(world_size)))
            for call in range(32, 36):
                check(call, group=subgroup)
            if registry is not None:
                assert len(registry) >= 1, "the new group's average was not captured"
            dist.destroy_process_group(subgroup)
            del subgroup
            if registry is not None:
                assert len(registry) == 0, "a graph outlived destroy_process_group"
        os.environ[captured_average.SWITCH] = "1"  # on, as by default
        for call in range(36, 40):
            check(call, group=None)
        if registry is not None:
            assert len(registry) == 1, "not captured with the switch on"
    finally:
        os.environ.pop(captured_average.SWITCH, None)


@scenario(min_world_size=2, world_size_multiple=2)
def scenario_averaging_resume_mid_run(rank: int, world_size: int) -> None:
    subgroup, _ = intra_node_subgroups()
    sizes = {2: world_size // 2, 3: world_size}

    def make(lib: Any) -> Any:
        return lib.HierarchicalModelAverager(sizes, WARMUP)

    def build(seed: int = 0) -> PostLocalSGDRun:
        return PostLocalSGDRun(implementation("dcomm"), make, subgroup, warmup=WARMUP, seed=seed, device=device())

    run = build()
    history, saved = [], {}
    for step in range(STEPS):
        if step in (2, 5):
            saved[step] = run.checkpoint()
        run.step(rank, step)
        history.append(run.params())
    run.assert_resumes(lambda: build(seed=123), rank, saved, history, "hierarchical run")


def _value_error(build: Callable[[], object]) -> str:
    """The message of the ValueError ``build`` raises; AssertionError when it raises none."""
    try:
        build()
    except ValueError as error:
        return str(error)
    raise AssertionError("a bad period_group_size_dict was accepted")


@scenario(min_world_size=2)
def scenario_averaging_bad_group_sizes(rank: int, world_size: int) -> None:
    bad = next(s for s in range(2, world_size + 2) if world_size % s)
    text = _value_error(lambda: dcomm_averaging.HierarchicalModelAverager({2: bad, 4: world_size}))
    assert text.startswith(f"period_group_size_dict: group size {bad} does not divide the world size {world_size}")
    assert "e.g. {2: " in text, text
    for wrong in ({4: world_size, 2: world_size}, {}, {2: 1, 4: 1}):
        text = _value_error(lambda wrong=wrong: dcomm_averaging.HierarchicalModelAverager(wrong))
        assert text.startswith("period_group_size_dict: "), text
    # Nothing hangs: every rank failed the same way, and the world still communicates.
    t = torch.ones(1, device=device())
    dist.all_reduce(t)
    assert t.item() == world_size
