"""The call key of average_parameters: read in C++ once built, in Python before, the same facts either way.

A kept recipe (and its CUDA graph) holds while every parameter keeps its address, element count
and dtype; the key reads those three per parameter. Both forms must tell the same changes apart,
and a rank may switch from one to the other at any call (its build finishes when it does) without
a collective of its own.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_averaging_parameters import assert_averaged, exact_mean, make_params

import dcomm.averaging._agreement as agreement
import dcomm.averaging._native_key as native_key
import dcomm.averaging._recipes as recipes
import dcomm.averaging.parameters as impl
from dcomm.core import native_build
from dcomm_testing import run_ranks

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")


def _built() -> Any:
    native_key.BUILD.wait(timeout_s=300)
    module = native_key.BUILD.module()
    assert module is not None, "the C++ key did not build (a warning says why)"
    return module


def _keys(params: list[torch.Tensor], in_cpp: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...] | None:
    with monkeypatch.context() as patch:
        if not in_cpp:
            patch.setenv(native_key.SWITCH, "0")
        return recipes._call_key(params, dist.group.WORLD, recipes._Paths())


@pytest.fixture
def world_of_one() -> Any:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@needs_compiler
@pytest.mark.timeout(320)
@pytest.mark.parametrize("in_cpp", [False, True], ids=["python", "c++"])
def test_both_keys_tell_the_same_changes_apart(
    in_cpp: bool, monkeypatch: pytest.MonkeyPatch, world_of_one: Any
) -> None:
    _built()
    buffer = torch.zeros(64)
    params = [torch.nn.Parameter(buffer[:12].view(3, 4)), torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))]
    first = _keys(params, in_cpp, monkeypatch)
    assert first is not None
    assert _keys(params, in_cpp, monkeypatch) == first
    same_storage = [torch.nn.Parameter(params[0].detach()), params[1]]  # another object, same memory
    assert _keys(same_storage, in_cpp, monkeypatch) == first, "the key reads memory, not identity"
    shrunk = [buffer[:6], params[1]]  # the same address, fewer elements
    assert _keys(shrunk, in_cpp, monkeypatch) != first
    retyped = [buffer[:12].view(torch.int32), params[1]]  # the same address and count, another dtype
    assert _keys(retyped, in_cpp, monkeypatch) != first
    moved = [buffer[1:13], params[1]]
    assert _keys(moved, in_cpp, monkeypatch) != first
    assert _keys([torch.zeros(3).to_sparse()], in_cpp, monkeypatch) is None, "no address: prepared every call"


@needs_compiler
@pytest.mark.timeout(320)
def test_cpp_where_reads_address_count_and_dtype() -> None:
    where = _built().where
    tensors = [torch.arange(6.0)[2:], torch.zeros(3, dtype=torch.float16)]
    fields = torch.frombuffer(bytearray(where(tensors)), dtype=torch.int64).tolist()
    assert fields[0::3] == [t.data_ptr() for t in tensors]
    assert fields[1::3] == [4, 3]
    assert fields[2::3] == [6, 5]  # c10::ScalarType: Float, Half
    assert where([]) == b""
    with pytest.raises(TypeError, match="item 1 is a int, not a tensor"):
        where([tensors[0], 3])


def test_switched_off_or_on_cpu_nothing_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    fresh = native_build.BackgroundBuild(Path("unused.cpp"), "dcomm_test", "a test module")
    monkeypatch.setattr(fresh, "start", lambda: started.append(1))
    monkeypatch.setattr(native_key, "BUILD", fresh)
    assert native_key.where_function([torch.zeros(2)]) is None
    assert started == [], "a CPU call started the build"
    monkeypatch.setenv(native_key.SWITCH, "0")
    assert native_key.where_function([torch.zeros(2, device="meta")]) is None
    assert started == []


def test_a_failed_build_warns_once_and_leaves_python(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_load(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(native_build, "load", failing_load)
    build = native_build.BackgroundBuild(Path("unused.cpp"), "dcomm_test", "the test module")
    with pytest.warns(RuntimeWarning, match=r"the test module could not be built \(RuntimeError: no compiler here"):
        build.wait(timeout_s=30)
    assert build.module() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build.start()  # once: no second build, no second warning
        build.wait(timeout_s=30)
    assert build.module() is None


def test_signatures_are_hashed_once_and_compare_by_value() -> None:
    sizes, dtypes = (12, 5), (torch.float32, torch.bfloat16)
    a = agreement.Signature((), sizes, dtypes)
    b = agreement.Signature((), tuple(sizes), tuple(dtypes))
    assert a == b
    assert hash(a) == hash(b)
    assert a is not b
    assert a != agreement.Signature((), (12, 6), dtypes)
    assert a != agreement.Signature((), sizes, (torch.float32, torch.float16))
    assert a != ((), sizes, dtypes)


def _switching_checks(rank: int, world: int) -> None:
    """The last rank reads its keys in Python for two calls, then in C++: its recipes are dropped
    and remade alone, with no collective of its own, and every call averages right."""
    native_key.BUILD.wait(timeout_s=300)
    assert native_key.BUILD.module() is not None
    everyone = list(range(world))
    specs = [((128,), torch.float32, False)] * 4

    def views(seed: int) -> list[torch.nn.Parameter]:
        flat = torch.cat([p.detach().reshape(-1) for p in make_params(rank, specs, seed)])
        return [torch.nn.Parameter(flat[128 * i : 128 * (i + 1)]) for i in range(4)]

    agreed: list[int] = []
    real_links, real_nccl, real_where = agreement.agreed_links, recipes.reduced_by_nccl, native_key.where_function

    def counting(*args: Any) -> list[int] | None:
        found = real_links(*args)
        agreed.extend([] if found is None else [1])
        return found

    calls = [0]

    def late_on_last_rank(params: Any) -> Any:
        return None if rank == world - 1 and calls[0] < 2 else real_where(params)

    agreement.agreed_links = counting  # type: ignore[assignment]
    recipes.reduced_by_nccl = lambda *_: True  # type: ignore[assignment]
    native_key.where_function = late_on_last_rank  # type: ignore[assignment]
    recipes._KEY_IN_CPP = False
    paths = recipes._Paths(graphs=False, pack_max_bytes=0)
    try:
        params = views(seed=60)
        for call, seed in enumerate(range(60, 65)):
            calls[0] = call
            fresh = views(seed)
            with torch.no_grad():
                for p, f in zip(params, fresh, strict=True):
                    p.copy_(f)
            kept_before = len(recipes._RECIPES)
            impl._average_parameters(params, None, impl.DEFAULT_BUCKET_CAP_MB, paths)
            assert_averaged(params, exact_mean(everyone, specs, seed=seed))
            if rank == world - 1 and call == 2:
                assert kept_before >= 1, "no recipe was kept under a Python key"
                assert len(recipes._RECIPES) == 1, "the Python-keyed recipes were kept"
        assert agreed == [1], "a rank agreed again, alone"
        assert recipes._KEY_IN_CPP
    finally:
        agreement.agreed_links, recipes.reduced_by_nccl = real_links, real_nccl  # type: ignore[assignment]
        native_key.where_function = real_where  # type: ignore[assignment]


@needs_compiler
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_switching_to_cpp_keys_alone(world: int) -> None:
    _built()  # once here, so that the ranks load it from the cache
    run_ranks(_switching_checks, world, timeout=300)
