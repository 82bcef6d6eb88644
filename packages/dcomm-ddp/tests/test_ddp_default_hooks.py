"""dcomm's DDP hooks against torch's, trained side by side on real gloo ranks.

Every rank gets its own batches (seeded by rank and step), so parameters agree across ranks only
when the hook really averaged. Tolerances: 0 for the fp32 allreduce (same arithmetic as torch),
2.5e-3 relative for fp16, 2.5e-2 for bf16 (of each parameter's change over the run; see
FP16_RTOL).
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


DTYPES = (torch.float16, torch.float32, torch.float64)


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
        assert_trained_close(ours, train(torch_hook, None), rtol, f"{name} vs torch's")
        assert_trained_close(ours, fp32, rtol, f"{name} vs fp32 allreduce")
        assert_same_on_ranks(ours, name)
        # Two DDP models in one backward: their buckets are in flight at the same time, so
        # each must have its own low-precision buffer.
        pair = train(hook, None, models=2)
        assert_trained_close(pair, train(torch_hook, None, models=2), rtol, f"{name}, two models vs torch's")

    # The bucket is already fp16: averaged in place, the same arithmetic as torch's.
    half = train(fp16_compress_hook, None, dtype=torch.float16)
    assert_trained_close(half, train(torch_hooks.fp16_compress_hook, None, dtype=torch.float16), 0, "fp16 model")
    # A float64 bucket compressed to bf16.
    double = train(bf16_compress_hook, None, dtype=torch.float64)
    assert_trained_close(double, train(torch_bf16_hook, None, dtype=torch.float64), BF16_RTOL, "bf16 on float64")
    # A bucket of the other low precision: cast, then divide in the sent dtype, as torch does, so
    # bit-identical to torch's hook (dividing in one kernel rounded a bf16 bucket's quotient to
    # bf16's 8 bits before it became fp16).
    for dtype, hook, torch_hook in [
        (torch.bfloat16, fp16_compress_hook, torch_hooks.fp16_compress_hook),
        (torch.float16, bf16_compress_hook, torch_bf16_hook),
    ]:
        cross = train(hook, None, dtype=dtype)
        assert_trained_close(cross, train(torch_hook, None, dtype=dtype), 0, f"{hook.__name__} on a {dtype} model")

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


def _steady_state_and_errors(rank: int, world: int) -> None:
    # The low-precision copy of each bucket is allocated once (after DDP's bucket rebuild at
    # step 1) and reused: no allocation per step.
    seen: list[list[int]] = []

    def recording(
        process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        fut = fp16_compress_hook(process_group, bucket)
        if bucket.index() == 0:
            seen.append([])
        seen[-1].append(bucket.buffer()._dcomm_ddp_low_precision.data_ptr())
        return fut

    net = make_model(torch.float32)
    ddp = DDP(net, bucket_cap_mb_list=BUCKET_CAPS)
    ddp.register_comm_hook(None, recording)
    for step in range(5):
        ddp(seeded_batch(rank, step, (5, 6))).sum().backward()
    assert len(seen[1]) > 1, seen
    assert seen[1] == seen[2] == seen[3] == seen[4], seen

    # Gradients whose fp16 cast overflows: torch's hook returns inf, the average is finite here.
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
    assert results[0] == pytest.approx(4e4, rel=1e-3), results
    assert results[1] == float("inf"), results

    # A state that is not a process group: a clear error from backward, on every rank, no hang.
    for hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook):
        ddp = DDP(make_model(torch.float32))
        ddp.register_comm_hook(PostLocalSGDState(None, None, 1, post_local_gradient_allreduce=False), hook)
        with pytest.raises(Exception, match=r"process_group: \w+ expects a ProcessGroup or None as its state"):
            ddp(seeded_batch(rank, 0, (5, 6))).sum().backward()


def test_steady_state_overflow_and_errors() -> None:
    run_ranks(_steady_state_and_errors, 2)


def _reducer_and_python_callers(rank: int, world: int) -> None:
    import dcomm.ddp.default_hooks as default_hooks

    cast_backs = []
    original = default_hooks.copy_back

    def counting_copy_back(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        cast_backs.append(src.dtype)
        return original(dst, src)

    default_hooks.copy_back = counting_copy_back
    results: list[tuple[torch.dtype, bool]] = []

    def wrapper(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        def check(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()
            results.append((value.dtype, torch.equal(value, bucket.buffer())))
            return value

        return bf16_compress_hook(process_group, bucket).then(check)

    grads = {}
    for name, hook in (("reducer", bf16_compress_hook), ("python", wrapper)):
        net = make_model(torch.float32)
        ddp = DDP(net, bucket_cap_mb_list=BUCKET_CAPS)
        ddp.register_comm_hook(None, hook)
        for step in range(3):
            net.zero_grad()
            ddp(seeded_batch(rank, step, (5, 6))).pow(2).sum().backward()
        grads[name] = [p.grad.clone() for p in net.parameters()]
        if name == "reducer":
            # DDP's reducer gets the bf16 sum and casts it while unpacking the bucket: no cast back.
            assert cast_backs == [], cast_backs
    # Called from Python, the hook keeps torch's contract: the bucket holds the average, in fp32.
    assert cast_backs, cast_backs
    assert set(cast_backs) == {torch.bfloat16}, cast_backs
    assert results, results
    assert all(dtype == torch.float32 and same for dtype, same in results), results
    # Both ways give the same gradients, bit for bit (the same bf16 sum cast to fp32).
    for a, b in zip(grads["reducer"], grads["python"], strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    assert_same_on_ranks(grads["reducer"], "bf16 gradients")


@pytest.mark.parametrize("world", [2, 3])
def test_reducer_gets_low_precision_sum_python_callers_get_the_bucket(world: int) -> None:
    run_ranks(_reducer_and_python_callers, world)


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
    # buckets. The reducer path's completed futures must give torch's results in each: a
    # gradient read before its allreduce finished is off by its whole local/average gap.
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
        initial = [p.detach().clone() for p in PartlyUsed(unused).body.parameters()]
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
            if name == "allreduce":
                assert_close(grads["ours"] + params["ours"], grads["torch"] + params["torch"], 0.0, what)
            else:  # torch's rounding: the changes agree within the other fp16 tests' tolerance
                assert_updates_close(params["ours"], params["torch"], initial, FP16_RTOL, what)
            assert_same_on_ranks(params["ours"], what)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_reducer_path_matches_torch_in_every_ddp_mode(world: int) -> None:
    run_ranks(_ddp_modes, world)


def _uneven_inputs(rank: int, world: int) -> None:
    # Under torch's Join, a rank that ran out of data shadows the others' allreduces by calling
    # the hook itself (from Python), while the others' DDP reducers call it: both paths meet.
    from torch.distributed.algorithms.join import Join

    results = {}
    for name, hook in (("ours", allreduce_hook), ("torch", torch_hooks.allreduce_hook)):
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
    assert_close(results["ours"], results["torch"], 0.0, "allreduce_hook under Join with uneven inputs")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_uneven_inputs_under_join_match_torch(world: int) -> None:
    run_ranks(_uneven_inputs, world)
