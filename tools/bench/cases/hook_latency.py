"""Host-side cost of DDP hooks over many small buckets: one call directly, and a DDP step.

``call`` variants invoke a hook on :data:`BUCKETS` synthetic buckets of :data:`BUCKET_NUMEL`
elements each and time only the calls (the collectives they start are waited for afterwards,
outside the timing): seconds per call, the cost DDP pays on its backward thread per bucket.
``step`` variants train a model of many tiny layers with DDP cut into one bucket per parameter,
so a step's time is dominated by per-bucket work. Both are independent of the workload. dcomm's
hooks keep torch's contract whoever calls them; the ``step`` rows register them in C++ on DDP's
reducer (``dcomm.ddp.register_comm_hook(..., native=True)``).

Example::

    >>> case = hook_latency_case(ctx)  # doctest: +SKIP
    >>> case.pairs[0].label, case.pairs[0].kind  # doctest: +SKIP
    ('hook-latency/allreduce call', 'dcomm/torch')
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tools.bench.ab import Case, Variant
from tools.bench.cases.common import LR, Context, add_versions
from tools.bench.cases.ddp import DDP_HOOKS, register_hook
from tools.impls import resolve

__all__ = ["BUCKETS", "BUCKET_NUMEL", "SyntheticBucket", "hook_latency_case"]

BUCKETS = 64
BUCKET_NUMEL = 1024
TINY_LAYERS = 32
"""Layers of the many-bucket DDP model (2 tensors each, one bucket per tensor)."""


class SyntheticBucket:
    """The part of ``dist.GradBucket`` that DDP hooks read: the flat buffer, its index, its parameters."""

    def __init__(self, index: int, count: int, buffer: torch.Tensor) -> None:
        self._index, self._count, self._buffer = index, count, buffer
        self._parameter = nn.Parameter(torch.empty_like(buffer))
        self._parameter.grad = buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]

    def parameters(self) -> list[torch.Tensor]:
        return [self._parameter]


def build_hook_calls(ctx: Context, impl: str, name: str) -> Variant:
    """Calls of one hook on :data:`BUCKETS` small buckets; the step returns seconds per call."""
    hook = resolve(impl, DDP_HOOKS[name])
    buckets = [
        SyntheticBucket(index, BUCKETS, torch.full((BUCKET_NUMEL,), float(ctx.bench.rank), device=ctx.device))
        for index in range(BUCKETS)
    ]

    def step() -> float:
        start = time.perf_counter()
        futures = [hook(None, bucket) for bucket in buckets]
        elapsed = time.perf_counter() - start
        torch.futures.wait_all(futures)
        return elapsed / len(buckets)

    return Variant(step)


def build_many_bucket_ddp(ctx: Context, hook: tuple[str, str] | None) -> Variant:
    """DDP over :data:`TINY_LAYERS` 32x32 Linear layers, each tensor its own bucket."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32, device=ctx.device) for _ in range(TINY_LAYERS)))
    ddp = ctx.ddp(model, bucket_cap_mb=1e-6)
    if hook is not None:
        impl, name = hook
        register_hook(ddp, None, resolve(impl, DDP_HOOKS[name]), impl)
    batch = torch.randn(8, 32, generator=torch.Generator().manual_seed(ctx.bench.rank)).to(ctx.device)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        ddp(batch).square().mean().backward()
        optimizer.step()

    return Variant(step)


def hook_latency_case(ctx: Context) -> Case:
    details = {"buckets": BUCKETS, "bucket numel": BUCKET_NUMEL, "step buckets": 2 * TINY_LAYERS}
    case = Case("hook-latency", {"builtin step": lambda: build_many_bucket_ddp(ctx, None)}, [], details=details)
    for name in DDP_HOOKS:
        calls = lambda impl, name=name: build_hook_calls(ctx, impl, name)  # noqa: E731
        steps = lambda impl, name=name: build_many_bucket_ddp(ctx, (impl, name))  # noqa: E731
        add_versions(case, f"hook-latency/{name} call", f"{name} call", calls)
        add_versions(case, f"hook-latency/{name} step", f"{name} step", steps, "builtin step")
    return case
