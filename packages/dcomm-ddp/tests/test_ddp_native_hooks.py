"""The C++ fast path: ``dcomm.ddp.register_comm_hook``, the C++ hooks it registers, and their build.

``register_comm_hook(ddp, state, hook, native=True)`` puts a C++ hook on DDP's reducer for
``fp16_compress_hook`` and ``bf16_compress_hook`` (and the ZeRO overlap hooks); ``native=False``,
and any other hook (``allreduce_hook`` among them), registers the Python hook. Both must give
torch's parameters, bit for bit, the C++ path must not enter the Python hook for a dense real
bucket, and every rank must take the same path.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import dcomm.ddp
import dcomm.ddp.default_hooks as default_hooks
from dcomm.core import native_build
from dcomm.core.native_build import BuildLock, NativeBuildError, missing_prerequisite
from dcomm.ddp import allreduce_hook, bf16_compress_hook, fp16_compress_hook, native_hooks, register_comm_hook
from dcomm_testing import assert_close, assert_same_on_ranks, recorded_calls, run_ranks, seeded_batch, seeded_mlp

STEPS = 3
BUCKET_CAPS = [0.0003] * 8  # every parameter in a bucket of its own
HAS_COMPILER = shutil.which(os.environ.get("CXX") or "c++") is not None


class Mixed(nn.Module):
    """Parameters of several dtypes (one bucket dtype each) and, optionally, a complex one."""

    def __init__(self, dtype: torch.dtype, complex_layer: bool = False) -> None:
        super().__init__()
        self.body = seeded_mlp(6, 12, 3, dtype=dtype)
        self.other = seeded_mlp(6, 3, dtype=torch.float64)
        torch.manual_seed(3)
        self.spin = nn.Parameter(torch.randn(3, dtype=torch.complex64)) if complex_layer else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x).float().pow(2).sum() + self.other(x.double()).pow(2).sum()
        if self.spin is not None:
            out = out + (self.spin * x[:, :3].to(torch.complex64)).abs().pow(2).sum()
        return out


def train(hook: Callable, state: object, dtype: torch.dtype, native: bool, complex_layer: bool = False) -> tuple:
    """Parameters after STEPS steps, how many times the Python hook ran, and the path taken."""
    rank = dist.get_rank()
    # _check_group: the first thing every Python hook call does.
    with recorded_calls(default_hooks, "_check_group", lambda group, name: name) as calls:
        net = Mixed(dtype, complex_layer)
        ddp = DDP(net, bucket_cap_mb_list=BUCKET_CAPS)
        path = register_comm_hook(ddp, state, hook, native=native)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            opt.zero_grad()
            ddp(seeded_batch(rank, step, (5, 6), dtype=dtype)).backward()
            opt.step()
    return [p.detach().clone() for p in net.parameters()], len(calls), path


def _torch_bf16(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return torch_hooks.bf16_compress_hook(process_group, bucket)  # DDP refuses its name on gloo


TORCH_TWIN = {
    fp16_compress_hook: torch_hooks.fp16_compress_hook,
    bf16_compress_hook: _torch_bf16,
}


def _native_matches_python_and_torch(rank: int, world: int) -> None:
    assert native_hooks.native_hooks_available()
    groups = [None]
    if world == 4:  # also over a subgroup: pairs [0, 1] and [2, 3]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append(pairs[rank // 2])
    cases = [
        (hook, dtype)
        for hook in (fp16_compress_hook, bf16_compress_hook)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    ]
    for group in groups:
        for hook, dtype in cases:
            what = f"{hook.__name__}, {dtype} model, group {'WORLD' if group is None else 'pair'}"
            ours, python_calls, path = train(hook, group, dtype, native=True)
            reference, reference_calls, reference_path = train(hook, group, dtype, native=False)
            assert (path, reference_path) == ("native", "python"), what
            assert python_calls == 0, f"{what}: the C++ hook entered the Python hook {python_calls} times"
            assert reference_calls >= 2 * STEPS, f"{what}: the Python hook ran {reference_calls} times"
            assert_close(ours, reference, 0.0, what)
            assert_close(ours, train(TORCH_TWIN[hook], group, dtype, native=False)[0], 0.0, f"{what} vs torch's")
            assert_same_on_ranks(ours, what, group)
    # allreduce_hook has no C++ twin (it measured no faster): the Python hook even with native=True.
    ours, python_calls, path = train(allreduce_hook, None, torch.float32, native=True)
    assert path == "python"
    assert python_calls >= 2 * STEPS, python_calls
    assert_close(ours, train(torch_hooks.allreduce_hook, None, torch.float32, native=False)[0], 0.0, "allreduce")


@pytest.mark.timeout(400)
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_native_and_python_hooks_match_torch_bit_for_bit(world: int) -> None:
    run_ranks(_native_matches_python_and_torch, world, timeout=360)


def _complex_and_sparse(rank: int, world: int) -> None:
    # DDP buckets a complex gradient as its real view: it stays in C++, with torch's results.
    ours, python_calls, _ = train(fp16_compress_hook, None, torch.float32, native=True, complex_layer=True)
    assert python_calls == 0, python_calls
    torchs, _, _ = train(torch_hooks.fp16_compress_hook, None, torch.float32, native=False, complex_layer=True)
    assert_close(ours, torchs, 0.0, "fp16_compress_hook with a complex parameter vs torch's")
    # A sparse gradient's bucket goes to the Python hook, which refuses it as it does without C++.
    for native in (True, False):
        ddp = DDP(nn.Embedding(10, 3, sparse=True))
        assert register_comm_hook(ddp, None, fp16_compress_hook, native=native) == ("native" if native else "python")
        with pytest.raises(ValueError, match="this bucket holds a sparse gradient"):
            ddp(torch.tensor([rank, rank + 1, 7])).pow(2).sum().backward()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("world", [2, 3])
def test_complex_in_cpp_and_sparse_buckets_in_the_python_hook(world: int) -> None:
    run_ranks(_complex_and_sparse, world, timeout=240)


def _cannot_build() -> ModuleType:
    raise NativeBuildError("the C++ DDP hooks", "no C++ compiler ('c++' not found)", "install g++ or set CXX to one")


def _one_rank_cannot_build(rank: int, world: int) -> list[str]:
    """Rank 1 cannot build: every rank takes the Python path (None), or raises (True); the paths taken."""
    load = _cannot_build if rank == 1 else native_hooks.load_native_hooks
    paths = []
    for hook in (fp16_compress_hook, bf16_compress_hook):
        ddp = DDP(seeded_mlp(6, 12, 3), bucket_cap_mb_list=BUCKET_CAPS)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            paths.append(register_comm_hook(ddp, None, hook, _load=load))
        told = [str(w.message) for w in said if "dcomm.ddp" in str(w.message)]
        # Once per job: on rank 1, which knows why, for the first hook only; nowhere else.
        if rank == 1 and hook is fp16_compress_hook:
            assert len(told) == 1, told
            assert "no C++ compiler ('c++' not found); install g++" in told[0], told
            assert "or pass native=False" in told[0], told
        else:
            assert told == [], told
        ddp(seeded_batch(rank, 0, (5, 6))).sum().backward()  # the Python hook runs on every rank: no hang
        with pytest.raises(RuntimeError) as refused:
            register_comm_hook(
                DDP(seeded_mlp(6, 3), bucket_cap_mb_list=BUCKET_CAPS), None, hook, native=True, _load=load
            )
        message = str(refused.value)
        assert "native=True: the C++ DDP hooks cannot be used on rank(s) [1]" in message, message
        assert "native=None" in message, message
        if rank == 1:  # the rank that knows why names the cause and the fix
            assert "no C++ compiler ('c++' not found); install g++ or set CXX" in message, message
    # Hooks without a C++ twin: the Python hook, without a collective (rank 1 would be alone in it).
    state = dcomm.ddp.PostLocalSGDState(None, None, start_localSGD_iter=10)
    for hook, hook_state in ((dcomm.ddp.post_localSGD_hook, state), (allreduce_hook, None)):
        ddp = DDP(seeded_mlp(6, 3), bucket_cap_mb_list=BUCKET_CAPS)
        paths.append(register_comm_hook(ddp, hook_state, hook, native=True, _load=load))
    return paths


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_takes_the_same_path_when_one_rank_cannot_build(world: int) -> None:
    assert run_ranks(_one_rank_cannot_build, world, timeout=240) == [["python"] * 4] * world


def _bad_arguments(rank: int, world: int) -> None:
    with pytest.raises(TypeError, match=r"ddp_model: expected a torch.nn.parallel.DistributedDataParallel, got Linear"):
        register_comm_hook(nn.Linear(2, 2), None, allreduce_hook)  # type: ignore[arg-type]
    ddp = DDP(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"native: expected True, False or None, got 'yes'"):
        register_comm_hook(ddp, None, allreduce_hook, native="yes")  # type: ignore[arg-type]
    assert register_comm_hook(ddp, None, allreduce_hook, native=False) == "python"
    with pytest.raises(RuntimeError, match="can only be called once"):  # DDP's own refusal, as before
        register_comm_hook(ddp, None, allreduce_hook, native=False)


def test_bad_arguments_are_named() -> None:
    run_ranks(_bad_arguments, 1)


# -- the build --------------------------------------------------------------------------------------


def test_each_missing_prerequisite_is_named_with_its_fix(tmp_path: Path) -> None:
    here = tmp_path / "build"
    found = shutil.which
    assert missing_prerequisite(here, compiler="no-such-c++") == (
        "no C++ compiler ('no-such-c++' not found)",
        "install g++ (apt-get install g++) or set CXX to one",
    )
    cause, fix = missing_prerequisite(here, compiler=sys.executable, python_include=tmp_path)  # type: ignore[misc]
    assert cause == f"no Python headers ({tmp_path / 'Python.h'} is missing)", cause
    assert fix.startswith("install python3-dev (python3."), fix
    (tmp_path / "Python.h").touch()
    a_file = tmp_path / "file"
    a_file.touch()
    cause, fix = missing_prerequisite(a_file / "build", compiler=sys.executable, python_include=tmp_path)  # type: ignore[misc]
    assert (cause, fix) == (
        f"the build cache {a_file} is not writable",
        "set TORCH_EXTENSIONS_DIR to a writable directory",
    )
    no_ninja = lambda name: None if name == "ninja" else found(name)  # noqa: E731
    problem = missing_prerequisite(
        here,
        compiler=sys.executable,
        python_include=tmp_path,
        which=no_ninja,
        ninja_fix="pip install dcomm-ddp[native]",
    )
    assert problem == ("no ninja (torch's extension builder runs it)", "pip install dcomm-ddp[native]")
    assert missing_prerequisite(here, compiler=sys.executable, python_include=tmp_path, which=lambda name: name) is None


def test_a_build_warns_once_and_a_failed_build_names_its_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "example.cpp"
    source.write_text("// an example")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "missing_prerequisite", lambda *args, **kwargs: None)
    built = ModuleType("built")
    monkeypatch.setattr(native_build, "_build", lambda name, source, directory: built)
    with pytest.warns(UserWarning, match=r"^building dcomm's example module \(about 40 s, once per torch/Python\); "):
        assert native_build.load(source, "dcomm_test", "the example module", prebuild="python -m x") is built
    assert not list((tmp_path / "cache").glob("*/dcomm.lock")), "the build lock was left behind"

    def failing(name: str, source: Path, directory: Path) -> ModuleType:
        raise RuntimeError("Error building extension 'x'\nexample.cpp:1: error: expected ';'")

    monkeypatch.setattr(native_build, "_build", failing)
    source.write_text("// another example")  # another module: not warned about yet
    with pytest.raises(NativeBuildError) as failed, pytest.warns(UserWarning, match="building dcomm's"):
        native_build.load(source, "dcomm_test", "the example module", prebuild="python -m x")
    assert str(failed.value) == (
        "the example module cannot be built: the build failed (RuntimeError: Error building extension 'x' | "
        "example.cpp:1: error: expected ';'); run `python -m x` to see the compiler's output"
    )
    monkeypatch.setattr(native_build, "missing_prerequisite", lambda *args, **kwargs: ("no ninja", "pip install ninja"))
    with pytest.raises(NativeBuildError, match=r"^the example module cannot be built: no ninja; pip install ninja$"):
        native_build.load(source, "dcomm_test", "the example module")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_builds_lock_is_never_taken_and_a_dead_ones_is(tmp_path: Path) -> None:
    from dcomm.core import host_identity

    lock = tmp_path / BuildLock.NAME
    looks: list[float] = []

    def give_up_after_three(seconds: float) -> None:
        looks.append(seconds)
        if len(looks) == 3:
            raise TimeoutError("still locked")

    # A live owner on this host (this very process), and one on another host: waited for, never removed.
    for owner in (f"{os.getpid()} {host_identity()}", f"{_dead_pid()} another-host/boot"):
        lock.write_text(owner)
        looks.clear()
        with pytest.raises(TimeoutError), BuildLock(tmp_path, sleep=give_up_after_three):
            pass
        assert lock.read_text() == owner
    # A dead owner on this host: its lock goes, and with it the lock torch's builder left behind.
    lock.write_text(f"{_dead_pid()} {host_identity()}")
    (tmp_path / "lock").touch()
    with BuildLock(tmp_path, sleep=pytest.fail):
        assert lock.read_text() == f"{os.getpid()} {host_identity()}"
        assert not (tmp_path / "lock").exists()
    assert not lock.exists()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_the_build_command_exits_0_with_the_cache_and_1_with_the_cause(tmp_path: Path) -> None:
    build = [sys.executable, "-m", "dcomm.ddp.build"]
    done = subprocess.run(build, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"ready in {native_hooks.native_hooks_file()}" in done.stdout, done.stdout
    assert native_hooks.native_hooks_file().exists()
    # An empty cache and no compiler: exit 1, the cause and the fix on stderr.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "no-such-c++"}
    done = subprocess.run(build, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, (done.stdout, done.stderr[-2000:])
    assert "the C++ DDP hooks cannot be built: no C++ compiler ('no-such-c++' not found); install g++" in done.stderr


# -- ZeRO overlap in C++ ----------------------------------------------------------------------------


def _counting(launch: Callable, counted: list[int]) -> Callable:
    def counting(state: object, bucket: dist.GradBucket) -> object:
        counted.append(1)
        return launch(state, bucket)

    return counting


def _zero_overlap_in_cpp(rank: int, world: int) -> None:
    # hook_with_zero_step's ZeRO overlap step: once DDP settled its buckets, the C++ hook averages every bucket
    # (or, with reduce_scatter=True, fills the shards and reduce-scatters each once complete) and
    # calls the driver once per backward. Same parameters, bit for bit, as the Python hook (itself
    # tested against non-overlapped ZeRO in test_ddp_zero_overlap.py).
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from dcomm.ddp import hook_with_zero_step, hook_with_zero_step_interleaved, wait_for_parameters
    from dcomm.ddp._zero.checks import HOOK_MARK

    sharded = {"reduce_scatter": True}
    cases = [
        (hook_with_zero_step, allreduce_hook, {}, {}),
        (hook_with_zero_step, torch_hooks.allreduce_hook, {}, {}),
        (hook_with_zero_step_interleaved, allreduce_hook, {}, {}),  # steps per bucket: stays in Python
        (hook_with_zero_step, allreduce_hook, {}, {"find_unused_parameters": True}),  # stays in Python
        (hook_with_zero_step, allreduce_hook, sharded, {}),
        (hook_with_zero_step, bf16_compress_hook, sharded, {}),  # shards sent in bf16
        (hook_with_zero_step, fp16_compress_hook, {**sharded, "gather_during_forward": True}, {}),
        # A bf16 model's shards sent in fp16: cast first, then divided in fp16 (isWide), as in Python.
        (hook_with_zero_step, fp16_compress_hook, sharded, {"dtype": torch.bfloat16}),
        (hook_with_zero_step, allreduce_hook, {**sharded, "shard_buckets": True}, {"frozen": True}),  # stays
        # Gradients accumulated over 2 backward passes into DDP's bucket views: .grad keeps the local sum.
        (hook_with_zero_step, allreduce_hook, sharded, {"gradient_as_bucket_view": True, "accumulate": 2}),
    ]
    for builder, inner, options, ddp_options in cases:
        what = f"{builder.__name__}({inner.__module__}.{inner.__name__}, {options}, {ddp_options})"
        results, launches, switches, paths = {}, {}, {}, {}
        for native in (True, False):
            dtype = ddp_options.get("dtype", torch.float32)
            net = seeded_mlp(8, 16, 16, 4, activation=nn.ReLU, dtype=dtype)
            ddp_kwargs = {k: v for k, v in ddp_options.items() if k not in ("frozen", "accumulate", "dtype")}
            ddp = DDP(net, bucket_cap_mb=0.001, **ddp_kwargs)
            # "frozen": the last bias is trained outside ZeRO, so its bucket is also averaged by the
            # wrapped hook, which needs Python: the C++ hook never takes over.
            trained = list(net.parameters())[:-1] if ddp_options.get("frozen") else net.parameters()
            zero = ZeroRedundancyOptimizer(trained, torch.optim.Adam, overlap_with_ddp=True, lr=0.01)
            hook = builder(inner, ddp, zero, **options)
            paths[native] = register_comm_hook(ddp, None, hook, native=native)
            driver = getattr(hook, HOOK_MARK)
            counted: list[int] = []
            driver.launch = _counting(driver.launch, counted)
            per_step = []
            for step in range(6):
                if step % ddp_options.get("accumulate", 1) == 0:
                    zero.zero_grad(set_to_none=True)
                ddp(seeded_batch(rank, step, (6, 8), dtype=dtype)).float().square().sum().backward()
                per_step.append(len(counted))
                counted.clear()
            wait_for_parameters(hook)  # a no-op without gather_during_forward
            results[native] = [p.detach().clone() for p in net.parameters()]
            launches[native], switches[native] = per_step, driver.native_switch
        assert switches[False] is None, what
        assert paths[False] == "python", what
        assert all(n >= 1 for n in launches[False]), (what, launches)
        if ddp_options.get("frozen"):
            assert paths[True] == "native", what
            assert not switches[True].on, what  # registered, never switched on
            assert all(n >= 1 for n in launches[True]), (what, launches)
        elif "find_unused_parameters" in ddp_options or builder is hook_with_zero_step_interleaved:
            assert paths[True] == "python", what
            assert switches[True] is None, what  # registered as a Python hook
            assert all(n >= 1 for n in launches[True]), (what, launches)
        else:
            assert paths[True] == "native", what
            assert switches[True].on, what
            assert launches[True][-3:] == [0, 0, 0], (what, launches)
        assert_close(results[True], results[False], 0.0, what)
        assert_same_on_ranks(results[True], what)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("world", [2, 3])
def test_zero_overlap_fused_step_runs_from_cpp(world: int) -> None:
    run_ranks(_zero_overlap_in_cpp, world, timeout=240)


# -- CUDA: the side-stream cast --------------------------------------------------------------------


def _kernel_streams(prof: object) -> tuple[set[int], set[int], int]:
    """Streams of the cast kernels, of NCCL's kernels, and the stream most other kernels ran on."""
    kernels = [
        (int(getattr(e, "device_resource_id", 0) or 0), e.name)
        for e in prof.events()  # type: ignore[attr-defined]
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    nccl = {stream for stream, name in kernels if name.startswith("nccl")}
    # The casts are converting copies (elementwise kernels); same-dtype copies run as Memcpy.
    casts = {stream for stream, name in kernels if "copy" in name.lower() and not name.startswith("Memcpy")}
    others = [stream for stream, name in kernels if not name.startswith("nccl") and "copy" not in name.lower()]
    return casts, nccl, max(set(others), key=others.count)


def _cast_aside_on_cuda(rank: int, world: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)

    def train(hook: Callable, dtype: torch.dtype, views: bool, native: bool) -> tuple:
        net = seeded_mlp(16, 64, 64, 8, dtype=dtype, device=device)
        ddp = DDP(net, device_ids=[device], bucket_cap_mb=0.01, gradient_as_bucket_view=views)
        register_comm_hook(ddp, None, hook, native=native)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for step in range(5):
            with profile(activities=[ProfilerActivity.CUDA]) if step == 4 else contextlib.nullcontext() as prof:
                opt.zero_grad(set_to_none=step % 2 == 0)
                ddp(seeded_batch(rank, step, (8, 16), dtype=dtype).to(device)).float().pow(2).sum().backward()
                opt.step()
                torch.cuda.synchronize()
        return [p.detach().cpu() for p in net.parameters()], _kernel_streams(prof)

    cases = [
        (fp16_compress_hook, torch_hooks.fp16_compress_hook, torch.float32),
        (bf16_compress_hook, torch_hooks.bf16_compress_hook, torch.float32),
        (fp16_compress_hook, torch_hooks.fp16_compress_hook, torch.bfloat16),
    ]
    for ours, theirs, dtype in cases:
        for views in (True, False):
            what = f"{ours.__name__}, {dtype} model, gradient_as_bucket_view={views}"
            params, (casts, nccl, compute) = train(ours, dtype, views, native=True)
            assert_close(params, train(theirs, dtype, views, native=False)[0], 0.0, what)
            assert_close(params, train(ours, dtype, views, native=False)[0], 0.0, what)
            off_stream = casts - nccl - {compute}
            # With .grad viewing the buckets the casts run on a side stream; without, on backward's.
            assert bool(off_stream) == views, (what, casts, nccl, compute)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (NCCL)")
def test_compress_hooks_cast_on_a_side_stream_where_grads_view_the_buckets() -> None:
    run_ranks(_cast_aside_on_cuda, min(torch.cuda.device_count(), 2), backend="nccl", timeout=240)


def _in_place_buckets_on_nccl(rank: int, world: int) -> None:
    # A bucket already in the dtype sent is averaged in place: fp16 by NCCL's pre-multiplied sum,
    # bf16 divided first (torch's bf16 pre-multiplied sum is unusable: see dcomm.core.plan_average).
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)

    def train(hook: Callable, dtype: torch.dtype, native: bool) -> list[torch.Tensor]:
        net = seeded_mlp(16, 64, 64, 8, dtype=dtype, device=device)
        ddp = DDP(net, device_ids=[device], bucket_cap_mb=0.01)
        register_comm_hook(ddp, None, hook, native=native)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            opt.zero_grad()
            ddp(seeded_batch(rank, step, (8, 16), dtype=dtype).to(device)).float().pow(2).sum().backward()
            opt.step()
        return [p.detach().cpu() for p in net.parameters()]

    for ours, theirs, dtype in (
        (fp16_compress_hook, torch_hooks.fp16_compress_hook, torch.float16),
        (bf16_compress_hook, torch_hooks.bf16_compress_hook, torch.bfloat16),
    ):
        what = f"{ours.__name__}, {dtype} model"
        params = train(ours, dtype, native=True)
        initial = [p.detach().cpu() for p in seeded_mlp(16, 64, 64, 8, dtype=dtype).parameters()]
        assert not all(torch.equal(a, b) for a, b in zip(params, initial, strict=True)), f"{what}: did not train"
        assert_close(params, train(theirs, dtype, native=False), 0.0, f"{what} vs torch's")


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL): one rank sums nothing")
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_in_place_buckets_on_nccl_match_torch() -> None:
    run_ranks(_in_place_buckets_on_nccl, 2, backend="nccl", timeout=240)
