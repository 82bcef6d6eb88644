"""DiLoCoOptimizer against a single-process reference of the DiLoCo math, and resume.

The reference trains one replica per rank in one process (each on that rank's data), averages
``g - p`` over the replicas in rank order, and steps one outer optimizer on the global copy.
Without compression the arithmetic is the same as the optimizer's up to the order of the sum
over ranks, so on 2 ranks parameters must be bit-identical (a + b == b + a) and on 3 ranks equal
within a few units in the last place (stated per dtype below). Every rank starts from a
different initialization (the construction broadcast must fix it) and trains on different data.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from dcomm.averaging import DiLoCoOptimizer
from dcomm.averaging._diloco.fragments import split_bytes, sync_offsets
from dcomm_testing import run_ranks, seeded_mlp, seeded_pair
from dcomm_testing.marks import ON_GLOO_AND_NCCL

# Relative tolerance on 3 ranks, where gloo may sum the three deltas in another order.
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}
# Six parameters of 16, 4, 16, 4, 16, 4 elements.
FRAGMENTS = {1: [[0, 1, 2, 3, 4, 5]], 2: [[0, 1, 2], [3, 4, 5]], 3: [[0, 1], [2, 3], [4, 5]]}


def make_model(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    return seeded_mlp(4, 4, 4, 4, seed=seed, dtype=dtype)


def make_optimizers(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    inner = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return inner, outer


def backward(model: torch.nn.Module, rank: int, step: int) -> None:
    """Rank ``rank``'s loss at ``step`` (drawn on the CPU, on the model's device), backpropagated."""
    first = next(model.parameters())
    x, y = seeded_pair(
        1000 * rank + step, (8, 4), (8, 4), y_scale=rank + 1, uniform_y=True, draw=torch.float64, dtype=first.dtype
    )
    ((model(x.to(first.device)) - y.to(first.device)) ** 2).mean().backward()


def reference(
    world: int, dtype: torch.dtype, sync_every: int, fragments: int, delay: int, alpha: float, steps: int
) -> list:
    """Parameters of every replica after every step: ``history[step][rank]`` is a list of tensors."""
    replicas = [make_model(0, dtype) for _ in range(world)]  # rank 0's initialization everywhere
    inners = [make_optimizers(m)[0] for m in replicas]
    glob = make_model(0, dtype)
    outer = make_optimizers(glob)[1]
    glob_params = list(glob.parameters())
    offsets = [(i + 1) * sync_every // fragments % sync_every for i in range(fragments)]
    waiting: list[tuple[int, int, list[torch.Tensor]]] = []

    def apply(fragment: int, averages: list[torch.Tensor]) -> None:
        members = FRAGMENTS[fragments][fragment]
        for j, p in enumerate(glob_params):
            p.grad = averages[members.index(j)] if j in members else None
        outer.step()
        with torch.no_grad():
            for replica in replicas:
                for j, p in enumerate(replica.parameters()):
                    if j in members:
                        local = p.detach().clone()
                        p.copy_(glob_params[j]).lerp_(local, alpha)

    history = []
    for step in range(1, steps + 1):
        for rank, (model, inner) in enumerate(zip(replicas, inners, strict=True)):
            backward(model, rank, step)
            inner.step()
            inner.zero_grad()
        for entry in [w for w in waiting if w[1] == step]:
            waiting.remove(entry)
            apply(entry[0], entry[2])
        for fragment, offset in enumerate(offsets):
            if step % sync_every != offset:
                continue
            averages = []
            for j in FRAGMENTS[fragments][fragment]:
                deltas = [glob_params[j].detach() - list(m.parameters())[j].detach() for m in replicas]
                total = deltas[0].clone()
                for d in deltas[1:]:
                    total += d
                averages.append(total / world)
            if delay == 0:
                apply(fragment, averages)
            else:
                waiting.append((fragment, step + delay, averages))
        history.append([[p.detach().clone() for p in m.parameters()] for m in replicas])
    return history


def assert_matches(ours: list[torch.Tensor], theirs: list[torch.Tensor], world: int, what: str) -> None:
    for a, b in zip(ours, theirs, strict=True):
        if world == 2:
            assert torch.equal(a, b), f"{what}: differs from the reference by {(a - b).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(a, b, rtol=RTOL[a.dtype], atol=RTOL[a.dtype], msg=lambda m: f"{what}: {m}")


CONFIGS = [
    # (dtype, sync_every, fragments, fragment_sync_delay, fragment_update_alpha)
    (torch.float64, 3, 1, 0, 0.0),
    (torch.float32, 3, 1, 0, 0.0),
    (torch.float64, 4, 2, 0, 0.0),
    (torch.float64, 4, 3, 1, 0.0),
    (torch.float32, 6, 3, 5, 0.0),
    (torch.float64, 1, 1, 0, 0.0),
    (torch.float64, 4, 2, 2, 0.5),
]
STEPS = 13


def _against_reference(rank: int, world: int) -> None:
    for dtype, sync_every, fragments, delay, alpha in CONFIGS:
        what = f"{dtype}, H={sync_every}, F={fragments}, tau={delay}, alpha={alpha}"
        expected = reference(world, dtype, sync_every, fragments, delay, alpha, STEPS)
        model = make_model(rank, dtype)  # different on every rank: the broadcast must equalize
        optimizers = make_optimizers(model)
        opt = DiLoCoOptimizer(*optimizers, sync_every, None, fragments, delay, fragment_update_alpha=alpha)
        assert opt._fragments == FRAGMENTS[fragments]
        diverged = False
        for step in range(1, STEPS + 1):
            backward(model, rank, step)
            opt.step()
            opt.zero_grad()
            params = [p.detach() for p in model.parameters()]
            assert_matches(params, expected[step - 1][rank], world, f"{what}, step {step}")
            neighbour = expected[step - 1][(rank + 1) % world]
            diverged |= any(not torch.equal(a, b) for a, b in zip(params, neighbour, strict=True))
        assert diverged or sync_every == 1, f"{what}: replicas never differed, so averaging was not tested"
        assert opt.inner_steps == STEPS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_diloco_matches_reference(world: int) -> None:
    run_ranks(_against_reference, world, timeout=240)


def _frozen(rank: int, world: int) -> None:
    outers = {
        "SGD with weight decay": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, weight_decay=0.1),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1),  # weight_decay 0.01 by default
    }
    for name, make_outer in outers.items():
        runs = []
        for handed_frozen in [True, False]:
            model = make_model(0, torch.float64)
            frozen = model[0].weight
            frozen.requires_grad_(False)
            params = [p for p in model.parameters() if handed_frozen or p.requires_grad]
            inner = torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)
            opt = DiLoCoOptimizer(inner, make_outer(params), 2, None, 2)
            start = frozen.detach().clone()
            for step in range(1, 8):
                backward(model, rank, step)
                opt.step()
                opt.zero_grad()
            assert torch.equal(frozen, start), f"{name}: the outer step moved a frozen parameter"
            assert frozen.grad is None
            runs.append([p.detach().clone() for p in model.parameters()])
        # The trainable parameters as if the frozen one had not been handed to the optimizers.
        for ours, without in zip(*runs, strict=True):
            assert torch.equal(ours, without), name


@pytest.mark.timeout(200)
def test_diloco_leaves_frozen_parameters_alone() -> None:
    run_ranks(_frozen, 2, timeout=150)


def checkpoint(model: torch.nn.Module, opt: DiLoCoOptimizer) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer)


RESUME_CONFIGS = [(1, 0, None), (2, 3, None)]
RESUME_AT = [2, 4, 5, 9]


def _resume(rank: int, world: int, compressions: list[str | None]) -> None:
    configs = [(f, d, c) for f, d, _ in RESUME_CONFIGS for c in compressions]
    for fragments, delay, compression in configs:
        what = f"F={fragments}, tau={delay}, compression={compression}"
        model = make_model(rank, torch.float32)
        opt = DiLoCoOptimizer(*make_optimizers(model), 4, None, fragments, delay, compression)
        history, saved = [], {}
        for step in range(1, STEPS + 1):
            if step - 1 in RESUME_AT:
                saved[step - 1] = checkpoint(model, opt)
            backward(model, rank, step)
            opt.step()
            opt.zero_grad()
            history.append([p.detach().clone() for p in model.parameters()])
        for at, state in saved.items():
            fresh = make_model(99, torch.float32)
            resumed = DiLoCoOptimizer(*make_optimizers(fresh), 4, None, fragments, delay, compression)
            fresh.load_state_dict(state["model"])
            resumed.load_state_dict(state["opt"])
            assert resumed.inner_steps == at
            for step in range(at + 1, STEPS + 1):
                backward(fresh, rank, step)
                resumed.step()
                resumed.zero_grad()
                for a, b in zip(fresh.parameters(), history[step - 1], strict=True):
                    assert torch.equal(a.detach(), b), f"{what}: resumed at {at}, step {step} differs"
            assert resumed.bytes_sent == opt.bytes_sent


@pytest.mark.timeout(300)
def test_diloco_resumes_bit_identically() -> None:
    run_ranks(_resume, 2, [None, "int4"], timeout=240)


def _bytes(rank: int, world: int) -> None:
    model = make_model(rank, torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    opt = DiLoCoOptimizer(*make_optimizers(model), 5)
    for step in range(1, 11):
        backward(model, rank, step)
        opt.step()
    # Two syncs of a ring allreduce of the fp32 parameters: 2 (n - 1) / n of their bytes each.
    assert opt.bytes_sent == 2 * (2 * (world - 1) * numel * 4 // world)


@pytest.mark.timeout(200)
def test_diloco_counts_bytes() -> None:
    run_ranks(_bytes, 3, timeout=150)


def test_fragments_of_about_equal_bytes_in_order() -> None:
    assert split_bytes([16, 4, 16, 4, 16, 4], 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_bytes([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_bytes([1, 1, 100], 3) == [[0], [1], [2]]
    assert split_bytes([5], 1) == [[0]]
    assert sync_offsets(100, 4) == [25, 50, 75, 0]
    assert sync_offsets(3, 1) == [0]
    with pytest.raises(ValueError, match="fragments"):
        split_bytes([1, 1], 3)


def _snapshot(opt: DiLoCoOptimizer) -> list[torch.Tensor]:
    state = opt.state_dict()
    extra = state["diloco"]
    tensors = [*extra["global"], torch.tensor(state["step"])]
    for optimizer_state in (state["state"], extra["outer"]["state"]):
        tensors += [v.clone() for s in optimizer_state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += [t.clone() for f in extra["feedback"] if f is not None for t in f.values()]
    return [t.clone() for t in tensors]


def _validation(rank: int, world: int) -> None:
    model = make_model(0, torch.float32)
    inner, outer = make_optimizers(model)
    bad_args: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"inner": "adam"}, TypeError, "inner"),
        ({"outer": inner}, ValueError, "outer"),
        ({"outer": torch.optim.SGD(list(model.parameters())[:-1], lr=0.7)}, ValueError, "outer"),
        ({"sync_every": 0}, ValueError, "sync_every"),
        ({"sync_every": True}, TypeError, "sync_every: expected a positive int, got True"),
        ({"fragments": 0}, ValueError, "fragments"),
        ({"fragments": 7}, ValueError, "fragments: 7 is more than the 6 parameters"),
        ({"fragment_sync_delay": -1}, ValueError, "fragment_sync_delay"),
        ({"fragment_sync_delay": 4}, ValueError, "fragment_sync_delay: 4 must be smaller than sync_every=4"),
        ({"compression": "int3"}, ValueError, "compression"),
        ({"fragment_update_alpha": 1.0}, ValueError, r"fragment_update_alpha: expected a number in \[0, 1\), got 1\.0"),
        ({"fragment_update_alpha": "0.5"}, TypeError, r"fragment_update_alpha: expected a number in .*, got '0\.5'"),
        ({"fragment_update_alpha": True}, TypeError, "fragment_update_alpha: expected a number in .* got True"),
        ({"offload_global": 1}, TypeError, "offload_global"),
    ]
    for change, error, message in bad_args:
        kwargs: dict[str, Any] = {"inner": inner, "outer": outer, "sync_every": 4, **change}
        with pytest.raises(error, match=message):
            DiLoCoOptimizer(**kwargs)

    opt = DiLoCoOptimizer(inner, outer, 4, None, 2, 2, "int8")
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    for step in range(1, 7):  # fragment 0 syncs at steps 2 and 6 (applied at 4 and 8), fragment 1 at 4 (at 6)
        backward(model, rank, step)
        opt.step()
    good = checkpoint(model, opt)
    assert [p["fragment"] for p in good["opt"]["diloco"]["pending"]] == [0]
    for step in range(7, 10):  # move on, so that a half-applied load would show
        backward(model, rank, step)
        opt.step()
    before = _snapshot(opt)

    def corrupted(path: list[Any], value: Any) -> dict[str, Any]:
        state = copy.deepcopy(good["opt"])
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return state

    broken: list[tuple[Any, type[Exception], str]] = [
        ([], TypeError, "state_dict: expected the dict DiLoCoOptimizer.state_dict.. returns, got list"),
        ({"step": 1}, ValueError, "state_dict: expected keys"),
        (corrupted(["step"], -1), ValueError, "step"),
        (corrupted(["diloco", "config", "compression"], None), ValueError, "compression"),
        (corrupted(["diloco", "global", 0], torch.zeros(3)), ValueError, r"global'\]\[0\]"),
        (corrupted(["diloco", "feedback", 1], None), ValueError, "feedback"),
        (corrupted(["diloco", "pending", 0, "apply_step"], 99), ValueError, "pending"),
        (corrupted(["diloco", "outer", "param_groups"], []), ValueError, "outer"),
        (corrupted(["param_groups"], []), ValueError, "param_groups"),
    ]
    for state_dict, error, message in broken:
        with pytest.raises(error, match=message):
            opt.load_state_dict(state_dict)
        after = _snapshot(opt)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), f"{message}: half-applied load"


@pytest.mark.timeout(200)
def test_diloco_validates_arguments_and_checkpoints() -> None:
    run_ranks(_validation, 1, timeout=150)


def _offload(rank: int, world: int, device_type: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    runs = []
    for offload in (False, True):
        model = make_model(rank, torch.float32).to(device)
        opt = DiLoCoOptimizer(*make_optimizers(model), 3, None, 2, 1, "int4", offload_global=offload)
        for step in range(1, STEPS + 1):
            backward_on(model, rank, step, device)
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().cpu() for p in model.parameters()])
        if offload:
            assert all(g.device.type == "cpu" for g in opt._global)
            moved = [v for s in opt.outer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            assert moved
            assert all(v.device.type == "cpu" for v in moved if v.dim() > 0)
            if device_type == "cuda":
                assert all(g.is_pinned() for g in opt._global)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), "offloading changed the result"


def backward_on(model: torch.nn.Module, rank: int, step: int, device: torch.device) -> None:
    if device.type == "cpu":
        backward(model, rank, step)
        return
    x, y = seeded_pair(1000 * rank + step, (8, 4), (8, 4), y_scale=rank + 1, uniform_y=True)
    ((model(x.to(device)) - y.to(device)) ** 2).mean().backward()


@pytest.mark.timeout(300)
@ON_GLOO_AND_NCCL
def test_diloco_offload_gives_the_same_result_and_keeps_state_on_cpu(device_type: str, backend: str) -> None:
    run_ranks(_offload, 2, device_type, backend=backend, timeout=240)


def _no_host_sync(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    batches = [seeded_pair(1000 * rank + step, (8, 4), (8, 4), y_scale=rank + 1, uniform_y=True) for step in range(12)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    saved = {}
    for compression in (None, "int8"):
        for offload in (False, True):
            model = make_model(rank, torch.float32).to(device)
            # H=4, F=2, tau=2: a launch every 2 steps, an advance (int8) 1 step and an apply 2 steps later.
            opt = DiLoCoOptimizer(*make_optimizers(model), 4, None, 2, 2, compression, offload_global=offload)
            try:
                for step, (x, y) in enumerate(batches):
                    if step == 4:  # after the first period: the outer state exists, every kind of step follows
                        torch.cuda.synchronize(device)
                        torch.cuda.set_sync_debug_mode("error")  # a blocking copy or .item() raises
                    ((model(x) - y) ** 2).mean().backward()
                    opt.step()
                    opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            state = opt.state_dict()["diloco"]  # waits for the copies queued to pinned memory
            momenta = [s["momentum_buffer"] for s in state["outer"]["state"].values()]
            saved[compression, offload] = [t.cpu() for t in state["global"] + momenta]
    for compression in (None, "int8"):
        on_device, offloaded = saved[compression, False], saved[compression, True]
        assert all(torch.equal(a, b) for a, b in zip(on_device, offloaded, strict=True)), compression


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU (NCCL)")
def test_diloco_sync_steps_never_make_the_host_wait_for_the_gpu() -> None:
    # Launch, advance and apply only queue work: the training stream waits for a transfer, the host never.
    run_ranks(_no_host_sync, min(torch.cuda.device_count(), 2), backend="nccl", timeout=240)


def _per_parameter_ops(rank: int, world: int) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    model = torch.nn.Sequential(*(torch.nn.Linear(3, 3) for _ in range(12)))  # 24 parameters
    opt = DiLoCoOptimizer(*make_optimizers(model), 1)  # every step syncs: launch and apply
    model(torch.randn(2, 3)).square().sum().backward()
    opt.step()  # the first outer step allocates the momentum
    opt.zero_grad()
    model(torch.randn(2, 3)).square().sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.cpu_parent is None:  # what DiLoCo calls itself (inner and outer steps nest in their own spans)
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


@pytest.mark.timeout(200)
def test_diloco_sync_step_copies_all_parameters_in_a_few_kernels() -> None:
    # g - p, p = g and g = p as many-tensor ops: the sync step's launches do not grow with the parameters.
    counts = run_ranks(_per_parameter_ops, 1, timeout=150)[0]
    assert counts.get("aten::_foreach_copy_") == 3, counts
    assert counts.get("aten::_foreach_sub_") == 1, counts
    assert counts.get("aten::copy_", 0) + counts.get("aten::sub_", 0) == 0, counts


def _stages_after_launch(rank: int, world: int, device_type: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    model = make_model(rank, torch.float32).to(device)
    # H=4, F=1, tau=2, int8: the launch at step 4, the apply at step 6.
    opt = DiLoCoOptimizer(*make_optimizers(model), 4, None, 1, 2, "int8")
    stages = []
    for step in range(1, 7):
        backward_on(model, rank, step, device)
        opt.step()
        opt.zero_grad()
        stages.append(opt._in_flight[0].average._pending._stage if opt._in_flight else None)
    # NCCL: stage 2 is queued with stage 1 (the GPU starts it once stage 1 is done, the host waits for
    # neither). gloo: advancing waits for stage 1 on the host, so it comes halfway, at step 5.
    second = "advanced" if device_type == "cuda" else "launched"
    assert stages == [None, None, None, second, "advanced", None], stages


@pytest.mark.timeout(300)
@ON_GLOO_AND_NCCL
def test_compressed_sync_queues_its_second_stage_at_launch_on_nccl(device_type: str, backend: str) -> None:
    run_ranks(_stages_after_launch, 2, device_type, backend=backend, timeout=240)
