"""dcomm's PowerSGD against torch's, trained side by side on real ranks, and its resumable state.

Every rank gets its own batches (seeded by rank and step), so parameters agree across ranks only
when the hook really averaged. Same seeds and the same arithmetic as torch's hook: parameters
must be bit-identical (tolerance 0).
"""

import copy
import functools
import inspect
import io
import pickle
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import dcomm.ddp
from dcomm.ddp import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from dcomm.ddp._seed_stream import SeedStream
from dcomm_testing import DDPRun, assert_close, assert_same_on_ranks, rank_device, run_ranks, seeded_batch, seeded_mlp

STEPS = 6
TIMEOUT = 240.0


def make_model() -> nn.Module:
    # Two 24x24 weights (same shape: batched when asked), a 16x24 and a 24x3 one; biases and the
    # 24x3 weight are too small to compress at rank >= 2 and go uncompressed.
    return seeded_mlp(16, 24, 24, 24, 3, device=rank_device())


def batch(step: int) -> torch.Tensor:
    return seeded_batch(dist.get_rank(), step, (8, 16), draw=torch.float32).to(rank_device())


class Run(DDPRun):
    """A DDP model with a hook, trained step by step with SGD and momentum; it counts its steps."""

    def __init__(self, hook: Callable, state: object, bucket_cap_mb: float = 25.0) -> None:
        super().__init__(make_model(), hook, state, batch, bucket_cap_mb=bucket_cap_mb)
        self.done = 0

    def train(self, steps: int) -> list[torch.Tensor]:  # steps from where it stopped
        params = super().train(self.done, self.done + steps)
        self.done += steps
        return params

    def checkpoint(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "opt": copy.deepcopy(self.opt.state_dict()),  # its tensors are the live ones
            "hook": self.state.state_dict(),
            "step": self.done,
        }

    def restore(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(copy.deepcopy(ckpt["opt"]))
        self.state.load_state_dict(ckpt["hook"])
        self.done = ckpt["step"]


CONFIGS = [
    {"matrix_approximation_rank": 1},
    {"matrix_approximation_rank": 4},
    {"matrix_approximation_rank": 2, "batch_tensors_with_same_shape": True, "random_seed": 5},
    {"matrix_approximation_rank": 3, "warm_start": False, "orthogonalization_epsilon": 1e-8},
    {"matrix_approximation_rank": 1, "use_error_feedback": False, "min_compression_rate": 1},
]


def _parity(rank: int, world: int) -> None:
    # On a machine with a GPU, torch's powerSGD_hook calls torch.cuda.synchronize(device) with these
    # CPU tensors' device and raises; the reference runs as on a CPU-only machine.
    torch.cuda.is_available = lambda: False  # this rank's process only
    for config in CONFIGS:
        torch_state = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2, **config)
        ref = Run(torch_powersgd.powerSGD_hook, torch_state).train(STEPS)
        state = PowerSGDState(None, start_powerSGD_iter=2, **config)
        run = Run(powerSGD_hook, state)
        run.train(STEPS - 1)
        memories = {index: error.data_ptr() for index, error in state.error_dict.items()}
        ours = run.train(1)
        # Error feedback reuses each bucket's memory: no bucket-sized tensor per step.
        assert memories == {index: error.data_ptr() for index, error in state.error_dict.items()}
        assert_close(ours, ref, 0.0, f"powerSGD_hook {config}")
        assert_same_on_ranks(ours, f"powerSGD_hook {config}")
        assert state.iter == torch_state.iter == STEPS
        assert state.compression_stats() == torch_state.compression_stats()
        for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
            mine, theirs = getattr(state, key), getattr(torch_state, key)
            assert mine.keys() == theirs.keys(), key
            assert all(torch.equal(mine[k], theirs[k]) for k in mine), key
    # The compressed result differs from the exact average: compression really happened.
    exact = Run(dcomm.ddp.allreduce_hook, None).train(STEPS)
    assert not all(torch.equal(a, b) for a, b in zip(ours, exact, strict=True))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_matches_torch(world: int) -> None:
    run_ranks(_parity, world, timeout=TIMEOUT)


def _batched_reference(grads: list[torch.Tensor], q0: torch.Tensor) -> torch.Tensor:
    """One batched PowerSGD step in float64 on the ranks' padded square gradients."""
    side = q0.shape[0]
    squares = [torch.nn.functional.pad(g.double(), (0, side * side - g.numel())).view(side, side) for g in grads]
    q, _ = torch.linalg.qr(q0.double()) if q0.shape[1] > 2 else (_gram_schmidt(q0.double()), None)
    p = sum(m @ q for m in squares)
    p = _gram_schmidt(p) if q0.shape[1] <= 2 else torch.linalg.qr(p)[0]
    q = sum(m.t() @ p for m in squares) / len(grads)
    return (p @ q.t()).reshape(-1)[: grads[0].numel()]


def _gram_schmidt(m: torch.Tensor) -> torch.Tensor:
    m = m.clone()
    for i in range(m.shape[1]):
        m[:, i] /= m[:, i].norm()
        for j in range(i + 1, m.shape[1]):
            m[:, j] -= (m[:, i] @ m[:, j]) * m[:, i]
    return m


def _recording(
    seen: list[torch.Tensor], state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """batched_powerSGD_hook, keeping the local gradient and the result."""
    seen.append(bucket.buffer().clone())

    def keep(fut: torch.futures.Future) -> torch.Tensor:
        seen.append(fut.value().clone())
        return fut.value()

    return batched_powerSGD_hook(state, bucket).then(keep)


def _batched(rank: int, world: int) -> None:
    # torch's batched hook cannot run here (its orthogonalisation rejects the 2-D Q it passes in
    # torch >= 2.12), so one step is checked against a float64 reference instead.
    for rank_r in (1, 4):
        state = PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=0, random_seed=3)
        seen: list[torch.Tensor] = []
        hook = functools.partial(_recording, seen)
        hook.__name__ = hook.__qualname__ = "recording"  # type: ignore[attr-defined]

        torch.manual_seed(0)
        ddp = DDP(nn.Linear(30, 20))
        ddp.register_comm_hook(state, hook)
        gen = torch.Generator().manual_seed(rank)
        ddp(torch.randn(5, 30, generator=gen) * (rank + 1)).sum().backward()
        local, got = seen
        grads = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(grads, local)
        side = state.q_memory_dict[0].shape[0]
        q0 = torch.randn(side, rank_r, generator=torch.Generator().manual_seed(SeedStream(3).randint(10**9)))
        expected = _batched_reference(grads, q0)
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
        # Error feedback keeps what was not sent: the local gradient minus the approximation.
        torch.testing.assert_close(state.error_dict[0][: got.numel()], local - got, rtol=0, atol=1e-6)
        assert not torch.allclose(got, sum(grads) / world, atol=1e-3), "rank-r result equals the exact mean"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_batched_powersgd_matches_float64_reference(world: int) -> None:
    run_ranks(_batched, world, timeout=TIMEOUT)


def _resume(rank: int, world: int, hook_name: str) -> None:
    hook = getattr(dcomm.ddp, hook_name)
    config = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 1}
    whole = Run(hook, PowerSGDState(None, **config))
    expected = whole.train(8)
    for stop in (1, 3, 5):
        run = Run(hook, PowerSGDState(None, **config))
        run.train(stop)
        buffer = io.BytesIO()
        torch.save(run.checkpoint(), buffer)  # through a file, as a real checkpoint goes
        run.train(2)  # go on, then restore into the same, registered state: no DDP rebuild
        buffer.seek(0)
        run.restore(torch.load(buffer, weights_only=True))
        assert_close(run.train(8 - stop), expected, 0.0, f"{hook_name} restored at step {stop}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("hook_name", ["powerSGD_hook", "batched_powerSGD_hook"])
def test_bit_identical_resume(hook_name: str) -> None:
    run_ranks(_resume, 3, hook_name, timeout=TIMEOUT)


def _overflowed_step(rank: int, world: int, hook_name: str) -> None:
    hook = getattr(dcomm.ddp, hook_name)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1)
    run = Run(hook, state)
    for step in range(5):
        run.ddp.zero_grad()
        loss = run.ddp(batch(step)).square().mean()
        if step == 2 and rank == 0:  # an fp16 step that overflowed on one rank
            loss = loss * float("inf")
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in run.model.parameters())
        assert finite == (step != 2), f"{hook_name}: step {step} averaged to finite={finite}"
    memories = [*state.error_dict.values(), *state.q_memory_dict.values()]
    assert memories, "compression never ran"
    assert all(torch.isfinite(m).all() for m in memories), f"{hook_name}: the overflowed step poisoned a memory"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hook_name", ["powerSGD_hook", "batched_powerSGD_hook"])
def test_an_overflowed_step_leaves_later_steps_finite(hook_name: str) -> None:
    run_ranks(_overflowed_step, 2, hook_name, timeout=TIMEOUT)


def _start_at_zero_and_one(rank: int, world: int) -> None:
    # torch rejects start_powerSGD_iter <= 1 with error feedback; here it works, and memory
    # made before DDP's bucket rebuild is detected and restarted.
    exact = Run(dcomm.ddp.allreduce_hook, None).train(STEPS)
    for start in (0, 1):
        state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=start)
        params = Run(powerSGD_hook, state, bucket_cap_mb=0.001).train(STEPS)
        assert_same_on_ranks(params, f"start_powerSGD_iter={start}")
        assert state.iter == STEPS
        assert state.error_dict, "compression never ran"
        change = max((p - q).abs().max().item() for p, q in zip(params, exact, strict=True))
        assert 0 < change < 0.5, change


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_start_at_zero_and_one(world: int) -> None:
    run_ranks(_start_at_zero_and_one, world, timeout=TIMEOUT)


class _WithUnused(nn.Module):
    """make_model() and a layer that never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.unused = nn.Linear(3, 24, device=rank_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _unused_parameters(rank: int, world: int) -> None:
    # With find_unused_parameters=True DDP's reducer allreduces which parameters were used right
    # after the last bucket's hook; on gloo the collectives the hooks launch from callbacks used
    # to come after it on one rank and before it on another (a hang, or a peer's reset).
    for hook in (powerSGD_hook, batched_powerSGD_hook):
        torch.manual_seed(0)
        model = _WithUnused()
        unused = [p.detach().clone() for p in model.unused.parameters()]
        ddp = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=True)
        ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1), hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(STEPS):
            opt.zero_grad()
            ddp(batch(step)).square().sum().backward()
            opt.step()
        params = [p.detach().clone() for p in model.body.parameters()]
        assert all(torch.isfinite(p).all() for p in params), hook.__name__
        assert_same_on_ranks(params, hook.__name__)
        assert all(torch.equal(a, b) for a, b in zip(model.unused.parameters(), unused, strict=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_unused_parameters_on_gloo(world: int) -> None:
    run_ranks(_unused_parameters, world, timeout=TIMEOUT)


def test_seed_stream_matches_numpy() -> None:
    for seed in (0, 1, 12345, 2**32 - 1):
        ours, theirs = SeedStream(seed), np.random.RandomState(seed)
        assert [ours.randint(10**9) for _ in range(500)] == [int(theirs.randint(10**9)) for _ in range(500)]


def test_state_arguments_and_bad_state_dict() -> None:
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDState(None, matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        PowerSGDState(None, start_powerSGD_iter=-1)
    with pytest.raises(TypeError, match="use_error_feedback: expected True or False, got 'yes'"):
        PowerSGDState(None, use_error_feedback="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"matrix_approximation_rank: expected a positive int, got 2\.0"):
        PowerSGDState(None, matrix_approximation_rank=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="orthogonalization_epsilon: expected a non-negative number, got nan"):
        PowerSGDState(None, orthogonalization_epsilon=float("nan"))
    with pytest.raises(ValueError, match=r"random_seed: expected an int in \[0, 2\*\*32\), got -1; pass e\.g\. 0"):
        PowerSGDState(None, random_seed=-1)
    with pytest.raises(TypeError, match=r"random_seed: expected an int in \[0, 2\*\*32\), got 1\.5"):
        PowerSGDState(None, random_seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="process_group: expected a ProcessGroup or None, got str; pass None"):
        PowerSGDState("WORLD")  # type: ignore[arg-type]
    state = PowerSGDState(None, matrix_approximation_rank=2)
    saved = state.state_dict()
    state.iter = 7
    with pytest.raises(TypeError, match=r"state_dict: expected the mapping PowerSGDState.state_dict\(\) returns"):
        state.load_state_dict([("iter", 3)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing keys"):
        state.load_state_dict({"iter": 3})
    other = PowerSGDState(None, matrix_approximation_rank=4).state_dict()
    with pytest.raises(ValueError, match=r"matrix_approximation_rank.*construct PowerSGDState"):
        state.load_state_dict(other)
    bad = dict(saved, iter=-2, error_dict={0: torch.zeros(2)})
    with pytest.raises(ValueError, match="iter"):
        state.load_state_dict(bad)
    bad = dict(saved, iter=3, error_dict={0: [0.0, 1.0]})
    with pytest.raises(TypeError, match=r"state_dict\['error_dict'\]: expected a mapping of bucket index to tensor"):
        state.load_state_dict(bad)
    bad = dict(saved, iter=3, error_dict={0: torch.zeros(2)}, layouts=[(0, ())])
    with pytest.raises(TypeError, match=r"state_dict\['layouts'\]: expected a mapping of bucket index to layout"):
        state.load_state_dict(bad)
    assert state.iter == 7  # a rejected dict changes nothing
    assert state.error_dict == {}
    with pytest.raises(TypeError, match="state: powerSGD_hook expects a PowerSGDState, got NoneType"):
        powerSGD_hook(None, None)  # type: ignore[arg-type]


def test_state_pickles_without_its_group() -> None:
    state = PowerSGDState(None, matrix_approximation_rank=2, random_seed=7)
    state.iter, state.error_dict[0] = 5, torch.arange(3.0)
    copied = pickle.loads(pickle.dumps(state))
    assert copied.process_group is None
    assert copied.iter == 5
    assert copied.matrix_approximation_rank == 2
    assert torch.equal(copied.error_dict[0], state.error_dict[0])
    assert copied.rng.randint(10**9) == state.rng.randint(10**9)


@pytest.mark.parametrize("name", ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"])
def test_signature_matches_torch(name: str) -> None:
    ours, theirs = inspect.signature(getattr(dcomm.ddp, name)), inspect.signature(getattr(torch_powersgd, name))
    assert list(ours.parameters) == list(theirs.parameters)
    for key, param in ours.parameters.items():
        assert param.default == theirs.parameters[key].default, key
    if name != "PowerSGDState":
        assert ours.parameters["bucket"].annotation is dist.GradBucket
        assert ours.return_annotation == torch.futures.Future[torch.Tensor]


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_powersgd_matches_torch_on_nccl() -> None:
    run_ranks(_parity, 2, backend="nccl", timeout=TIMEOUT)


def _static_graph_first_iteration(rank: int, world: int) -> None:
    # static_graph=True's first iteration hands every bucket over at once, all with index 0:
    # before the fix, compression from iteration 0 mixed one bucket's memories into the next
    # ("size of tensor a (272) must match ... (4)"). Now the buckets after the first are averaged
    # plainly, bit for bit as torch's allreduce_hook, and training goes on compressed.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks

    def model() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(16, 4))

    grads = {}
    for name in ("powersgd", "exact"):
        net = model()
        ddp = DDP(net, bucket_cap_mb_list=[0.0003] * 12, static_graph=True)  # about a bucket per parameter
        if name == "powersgd":
            state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0)
            ddp.register_comm_hook(state, powerSGD_hook)
        else:
            ddp.register_comm_hook(None, torch_default_hooks.allreduce_hook)
        for step in range(3):
            net.zero_grad()
            ddp(seeded_batch(rank, step, (5, 16))).pow(2).sum().backward()
            if step == 0:
                grads[name] = [p.grad.clone() for p in net.parameters()]
        assert_same_on_ranks([p.detach() for p in net.parameters()], name)
    # Every parameter but those of the first bucket handed over (the last layer's) got the exact
    # average; that bucket goes through PowerSGD.
    equal = [torch.equal(a, b) for a, b in zip(grads["powersgd"], grads["exact"], strict=True)]
    assert sum(equal) >= len(equal) - 2, equal


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_static_graph_first_iteration_does_not_mix_buckets(world: int) -> None:
    run_ranks(_static_graph_first_iteration, world)


class _Vector(nn.Module):
    """One parameter of ``numel`` values whose gradient is the batch itself: DDP's only bucket."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def _bucket_smaller_than_rank_squared(rank: int, world: int) -> None:
    # A bucket of fewer than rank**2 values is a square of side < rank: its factors have at
    # most ``side`` independent columns, so the approximation is the whole (exact) average.
    for numel, rank_r in ((1, 2), (1, 4), (3, 3), (3, 4)):
        state = PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=0)
        model = _Vector(numel)
        ddp = DDP(model)
        ddp.register_comm_hook(state, batched_powerSGD_hook)
        local = torch.randn(numel, generator=torch.Generator().manual_seed(rank + 1))
        ddp(local).backward()
        grads = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(grads, local)
        exact = sum(g.double() for g in grads) / world
        got = model.weight.grad
        assert got is not None
        what = f"{numel} values at matrix_approximation_rank={rank_r}"
        assert torch.isfinite(got).all(), f"{what}: averaged to {got.tolist()}"
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_batched_powersgd_of_a_bucket_smaller_than_rank_squared(world: int) -> None:
    run_ranks(_bucket_smaller_than_rank_squared, world, timeout=TIMEOUT)


class _Scaled(nn.Module):
    """A Linear times a 0-dim parameter (CLIP's ``logit_scale``, a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _zero_dim_parameter(rank: int, world: int) -> None:
    for batch_same_shape in (False, True):
        model = _Scaled()
        local = copy.deepcopy(model)
        ddp = DDP(model)
        config = {"matrix_approximation_rank": 1, "batch_tensors_with_same_shape": batch_same_shape}
        state = PowerSGDState(None, start_powerSGD_iter=0, **config)
        ddp.register_comm_hook(state, powerSGD_hook)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        ddp(x).square().sum().backward()
        local(x).square().sum().backward()
        assert local.scale.grad is not None
        assert model.scale.grad is not None
        grads = [torch.empty_like(local.scale.grad) for _ in range(world)]
        dist.all_gather(grads, local.scale.grad)
        # The 0-dim gradient is too small to compress: it is averaged exactly.
        assert_close([model.scale.grad], [sum(grads) / world], 1e-6, f"0-dim parameter ({config})")
        assert state.p_memory_dict, "the Linear weight was not compressed"
        assert_same_on_ranks([p.grad for p in model.parameters()], f"gradients ({config})")


@pytest.mark.timeout(300)
def test_powersgd_with_a_zero_dim_parameter() -> None:
    run_ranks(_zero_dim_parameter, 2, timeout=TIMEOUT)
