"""The in-place (NCCL) path of average_parameters, exercised on CPU.

On NCCL the path hands each run of parameters to the group's coalesced allreduce, which NCCL runs
as one grouped launch of in-place allreduces. gloo has the same ``allreduce_coalesced`` (it sums
through a copy of its own, out of the tracked Python allocations), so the in-place code runs for
real here with the decision forced: the same runs, the same in-place division and post-division,
the same tensors (the parameters' own storage, or one view over parameters that lie back to back).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils as torch_utils
from test_averaging_parameters import MIB, SPECS, AllocationTracker, assert_averaged, exact_mean, make_params

import dcomm.averaging._agreement as agreement
import dcomm.averaging._in_place as in_place
import dcomm.averaging._layout as layout
import dcomm.averaging._recipes as recipes
import dcomm.averaging.parameters as impl
from dcomm.averaging import average_parameters
from dcomm.core import reduced_by_nccl
from dcomm_testing import device_synchronize_forbidden, run_ranks

# More parameters than one launch holds once the limits are lowered, every dtype.
MANY = [((3, 5), torch.float32, False)] * 9 + [((7,), torch.bfloat16, False)] * 5 + [((4,), torch.float16, False)] * 4


def forced(
    params: list[torch.nn.Parameter],
    group: Any = None,
    *,
    calls: list[list[torch.Tensor]] | None = None,
    launch_max_tensors: int = in_place._LAUNCH_MAX_TENSORS,
    bucket_cap_mb: float = impl.DEFAULT_BUCKET_CAP_MB,
    pack_max_bytes: int = 0,
    small_min_tensors: int = 2,
) -> None:
    """average_parameters with the in-place path forced; ``calls`` gets the tensors of each in-place call.

    Small parameters are not packed unless ``pack_max_bytes`` says so (see test_small_ones_packed),
    and then from two of them on unless ``small_min_tensors`` says otherwise.
    """
    paths = recipes._Paths(True, launch_max_tensors, None if calls is None else calls.append, pack_max_bytes)
    paths = paths._replace(small_min_tensors=small_min_tensors)
    impl._average_parameters(params, group, bucket_cap_mb, paths)


def _pointers(params: list[torch.nn.Parameter]) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
    return [(p.data_ptr(), p.dtype, p.stride()) for p in params]


def _in_place_checks(rank: int, world: int) -> None:
    everyone = list(range(world))

    # Mixed dtypes and a channels-last layout, in place, against the float64 mean: no parameter
    # moved, not one byte allocated (no bucket, no flat copy), whatever the launch sizes.
    for limit in [in_place._LAUNCH_MAX_TENSORS, 3, 1]:
        for specs, seed in [(SPECS, 0), (MANY, 1)]:
            params = make_params(rank, specs, seed)
            before = _pointers(params)
            calls: list[list[torch.Tensor]] = []
            with AllocationTracker() as mem:
                forced(params, None, calls=calls, launch_max_tensors=limit, bucket_cap_mb=64 / MIB)
            assert calls, "the in-place path was not taken"
            assert mem.peak == 0, f"the in-place path allocated {mem.peak} bytes"
            assert _pointers(params) == before, "not in place"
            assert_averaged(params, exact_mean(everyone, specs, seed))

    # fp32: torch's arithmetic (divide, then SUM), against torch's average_parameters (bit for bit
    # on gloo, whose coalesced allreduce sums the same concatenation torch builds).
    fp32 = [((5, 3), torch.float32, False), ((17,), torch.float32, False), ((2, 2), torch.float32, False)]
    ours, theirs = make_params(rank, fp32, seed=7), make_params(rank, fp32, seed=7)
    forced(ours, None)
    torch_utils.average_parameters(iter(theirs), dist.group.WORLD)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)

    # fp16 near the top of its range on this path too: divided by the group size before the SUM,
    # finite and bit-identical to torch (a partial pre-division overflowed at 4 ranks).
    values = [torch.full((6,), 60000.0 - 1000.0 * rank), torch.full((3,), -50000.0 + 7.0 * rank)]
    ours, theirs = [torch.nn.Parameter(v.half()) for v in values], [torch.nn.Parameter(v.half()) for v in values]
    forced(ours, None)
    torch_utils.average_parameters(iter(theirs), dist.group.WORLD)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.isfinite(a).all(), (world, a)
        assert torch.equal(a, b), (world, a, b)

    # A flattened model: parameters carved back to back out of one buffer are one allreduce of
    # one view over all of them; a gap splits them into two.
    for gap, runs in [(0, 1), (3, 2)]:
        flat = torch.cat([p.detach().reshape(-1) for p in make_params(rank, fp32, seed=8)])
        flat = torch.cat([flat[:15], torch.full((gap,), 7.0), flat[15:]]) if gap else flat
        starts = [0, 15 + gap, 32 + gap]
        shapes = [shape for shape, _, _ in fp32]
        params = [
            torch.nn.Parameter(flat[s:].narrow(0, 0, sh.numel()).view(sh))
            for s, sh in zip(starts, map(torch.Size, shapes), strict=True)
        ]
        calls = []
        forced(params, None, calls=calls)
        assert [len(c) for c in calls] == [runs]
        assert all(p.data_ptr() == flat[s:].data_ptr() for p, s in zip(params, starts, strict=True))
        assert_averaged(params, exact_mean(everyone, fp32, seed=8))
        if gap:
            assert torch.equal(flat[15 : 15 + gap], torch.full((gap,), 7.0)), "the gap was averaged"

    # The internal function directly: every tensor averaged in its storage.
    params = make_params(rank, [((6,), torch.float32, False)] * 4, seed=9)
    before = [p.data_ptr() for p in params]
    with torch.no_grad():
        in_place._average_in_place(list(params), dist.group.WORLD)
    assert [p.data_ptr() for p in params] == before
    assert_averaged(params, exact_mean(everyone, [((6,), torch.float32, False)] * 4, seed=9))

    # A subgroup on the in-place path: members average among themselves, others change nothing.
    members = [0, 1] if world > 2 else [0]
    group = dist.new_group(members)
    params = make_params(rank, seed=3)
    forced(params, group)
    if rank in members:
        assert_averaged(params, exact_mean(members, seed=3))
    else:
        for p, mine in zip(params, make_params(rank, seed=3), strict=True):
            assert torch.equal(p, mine)

    # Parameters that alias each other are divided once each through the buckets, never in place.
    base = torch.arange(12, dtype=torch.float64) * (rank + 1)
    storage = base.float()
    params = [torch.nn.Parameter(storage[0:8]), torch.nn.Parameter(storage[4:12])]
    calls = []
    forced(params, None, calls=calls)
    assert calls == []
    mean = torch.arange(12, dtype=torch.float64) * (world + 1) / 2
    torch.testing.assert_close(storage.double(), mean)

    # No device synchronize on the in-place path either.
    with device_synchronize_forbidden("average_parameters"):
        forced(make_params(rank), None)


@pytest.mark.parametrize("world", [2, 4])
def test_in_place_path(world: int) -> None:
    run_ranks(_in_place_checks, world)


def _decision_checks(rank: int, world: int) -> None:
    # gloo: never in place (NCCL only), on the CPU or for tensors on another device type.
    assert not reduced_by_nccl(dist.group.WORLD, torch.zeros(1))
    assert not reduced_by_nccl(dist.group.WORLD, torch.device("meta"))

    # gloo, unpatched: the bucket path, exactly as before (one staging buffer of the bytes).
    params = make_params(rank, [((5, 3), torch.float32, False), ((17,), torch.float32, False)], seed=2)
    with AllocationTracker() as mem:
        average_parameters(params, None)
    assert mem.peak == (15 + 17) * 4


def test_decision() -> None:
    run_ranks(_decision_checks, 2)


def _sizes(chunks: Iterator[list[torch.Tensor]]) -> list[list[int]]:
    return [[t.numel() for t in chunk] for chunk in chunks]


def _merged(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    spans = [(t.data_ptr(), t.nbytes) for t in tensors]
    regions = layout.memory_regions(tensors)  # on the CPU: each tensor's storage
    return layout._merged(tensors, layout.chains(layout.successors(spans, regions)))


def _overlap(tensors: list[torch.Tensor]) -> bool:
    return layout._overlap([(t.data_ptr(), t.nbytes) for t in tensors])


def _launches_checks(rank: int, world: int) -> None:
    """One coalesced allreduce per 1024 tensors (fewer, larger NCCL launches are faster)."""
    launches: list[int] = []
    group = dist.group.WORLD
    real = type(group).allreduce_coalesced

    def counting(self: Any, tensors: list[torch.Tensor], options: Any) -> Any:
        launches.append(len(tensors))
        return real(self, tensors, options)

    specs = [((2,), torch.float32, False)] * 7
    for limit, expected in [(1024, [7]), (3, [3, 3, 1])]:
        launches.clear()
        params = make_params(rank, specs, seed=11)
        type(group).allreduce_coalesced = counting  # type: ignore[method-assign]
        try:
            forced(params, None, launch_max_tensors=limit)
        finally:
            type(group).allreduce_coalesced = real  # type: ignore[method-assign]
        assert launches == expected
        assert_averaged(params, exact_mean(list(range(world)), specs, seed=11))


def test_launches() -> None:
    run_ranks(_launches_checks, 2)


# Small (<= 64 KiB) parameters of every in-place dtype among large ones, in mixed order.
PACKING = [
    ((64, 300), torch.float32, False),  # 75 KiB: large
    ((7,), torch.float32, False),
    ((3, 5), torch.float32, False),
    ((129, 128), torch.float32, False),  # 64.5 KiB: large
    ((11,), torch.float32, False),
    ((9,), torch.bfloat16, False),
    ((2, 3), torch.bfloat16, False),
    ((5,), torch.float16, False),
    ((40000,), torch.float16, False),  # 78 KiB: large
    ((6,), torch.float16, False),
]


def _packing_checks(rank: int, world: int) -> None:
    everyone = list(range(world))
    group = dist.group.WORLD
    real_coalesced, real_single = type(group).allreduce_coalesced, type(group).allreduce
    launches: list[list[int]] = []
    singles: list[int] = []

    def counting(self: Any, tensors: list[torch.Tensor], options: Any) -> Any:
        launches.append([t.numel() for t in tensors])
        return real_coalesced(self, tensors, options)

    def counting_single(self: Any, tensors: list[torch.Tensor], options: Any) -> Any:
        singles.append(sum(t.numel() for t in tensors))
        return real_single(self, tensors, options)

    def averaged(**options: Any) -> tuple[list[torch.nn.Parameter], AllocationTracker]:
        """PACKING's parameters averaged in place by ``forced(**options)``, collectives counted; the allocations."""
        params = make_params(rank, PACKING, seed=21)
        before = _pointers(params)
        launches.clear()
        singles.clear()
        type(group).allreduce_coalesced = counting  # type: ignore[method-assign]
        type(group).allreduce = counting_single  # type: ignore[method-assign]
        try:
            with AllocationTracker() as mem:
                forced(params, None, **options)
        finally:
            type(group).allreduce_coalesced = real_coalesced  # type: ignore[method-assign]
            type(group).allreduce = real_single  # type: ignore[method-assign]
        assert _pointers(params) == before, "a parameter moved"
        assert_averaged(params, exact_mean(everyone, PACKING, seed=21))
        return params, mem

    # (cap, the fp32 launch, the packed elements per dtype (fp32, bf16, fp16), the packed bytes):
    # the grouped launch holds the large ones (and small ones that did not fit); the packed small
    # ones follow it as one allreduce of their own.
    cases = [
        (in_place.PACK_MAX_BYTES, [64 * 300, 129 * 128], [7 + 15 + 11, 9 + 6, 5 + 6]),
        (100, [64 * 300, 129 * 128, 11], [7 + 15, 9 + 6, 5 + 6]),  # 11 floats don't fit
        (4, [64 * 300, 7, 15, 129 * 128, 11], []),  # nothing fits: nothing packed or allocated
    ]
    # bucket_cap_mb bounds the pack too: 100 bytes of bucket pack as a 100-byte cap does.
    cases = [(cap, launch, packed, impl.DEFAULT_BUCKET_CAP_MB) for cap, launch, packed in cases]
    cases.append((in_place.PACK_MAX_BYTES, cases[1][1], cases[1][2], 100 / MIB))
    for cap, fp32_launch, packed, bucket_mb in cases:
        _, mem = averaged(pack_max_bytes=cap, bucket_cap_mb=bucket_mb)
        assert launches[0] == fp32_launch
        assert singles == packed
        # Extra memory: the packed buffers only (gloo may hold one until its next collective).
        sizes = [n * size for n, size in zip(packed, (4, 2, 2), strict=False)]
        assert (sizes[0] if sizes else 0) <= mem.peak <= sum(sizes), (cap, mem.peak)

    # By default fewer than SMALL_MIN_TENSORS small ones (here 3, 2 and 2 per dtype) are neither
    # packed nor staged: they go in the grouped launch with the large ones, with no memory at all.
    assert in_place.SMALL_MIN_TENSORS > 3
    _, mem = averaged(pack_max_bytes=in_place.PACK_MAX_BYTES, small_min_tensors=in_place.SMALL_MIN_TENSORS)
    assert launches[0] == [64 * 300, 7, 15, 129 * 128, 11]
    assert singles == []
    assert mem.peak == 0


def test_small_ones_packed() -> None:
    run_ranks(_packing_checks, 3)


def test_merge_adjacent() -> None:
    flat = torch.arange(20.0)
    pieces = [flat[0:6].view(2, 3), flat[6:10], flat[10:20]]
    (merged,) = _merged(pieces)
    assert merged.data_ptr() == flat.data_ptr()
    assert merged.shape == (20,)
    merged.add_(1)  # a view, not a copy
    assert flat[0].item() == 1
    backwards = pieces[::-1]  # listed out of memory order: joined all the same, in memory order
    (joined,) = _merged(backwards)
    assert (joined.data_ptr(), joined.shape) == (flat.data_ptr(), (20,))
    apart = [flat[0:5], flat[6:10], flat[10:20]]
    out = _merged(apart)
    assert [t.numel() for t in out] == [5, 14]
    assert out[0] is apart[0]
    separate = [torch.zeros(3), torch.zeros(3)]
    assert all(a is b for a, b in zip(_merged(separate), separate, strict=True))


def test_links_stay_within_a_region() -> None:
    # (address, bytes): 0 -> 1 back to back; 2 starts where 1 ends but in another region; 3 after a gap.
    spans = [(1024, 512), (1536, 512), (2048, 512), (2600, 8)]
    assert layout.successors(spans, ["a", "a", "b", "b"]) == [1, -1, -1, -1]
    assert layout.successors(spans, ["a"] * 4) == [1, 2, -1, -1]
    assert layout.successors(spans[::-1], ["a"] * 4) == [-1, -1, 1, 2]  # found by address, not position
    assert layout.chains([1, 2, -1, -1]) == [[0, 1, 2], [3]]
    assert layout.chains([-1, -1, 1, 2]) == [[0], [3, 2, 1]]  # each chain in memory order
    assert layout.chains([-1] * 3) == [[0], [1], [2]]
    # Off CUDA a tensor's region is its storage: separate CPU tensors never join, whatever their addresses.
    a, b = torch.zeros(4), torch.zeros(4)
    assert layout.memory_regions([a, b]) == [("storage", a.data_ptr()), ("storage", b.data_ptr())]


def _agreement_checks(rank: int, world: int) -> None:
    """On NCCL the ranks keep only the links every rank has (here gloo stands in, regions faked per rank)."""
    tensors = [torch.zeros(128) for _ in range(5)]  # 512 bytes each: a whole allocator block
    spans = [(4096 * i, 512) for i in range(5)]  # not back to back on their own: the faked links decide
    # Every rank links 0 -> 1; only rank 0 links 1 -> 2; each rank links 3 to a different successor.
    links = {0: [1, 2, -1, 4, -1], 1: [1, -1, -1, -1, -1]}.get(rank, [1, -1, -1, 2 + rank % 3, -1])

    def fake(*_: Any) -> list[int]:
        return links

    # No byte count a multiple of 512: nothing can follow a tensor in its allocation, no collective.
    odd = [torch.zeros(5) for _ in range(5)]
    real = agreement.successors
    agreement.successors = fake
    try:
        agreed = agreement.agreed_links(tensors, spans, dist.group.WORLD, by_nccl=True)
        off_nccl = agreement.agreed_links(tensors, spans, dist.group.WORLD, by_nccl=False)  # no collective
        unaligned = agreement.agreed_links(odd, spans, dist.group.WORLD, by_nccl=True)
        alone = agreement.agreed_links(tensors[:1], spans[:1], dist.group.WORLD, by_nccl=True)
    finally:
        agreement.successors = real
    assert agreed == [1, -1, -1, -1, -1]
    assert off_nccl is None
    assert unaligned is None
    assert alone is None
    # Without an agreement views of one storage join (alike on every rank), separate storages never.
    flat = torch.zeros(12)
    views = [flat[0:4], flat[4:8], torch.zeros(4), flat[8:12]]
    view_spans = [(t.data_ptr(), t.nbytes) for t in views]
    assert agreement.local_links(views, view_spans, None) == [1, 3, -1, -1]
    assert agreement.local_links(views, view_spans, [2, -1, -1, -1]) == [2, -1, -1, -1]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_on_joined_tensors(world: int) -> None:
    run_ranks(_agreement_checks, world)


def _remade_alone_checks(rank: int, world: int) -> None:
    """A rank that remakes its recipe alone agrees on nothing alone, and averages a chain broken on it through a buffer.

    gloo stands in for NCCL (the ranks agree on the joins; separate CPU storages never join, so
    the parameters are views of one buffer on every rank). Without the signature's agreement, the
    rank remaking its recipe would run the agreement's allreduce while the others average: the
    collectives would not match.
    """
    everyone = list(range(world))
    specs = [((128,), torch.float32, False)] * 4  # 512 bytes each: back to back in one buffer

    def views(seed: int) -> list[torch.nn.Parameter]:
        flat = torch.cat([p.detach().reshape(-1) for p in make_params(rank, specs, seed)])
        return [torch.nn.Parameter(flat[128 * i : 128 * (i + 1)]) for i in range(4)]

    agreed: list[int] = []
    real_links, real_nccl = agreement.agreed_links, recipes.reduced_by_nccl

    def counting(*args: Any) -> list[int] | None:
        found = real_links(*args)
        agreed.extend([] if found is None else [1])
        return found

    agreement.agreed_links = counting  # type: ignore[assignment]
    recipes.reduced_by_nccl = lambda *_: True  # type: ignore[assignment]
    paths = recipes._Paths(graphs=False, pack_max_bytes=0)
    calls: list[list[torch.Tensor]] = []
    paths = paths._replace(on_in_place=calls.append)
    try:
        params = views(seed=41)
        impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
        assert agreed == [1], "the ranks did not agree on the joins"
        assert [[t.numel() for t in c] for c in calls] == [[512]], "the back-to-back views were not joined"
        assert_averaged(params, exact_mean(everyone, specs, seed=41))

        # The last rank alone forgets its recipes (a new model that reused the old one's addresses
        # on some ranks only remakes them there): it follows the kept agreement, with no collective.
        for call, seed in enumerate((42, 43)):
            fresh = views(seed)
            with torch.no_grad():
                for p, f in zip(params, fresh, strict=True):
                    p.copy_(f)
            if rank == world - 1 and call == 0:
                recipes._RECIPES.clear()
            impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert_averaged(params, exact_mean(everyone, specs, seed=seed))
        assert agreed == [1], "a rank agreed again, alone"

        # The last rank alone gives the third parameter new storage: the chain is broken there.
        if rank == world - 1:
            params[2].data = params[2].data.clone()
        storage = [p.data_ptr() for p in params]
        calls.clear()
        for seed in (44, 45):
            fresh = views(seed)
            with torch.no_grad():
                for p, f in zip(params, fresh, strict=True):
                    p.copy_(f)
            impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert_averaged(params, exact_mean(everyone, specs, seed=seed))
        assert agreed == [1], "a rank agreed again, alone"
        assert [[t.numel() for t in c] for c in calls] == [[512]] * 2, "not one allreduce of all four"
        assert [p.data_ptr() for p in params] == storage, "a parameter moved"
        broken = calls[0][0].data_ptr() not in storage
        assert broken == (rank == world - 1), "only the rank whose chain broke averages through a buffer"

        # Agreements are kept within a bound, dropped alike on every rank (each call looks its signature up).
        kept, agreement.KEPT = agreement.KEPT, 2
        try:
            lists = [params[:count] for count in (2, 3, 4)]
            for round_ in range(2):
                for some in lists:
                    if rank == 0 and round_ == 1:
                        recipes._RECIPES.clear()  # rank 0 remakes every recipe; the others keep theirs
                    impl._average_parameters(some, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert len(agreement._AGREEMENTS[dist.group.WORLD]) == 2
        finally:
            agreement.KEPT = kept
        counts: list[Any] = [None] * world
        dist.all_gather_object(counts, len(agreed))
        assert counts == [7] * world, counts  # 1 + 3 + 3 agreements, the same on every rank

        # Parameters that aliased each other when their signature was agreed (no in-place group
        # then, so no links) and no longer do: views of one storage alone join, no new collective.
        flat = torch.arange(8, dtype=torch.float32) * (rank + 1)
        impl._average_parameters([flat[0:6], flat[2:8]], None, impl.DEFAULT_BUCKET_CAP_MB, paths)
        separate = [torch.full((6,), float(rank)), torch.full((6,), float(2 * rank))]
        impl._average_parameters(separate, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
        assert len(agreed) == 7, "the ranks agreed again"
        torch.testing.assert_close(separate[0], torch.full((6,), (world - 1) / 2))
        torch.testing.assert_close(separate[1], torch.full((6,), float(world - 1)))

        # Agreements belong to the group object: a new group over the same ranks agrees anew.
        fresh = views(seed=46)
        impl._average_parameters(fresh, dist.new_group(list(range(world))), impl.DEFAULT_BUCKET_CAP_MB, paths)
        assert len(agreed) == 8, "a new group reused another group's agreement"
        assert_averaged(fresh, exact_mean(everyone, specs, seed=46))
    finally:
        agreement.agreed_links, recipes.reduced_by_nccl = real_links, real_nccl  # type: ignore[assignment]


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_remaking_its_recipe_alone(world: int) -> None:
    run_ranks(_remade_alone_checks, world)


def test_overlap() -> None:
    flat = torch.zeros(20)
    assert not _overlap([flat[0:10], flat[10:20], torch.zeros(3)])  # a flattened model
    assert _overlap([flat[0:10], flat[9:20]])
    assert _overlap([flat[0:20], flat[2:3], flat[15:16]])
    assert _overlap([flat.view(4, 5)[1].view(-1), flat.view(-1)])
    assert not _overlap([torch.zeros(5), torch.zeros(5)])


def _recipe_checks(rank: int, world: int) -> None:
    """A call's checks and path decisions are reused only while the same parameters keep their storage."""
    everyone = list(range(world))
    prepared: list[int] = []
    densified: list[int] = []
    # Patched where they are looked up: parameters calls _prepare, the recipes call _dense.
    real, real_dense = impl._prepare, recipes._dense

    def counting(*args: Any) -> Any:
        prepared.append(1)
        return real(*args)

    def counting_dense(param: torch.Tensor) -> torch.Tensor:
        densified.append(id(param))
        return real_dense(param)

    impl._prepare = counting  # type: ignore[assignment]
    recipes._dense = counting_dense  # type: ignore[assignment]
    try:
        for path in (True, False):  # in place (forced) and the buckets
            params = make_params(rank, SPECS, seed=31)
            paths = recipes._Paths(in_place=path)
            prepared.clear()
            densified.clear()
            impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            expected = sorted(id(p) for p in params if p.numel())  # an empty parameter is skipped
            assert sorted(densified) == expected, "a dense view was made twice, or never"
            for _ in range(2):
                impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert len(prepared) == 1, "the same parameters were prepared again"
            assert_averaged(params, exact_mean(everyone, SPECS, seed=31))
            # New storage for one parameter (float32 -> float64): prepared anew, averaged right.
            fresh = make_params(rank, SPECS, seed=32)
            assert params[0].dtype == torch.float32
            params[0].data = fresh[0].detach().to(torch.float64)
            impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert len(prepared) == 2
            mean = exact_mean(everyone, SPECS, seed=32)[0]
            torch.testing.assert_close(params[0].detach(), mean, rtol=1e-6, atol=1e-6)
            # Another list (one parameter fewer): prepared anew.
            impl._average_parameters(params[:-1], None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert len(prepared) == 3
            # Both lists in turn (parameter groups, a hierarchy's levels): each keeps its recipe.
            for _ in range(3):
                impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
                impl._average_parameters(params[:-1], None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert len(prepared) == 3, "a recipe was forgotten when another list came in between"
            # The same storage in another shape (same bytes): the recipe holds. Fewer bytes: prepared anew.
            wide = next(p for p in params if p.dim() >= 2)
            wide.data = wide.data.reshape(-1)
            impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert len(prepared) == 3
            wide.data = wide.data[:-1]
            impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert len(prepared) == 4
            # The kept recipes are bounded: the least recently used goes first.
            kept, recipes._RECIPES_KEPT = recipes._RECIPES_KEPT, 3
            try:
                lists = [params[:count] for count in range(2, 7)]
                for some in lists:
                    impl._average_parameters(some, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
                assert len(recipes._RECIPES) == 3
                before = len(prepared)
                impl._average_parameters(lists[-1], None, impl.DEFAULT_BUCKET_CAP_MB, paths)
                assert len(prepared) == before, "a recent recipe was dropped"
                impl._average_parameters(lists[0], None, impl.DEFAULT_BUCKET_CAP_MB, paths)
                assert len(prepared) == before + 1, "an old recipe was kept past the bound"
            finally:
                recipes._RECIPES_KEPT = kept
        # A bad parameter still raises on every call, before any collective.
        bad = [torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))]
        for _ in range(2):
            with pytest.raises(ValueError, match="complex"):
                average_parameters(bad, None)
    finally:
        impl._prepare, recipes._dense = real, real_dense  # type: ignore[assignment]


def test_recipe_reused_while_parameters_keep_their_storage() -> None:
    run_ranks(_recipe_checks, 2)
