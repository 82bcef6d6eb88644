"""dcomm's DDP hooks against torch's, trained side by side on real gloo ranks.

Every rank gets its own batches (seeded by rank and step), so parameters agree across ranks only
when the hook really averaged. Every hook does torch's arithmetic: tolerance 0 against torch's
hook of the same name, for fp32, fp16, bf16 and fp64 models. Against the fp32 allreduce the
compressed hooks agree within 2.5e-3 relative (fp16) and 2.5e-2 (bf16) of each parameter's change
over the run (see FP16_RTOL).
"""

import inspect
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import dcomm.ddp
from dcomm.ddp import PostLocalSGDState, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from dcomm_testing import assert_close, assert_same_on_ranks, assert_updates_close, run_ranks, seeded_batch, seeded_mlp

STEPS = 4
# Relative error allowed in the parameter changes: the casts, divisions and world - 1 additions of
# the low-precision allreduce round each gradient a few times to 2**-11 (fp16) or 2**-8 (bf16),
# and momentum carries that into every later step. Measured at worlds 2-4: at most 1.7e-3 (fp16)
# and 1.5e-2 (bf16), for torch's hooks and for dcomm's alike.
FP16_RTOL = 2.5e-3
BF16_RTOL = 2.5e-2
# Per-bucket caps of ~300 bytes: every parameter gets its own bucket, so a step has several.
BUCKET_CAPS = [0.0003] * 8


def torch_bf16_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    # DDP refuses to register anything named "bf16_compress_hook" without NCCL; torch's hook
    # itself runs fine on gloo.
    return torch_hooks.bf16_compress_hook(process_group, bucket)


DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def make_model(dtype: torch.dtype) -> nn.Module:
    return seeded_mlp(6, 12, 12, 3, dtype=dtype)  # the same initial parameters on every rank and for every run


INITIAL = {dtype: [p.detach().clone() for p in make_model(dtype).parameters()] for dtype in DTYPES}


def train(
    hook: Callable | None, state: object, dtype: torch.dtype = torch.float32, models: int = 1
) -> list[torch.Tensor]:
    """Parameters after STEPS steps of SGD with momentum; ``models`` DDP models share a backward."""
    rank = dist.get_rank()
    nets = [make_model(dtype) for _ in range(models)]
    ddps = [DDP(net, bucket_cap_mb_list=BUCKET_CAPS) for net in nets]
    if hook is not None:
        for ddp in ddps:
            ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD([p for net in nets for p in net.parameters()], lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x = seeded_batch(rank, step, (5, 6), dtype=dtype)
        sum(ddp(x * (i + 1)).pow(2).sum() for i, ddp in enumerate(ddps)).backward()
        opt.step()
    return [p.detach().clone() for net in nets for p in net.parameters()]


def assert_trained_close(ours: list[torch.Tensor], ref: list[torch.Tensor], rtol: float, what: str) -> None:
    """Equal parameters (``rtol == 0``), or parameter changes from INITIAL equal within ``rtol``."""
    if rtol == 0:
        assert_close(ours, ref, 0.0, what)
        return
    initial = INITIAL[ours[0].dtype]
    assert_updates_close(ours, ref, initial * (len(ours) // len(initial)), rtol, what)


def _parity(rank: int, world: int) -> None:
    fp32 = train(torch_hooks.allreduce_hook, None)
    ours = train(allreduce_hook, None)
    assert_trained_close(ours, fp32, 0, "allreduce_hook vs torch")
    assert_same_on_ranks(ours, "allreduce_hook")

    cases = [
        ("fp16", fp16_compress_hook, torch_hooks.fp16_compress_hook, FP16_RTOL),
        ("bf16", bf16_compress_hook, torch_bf16_hook, BF16_RTOL),
    ]
    for name, hook, torch_hook, rtol in cases:
        ours = train(hook, None)
        assert_trained_close(ours, train(torch_hook, None), 0, f"{name} vs torch's")
        assert_trained_close(ours, fp32, rtol, f"{name} vs fp32 allreduce")
        assert_same_on_ranks(ours, name)
        # Two DDP models in one backward: their buckets are in flight at the same time, so
        # each must have its own low-precision buffer.
        pair = train(hook, None, models=2)
        assert_trained_close(pair, train(torch_hook, None, models=2), 0, f"{name}, two models vs torch's")

    # Every hook on models of every dtype: torch's results, bit for bit. Already in the sent dtype
    # the bucket is averaged in place; from another low precision it is cast, then divided.
    hooks = [
        (allreduce_hook, torch_hooks.allreduce_hook),
        (fp16_compress_hook, torch_hooks.fp16_compress_hook),
        (bf16_compress_hook, torch_bf16_hook),
    ]
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        for hook, torch_hook in hooks:
            ours = train(hook, None, dtype=dtype)
            assert_trained_close(ours, train(torch_hook, None, dtype=dtype), 0, f"{hook.__name__} on a {dtype} model")

    if world % 2 == 0 and world > 2:
        # State = a subgroup: average within pairs [0, 1], [2, 3], ...
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        mine = pairs[rank // 2]
        for hook, torch_hook, rtol in [
            (allreduce_hook, torch_hooks.allreduce_hook, 0),
            (fp16_compress_hook, torch_hooks.fp16_compress_hook, FP16_RTOL),
        ]:
            ours = train(hook, mine)
            assert_trained_close(ours, train(torch_hook, mine), rtol, f"{hook.__name__} on a subgroup")
            assert_same_on_ranks(ours, "subgroup", mine)
            other = [torch.empty_like(ours[0]) for _ in range(world)]
            dist.all_gather(other, ours[0])
            assert not torch.equal(other[0], other[2]), "ranks of different subgroups agree"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_hooks_match_torch(world: int) -> None:
    run_ranks(_parity, world)


def _overflow_and_errors(rank: int, world: int) -> None:
    # Gradients whose fp16 cast overflows: torch's hook gives inf, and so does ours (same arithmetic).
    scale = torch.tensor([7e4 if rank == 0 else 1e4])
    results = []
    for hook in (fp16_compress_hook, torch_hooks.fp16_compress_hook):
        torch.manual_seed(0)
        lin = nn.Linear(1, 1, bias=False)
        lin.weight.data.fill_(1.0)
        ddp = DDP(lin)
        ddp.register_comm_hook(None, hook)
        (ddp(torch.ones(1, 1)) * scale).sum().backward()
        results.append(lin.weight.grad.item())
    assert results == [float("inf")] * 2, results

    # A state that is not a process group: a clear error from backward, on every rank, no hang.
    for hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook):
        ddp = DDP(make_model(torch.float32))
        ddp.register_comm_hook(PostLocalSGDState(None, None, 1, post_local_gradient_allreduce=False), hook)
        with pytest.raises(Exception, match=r"process_group: \w+ expects a ProcessGroup or None as its state"):
            ddp(seeded_batch(rank, 0, (5, 6))).sum().backward()


def test_overflow_and_errors() -> None:
    run_ranks(_overflow_and_errors, 2)


class StubBucket:
    """What a direct Python caller may hand a hook: an object with the bucket's ``buffer()``."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def _direct_calls(rank: int, world: int) -> None:
    # torch's contract, whoever calls: the future's value is the bucket itself, averaged, in its dtype.
    hooks = [
        (allreduce_hook, torch_hooks.allreduce_hook),
        (fp16_compress_hook, torch_hooks.fp16_compress_hook),
        (bf16_compress_hook, torch_hooks.bf16_compress_hook),
    ]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        gradient = seeded_batch(rank, 7, (37,)).to(dtype) * (rank + 1)
        for hook, torch_hook in hooks:
            ours, theirs = gradient.clone(), gradient.clone()
            value = hook(None, StubBucket(ours)).wait()  # type: ignore[arg-type]
            expected = torch_hook(None, StubBucket(theirs)).wait()  # type: ignore[arg-type]
            what = f"{hook.__qualname__} called directly on a {dtype} bucket"
            assert value is ours, what
            assert value.dtype == dtype, what
            assert torch.equal(value, expected), what
            assert not torch.equal(value, gradient) or world == 1, f"{what}: nothing averaged"
            assert_same_on_ranks([value], what)

    # Called from a Python hook that DDP's reducer calls (the ZeRO overlap hooks do so): the same.
    seen: list[tuple[bool, torch.dtype]] = []

    def wrapper(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        def check(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()
            seen.append((value is bucket.buffer() or value.data_ptr() == bucket.buffer().data_ptr(), value.dtype))
            return value

        return bf16_compress_hook(process_group, bucket).then(check)

    wrapped = train(wrapper, None)
    assert seen, seen
    assert all(same and dtype == torch.float32 for same, dtype in seen), seen
    assert_trained_close(wrapped, train(torch_bf16_hook, None), 0, "bf16_compress_hook inside a Python hook")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_direct_call_returns_the_averaged_bucket_as_torch_does(world: int) -> None:
    run_ranks(_direct_calls, world)


@pytest.mark.parametrize("name", ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"])
def test_signature_matches_torch(name: str) -> None:
    ours, theirs = inspect.signature(getattr(dcomm.ddp, name)), inspect.signature(getattr(torch_hooks, name))
    assert list(ours.parameters) == list(theirs.parameters) == ["process_group", "bucket"]
    assert ours.parameters["bucket"].annotation is dist.GradBucket
    assert ours.return_annotation == torch.futures.Future[torch.Tensor] == theirs.return_annotation
    # DDP refuses a hook *named* bf16_compress_hook on builds without NCCL; ours runs on gloo.
    assert getattr(dcomm.ddp, name).__qualname__ == name


def test_public_names() -> None:
    assert set(dcomm.ddp.__all__) >= {
        "__version__",
        "allreduce_hook",
        "fp16_compress_hook",
        "bf16_compress_hook",
        "PostLocalSGDState",
        "post_localSGD_hook",
    }
    assert dcomm.ddp.__version__.count(".") == 2


def _sparse_gradients(rank: int, world: int) -> None:
    torch.manual_seed(0)
    for hook in (fp16_compress_hook, bf16_compress_hook):
        model = DDP(nn.Embedding(10, 3, sparse=True))
        model.register_comm_hook(None, hook)
        loss = model(torch.tensor([rank, rank + 1])).sum()
        with pytest.raises(Exception, match=r"bucket: \w+ compresses dense gradients, but this bucket holds a sparse"):
            loss.backward()


@pytest.mark.timeout(300)
def test_sparse_gradients_named_in_compress_hooks() -> None:
    run_ranks(_sparse_gradients, 2)


class PartlyUsed(nn.Module):
    """The test MLP, with an ``unused`` layer that gets no gradient when ``unused`` is True."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.body = seeded_mlp(6, 12, 12, 3)
        torch.manual_seed(1)
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _ddp_modes(rank: int, world: int) -> None:
    # DDP hands buckets to the hook in other ways in these modes: all at once from its
    # post-backward callback, with one index and none "last" (static_graph's first iteration),
    # with unused parameters marked ready by DDP itself, or with gradients that are views of the
    # buckets. Each must give torch's results.
    modes = [
        {"static_graph": True},
        {"find_unused_parameters": True},
        {"gradient_as_bucket_view": True},
        {"static_graph": True, "find_unused_parameters": True, "gradient_as_bucket_view": True},
    ]
    hooks = {
        "allreduce": (allreduce_hook, torch_hooks.allreduce_hook),
        "fp16": (fp16_compress_hook, torch_hooks.fp16_compress_hook),
    }
    for kwargs in modes:
        # Unused parameters only where DDP is told to expect them (otherwise it raises).
        unused = bool(kwargs.get("find_unused_parameters") or kwargs.get("static_graph"))
        for name, (ours_hook, torch_hook) in hooks.items():
            grads, params = {}, {}
            for impl, hook in (("ours", ours_hook), ("torch", torch_hook)):
                net = PartlyUsed(unused)
                ddp = DDP(net, bucket_cap_mb_list=BUCKET_CAPS, **kwargs)
                ddp.register_comm_hook(None, hook)
                opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
                grads[impl] = []
                for step in range(STEPS):
                    opt.zero_grad()
                    ddp(seeded_batch(rank, step, (5, 6))).pow(2).sum().backward()
                    grads[impl] += [p.grad.clone() for p in net.body.parameters()]
                    opt.step()
                params[impl] = [p.detach().clone() for p in net.body.parameters()]  # the unused layer stays
            what = f"{name} hook under {kwargs}"
            assert_close(grads["ours"] + params["ours"], grads["torch"] + params["torch"], 0.0, what)
            assert_same_on_ranks(params["ours"], what)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_reducer_path_matches_torch_in_every_ddp_mode(world: int) -> None:
    run_ranks(_ddp_modes, world)


def _uneven_inputs(rank: int, world: int) -> None:
    # Under torch's Join, a rank that ran out of data shadows the others' allreduces by calling
    # the hook from Python, while the others' DDP reducers call it.
    from torch.distributed.algorithms.join import Join

    pairs = [
        (allreduce_hook, torch_hooks.allreduce_hook),
        (fp16_compress_hook, torch_hooks.fp16_compress_hook),
        (bf16_compress_hook, torch_bf16_hook),
    ]
    for ours_hook, torch_hook in pairs:
        results = {}
        for name, hook in (("ours", ours_hook), ("torch", torch_hook)):
            net = seeded_mlp(6, 12, 12, 3)
            ddp = DDP(net, bucket_cap_mb_list=BUCKET_CAPS)
            ddp.register_comm_hook(None, hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            with Join([ddp]):
                for step in range(STEPS + rank):  # rank r has r more batches
                    opt.zero_grad()
                    ddp(seeded_batch(rank, step, (5, 6))).pow(2).sum().backward()
                    opt.step()
            results[name] = [p.detach().clone() for p in net.parameters()]
        what = f"{ours_hook.__qualname__} under Join with uneven inputs"
        assert_close(results["ours"], results["torch"], 0.0, what)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_uneven_inputs_under_join_match_torch(world: int) -> None:
    run_ranks(_uneven_inputs, world)
