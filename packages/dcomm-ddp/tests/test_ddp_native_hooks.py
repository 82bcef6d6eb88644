"""The C++ hooks DDP's reducer gets for dcomm's averaging hooks, against the Python hooks and torch's.

Registering ``allreduce_hook``, ``fp16_compress_hook`` or ``bf16_compress_hook`` with
``ddp.register_comm_hook`` puts a C++ hook on the reducer (``dcomm.ddp.native_hooks``); with
``DCOMM_NATIVE_HOOKS=0`` the Python hook runs. Both must give the same parameters, bit for bit,
and the C++ path must not enter the Python hook for a dense real bucket.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import dcomm.ddp.default_hooks as default_hooks
from dcomm.ddp import allreduce_hook, bf16_compress_hook, fp16_compress_hook, native_hooks
from dcomm_testing import assert_close, assert_same_on_ranks, recorded_calls, run_ranks, seeded_batch, seeded_mlp

STEPS = 3
BUCKET_CAPS = [0.0003] * 8  # every parameter in a bucket of its own


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


def train(hook: Callable, state: object, dtype: torch.dtype, enabled: bool, complex_layer: bool = False) -> tuple:
    """Parameters after STEPS steps, and how many times the Python hook ran."""
    rank = dist.get_rank()
    # _check_group: the first thing every Python hook call does.
    with recorded_calls(default_hooks, "_check_group", lambda group, name: name) as calls:
        net = Mixed(dtype, complex_layer)
        ddp = DDP(net, bucket_cap_mb_list=BUCKET_CAPS)
        with native_hooks.switched(enabled):
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            opt.zero_grad()
            ddp(seeded_batch(rank, step, (5, 6), dtype=dtype)).backward()
            opt.step()
    return [p.detach().clone() for p in net.parameters()], len(calls)


def _native_matches_python(rank: int, world: int) -> None:
    assert native_hooks.native_hooks_available()
    groups = [None]
    if world == 4:  # also over a subgroup: pairs [0, 1] and [2, 3]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append(pairs[rank // 2])
    cases = [
        (allreduce_hook, torch.float32),
        (allreduce_hook, torch.float16),
        (fp16_compress_hook, torch.float32),
        (fp16_compress_hook, torch.float16),  # already fp16: averaged in place
        (bf16_compress_hook, torch.float32),
        (bf16_compress_hook, torch.bfloat16),
    ]
    for group in groups:
        for hook, dtype in cases:
            what = f"{hook.__name__}, {dtype} model, group {'WORLD' if group is None else 'pair'}"
            ours, python_calls = train(hook, group, dtype, enabled=True)
            reference, reference_calls = train(hook, group, dtype, enabled=False)
            assert python_calls == 0, f"{what}: the C++ hook entered the Python hook {python_calls} times"
            assert reference_calls >= 2 * STEPS, f"{what}: the Python hook ran {reference_calls} times"
            assert_close(ours, reference, 0.0, what)
            assert_same_on_ranks(ours, what, group)
            if hook is allreduce_hook:
                assert_close(ours, train(torch_hooks.allreduce_hook, group, dtype, enabled=True)[0], 0.0, what)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_native_hooks_match_python_hooks_bit_for_bit(world: int) -> None:
    run_ranks(_native_matches_python, world, timeout=240)


def _complex_and_sparse(rank: int, world: int) -> None:
    # DDP buckets a complex gradient as its real view: it stays in C++, with torch's results.
    ours, python_calls = train(allreduce_hook, None, torch.float32, enabled=True, complex_layer=True)
    assert python_calls == 0, python_calls
    torchs, _ = train(torch_hooks.allreduce_hook, None, torch.float32, enabled=True, complex_layer=True)
    assert_close(ours, torchs, 0.0, "allreduce_hook with a complex parameter vs torch's")
    # A sparse gradient's bucket goes to the Python hook, with a future of its own.
    grads = {}
    for name, hook in (("ours", allreduce_hook), ("torch", torch_hooks.allreduce_hook)):
        torch.manual_seed(0)
        table = nn.Embedding(10, 3, sparse=True)
        ddp = DDP(table)
        with native_hooks.switched(True):
            ddp.register_comm_hook(None, hook)
        ddp(torch.tensor([rank, rank + 1, 7])).pow(2).sum().backward()
        grads[name] = table.weight.grad.to_dense()
    assert_close([grads["ours"]], [grads["torch"]], 0.0, "allreduce_hook on a sparse gradient vs torch's")
    assert_same_on_ranks([grads["ours"]], "sparse gradient")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_complex_in_cpp_and_sparse_buckets_in_the_python_hook(world: int) -> None:
    run_ranks(_complex_and_sparse, world, timeout=240)


def test_switch_off_and_other_hooks_use_torchs_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dist._register_comm_hook is native_hooks._register_comm_hook  # installed by importing dcomm.ddp
    native_hooks.install()  # twice is once
    assert native_hooks._TORCH_REGISTER is torch._C._distributed_c10d._register_comm_hook
    seen = []
    monkeypatch.setattr(native_hooks, "_TORCH_REGISTER", lambda *args: seen.append(args[2]))
    monkeypatch.setattr(native_hooks, "_extension", lambda: pytest.fail("the extension was asked for"))
    with native_hooks.switched(False):
        assert not native_hooks.native_hooks_available()
        native_hooks._register_comm_hook(object(), None, allreduce_hook)
    native_hooks._register_comm_hook(object(), None, torch_hooks.allreduce_hook)
    native_hooks._register_comm_hook(object(), "not a group", bf16_compress_hook)  # the Python hook raises later
    assert seen == [allreduce_hook, torch_hooks.allreduce_hook, bf16_compress_hook]


def test_build_failure_warns_once_and_keeps_the_python_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    def failing_load(**kwargs: object) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    native_hooks._extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"C\+\+ DDP hooks could not be built \(RuntimeError: no compiler"):
            assert not native_hooks.native_hooks_available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not native_hooks.native_hooks_available()  # cached: no second warning
        seen = []
        monkeypatch.setattr(native_hooks, "_TORCH_REGISTER", lambda *args: seen.append(args[2]))
        native_hooks._register_comm_hook(object(), None, fp16_compress_hook)
        assert seen == [fp16_compress_hook]
    finally:
        native_hooks._extension.cache_clear()


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_the_cpp_hook_builds_where_a_compiler_is() -> None:
    # CI has one: the C++ hooks must build there, not silently fall back.
    assert native_hooks.native_hooks_available()


def test_a_stale_build_lock_is_removed_and_a_live_one_waited_for(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    now = tmp_path.stat().st_mtime
    # Another process is building: the lock goes away while we wait; nothing is removed by us.
    waits: list[float] = []

    def other_process_finishes(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            lock.unlink()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native_hooks.clear_stale_lock(tmp_path, 180.0, clock=lambda: now + 5, sleep=other_process_finishes)
    assert len(waits) == 3
    assert not lock.exists()
    # A build killed 200 s ago: its lock is removed at once, with a warning naming it.
    lock.touch()
    with pytest.warns(RuntimeWarning, match=r"removed .*lock, left by a build .* stopped 2\d\d s ago"):
        native_hooks.clear_stale_lock(tmp_path, 180.0, clock=lambda: now + 200, sleep=pytest.fail)
    assert not lock.exists()
    native_hooks.clear_stale_lock(tmp_path, 180.0, sleep=pytest.fail)  # no lock: no wait
    # A lock quiet for longer than a build: the wait says why, once, before the lock goes stale.
    lock.touch()
    times = iter([now + 90, now + 120, now + 200])
    with pytest.warns(RuntimeWarning) as said:
        native_hooks.clear_stale_lock(tmp_path, 180.0, clock=lambda: next(times), sleep=lambda seconds: None)
    messages = [str(w.message) for w in said]
    assert len(messages) == 2, messages
    assert "waiting for" in messages[0], messages
    assert "unchanged for" in messages[0], messages
    assert "left by a build" in messages[1], messages


_LOAD_WITH_A_STALE_LOCK = """
import sys
from pathlib import Path
from dcomm.ddp import native_hooks
native_hooks.STALE_BUILD_S = 0.0  # the lock below counts as left by a killed build
Path(sys.argv[1], "lock").touch()
assert native_hooks.native_hooks_available()
"""


@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_a_build_killed_half_way_does_not_hang_the_next_run() -> None:
    # torch's builder waits for as long as a lock file exists in the build directory; one left by
    # a killed build hung every later run (the process below would never end).
    assert native_hooks.native_hooks_available()  # built (or cached) here first
    directory = Path(_build_root()) / native_hooks.build_name()  # this environment's, not another's
    assert (directory / f"{directory.name}.so").exists()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_WITH_A_STALE_LOCK, str(directory)],
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "left by a build of the C++ DDP hooks" in done.stderr
    finally:
        (directory / "lock").unlink(missing_ok=True)


def _build_root() -> str:
    from torch.utils import cpp_extension

    return os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


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
        results, launches, switches = {}, {}, {}
        for enabled in (True, False):
            dtype = ddp_options.get("dtype", torch.float32)
            net = seeded_mlp(8, 16, 16, 4, activation=nn.ReLU, dtype=dtype)
            ddp_kwargs = {k: v for k, v in ddp_options.items() if k not in ("frozen", "accumulate", "dtype")}
            ddp = DDP(net, bucket_cap_mb=0.001, **ddp_kwargs)
            # "frozen": the last bias is trained outside ZeRO, so its bucket is also averaged by the
            # wrapped hook, which needs Python: the C++ hook never takes over.
            trained = list(net.parameters())[:-1] if ddp_options.get("frozen") else net.parameters()
            zero = ZeroRedundancyOptimizer(trained, torch.optim.Adam, overlap_with_ddp=True, lr=0.01)
            hook = builder(inner, ddp, zero, **options)
            with native_hooks.switched(enabled):
                ddp.register_comm_hook(None, hook)
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
            results[enabled] = [p.detach().clone() for p in net.parameters()]
            launches[enabled], switches[enabled] = per_step, driver.native_switch
        assert switches[False] is None, what
        assert all(n >= 1 for n in launches[False]), (what, launches)
        if ddp_options.get("frozen"):
            assert not switches[True].on, what  # registered, never switched on
            assert all(n >= 1 for n in launches[True]), (what, launches)
        elif "find_unused_parameters" in ddp_options or builder is hook_with_zero_step_interleaved:
            assert switches[True] is None, what  # registered as a Python hook
            assert all(n >= 1 for n in launches[True]), (what, launches)
        else:
            assert switches[True].on, what
            assert launches[True][-3:] == [0, 0, 0], (what, launches)
        assert_close(results[True], results[False], 0.0, what)
        assert_same_on_ranks(results[True], what)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_zero_overlap_fused_step_runs_from_cpp(world: int) -> None:
    run_ranks(_zero_overlap_in_cpp, world, timeout=240)


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

    from dcomm.core.environment import variable_set

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)

    def train(hook: Callable, dtype: torch.dtype, views: bool, aside: bool = True) -> tuple:
        net = seeded_mlp(16, 64, 64, 8, dtype=dtype, device=device)
        ddp = DDP(net, device_ids=[device], bucket_cap_mb=0.01, gradient_as_bucket_view=views)
        with variable_set(native_hooks.CAST_ASIDE_SWITCH, "1" if aside else "0"):
            ddp.register_comm_hook(None, hook)
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
            params, (casts, nccl, compute) = train(ours, dtype, views)
            assert_close(params, train(theirs, dtype, views)[0], 0.0, what)
            assert_close(params, train(ours, dtype, views, aside=False)[0], 0.0, what)
            off_stream = casts - nccl - {compute}
            # With .grad viewing the buckets the casts run on a side stream; without, on backward's.
            assert bool(off_stream) == views, (what, casts, nccl, compute)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (NCCL)")
def test_compress_hooks_cast_on_a_side_stream_where_grads_view_the_buckets() -> None:
    run_ranks(_cast_aside_on_cuda, min(torch.cuda.device_count(), 2), backend="nccl", timeout=240)
