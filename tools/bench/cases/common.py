"""What every case builder shares: the context of one workload and precision, and training steps.

Example::

    >>> ctx = Context(bench, WORKLOADS["mlp-deep"]["small"], "fp32")  # doctest: +SKIP
    >>> ddp = ctx.ddp(ctx.model())  # doctest: +SKIP
    >>> step = train_step(ctx, ddp, torch.optim.SGD(ddp.parameters(), lr=LR))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tools.bench.ab import Case, Pair, Variant
from tools.bench.timing import Bench, Step
from tools.bench.workloads import Workload, precision_scope
from tools.impls import IMPLS

__all__ = ["DEFAULT_SYNC_EVERY", "LR", "Context", "add_versions", "impl_pairs", "sgd_variant", "train_step"]

LR = 1e-6
"""Small enough that hundreds of steps on random data never overflow fp16 gradients."""

DEFAULT_SYNC_EVERY = 8
"""DiLoCo's H in the DiLoCo case unless ``--sync-every`` says otherwise."""


@dataclass
class Context:
    """The bench (device, side group), the workload and the precision a case runs with."""

    bench: Bench
    workload: Workload
    precision: str
    sync_every: int = DEFAULT_SYNC_EVERY
    """Inner steps per sync of the DiLoCo variants (DiLoCo's H; ``--sync-every``)."""

    @property
    def device(self) -> torch.device:
        return self.bench.device

    @property
    def world(self) -> int:
        return self.bench.world

    def model(self) -> nn.Module:
        """A fresh copy of the workload's model on this rank's device (the same on every rank)."""
        return self.workload.build(self.device)

    def ddp(self, module: nn.Module, **kwargs: object) -> nn.parallel.DistributedDataParallel:
        device_ids = [self.device] if self.bench.is_cuda else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **kwargs)


def train_step(ctx: Context, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Step:
    """One training step on this rank's fixed batch; ``optimizer=None`` when it steps inside backward."""
    batch = ctx.workload.make_batch(ctx.device)
    zero_grad = (optimizer or model).zero_grad

    def step() -> None:
        zero_grad(set_to_none=False)
        with precision_scope(ctx.precision, ctx.device):
            loss = ctx.workload.loss(model, batch)
        loss.backward()
        if optimizer is not None:
            optimizer.step()

    return step


def sgd_variant(ctx: Context, model: nn.Module) -> Variant:
    """SGD training of ``model`` as a variant."""
    return Variant(train_step(ctx, model, torch.optim.SGD(model.parameters(), lr=LR)))


def impl_pairs(label: str, dcomm: str, torch_: str, reference: str | None = None) -> list[Pair]:
    """dcomm vs torch, and when given, each of them vs the reference variant."""
    pairs = [Pair(label, dcomm, torch_, "dcomm/torch")]
    if reference is not None:
        pairs.append(Pair(label, dcomm, reference, "dcomm/reference"))
        pairs.append(Pair(label, torch_, reference, "torch/reference"))
    return pairs


def add_versions(
    case: Case, label: str, name: str, build: Callable[[str], Variant], reference: str | None = None
) -> None:
    """Add variants ``torch <name>`` and ``dcomm <name>`` (``build(impl)``) and their pairs to ``case``."""
    for impl in IMPLS:
        case.variants[f"{impl} {name}"] = functools.partial(build, impl)
    case.pairs += impl_pairs(label, f"dcomm {name}", f"torch {name}", reference)
