"""Training runs the tests compare between torch's implementation and dcomm's.

Example::

    >>> params = train_ddp(seeded_mlp(6, 12, 3), allreduce_hook, None, batch, steps=4)  # doctest: +SKIP
    >>> first_grads, params = train_sgd(fsdp_model, batch, steps=3)  # doctest: +SKIP
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm_testing.helpers import assert_close, seeded_pair
from dcomm_testing.models import seeded_mlp

__all__ = ["DDPRun", "PostLocalSGDRun", "train_ddp", "train_sgd"]


def _detached_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()


def _sum_of_squares(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


class DDPRun:
    """A DDP model with a comm hook, trained by SGD with momentum on ``loss(ddp(batch(step)))``.

    ``hook`` (with ``state``) is registered when given; ``ddp_kwargs`` go to DDP (bucket caps,
    say). The loss is the sum of the squared outputs unless told otherwise. Subclasses add what
    their test saves and restores.

    Example::

        >>> run = DDPRun(seeded_mlp(6, 10, 3), allreduce_hook, None, batch, bucket_cap_mb=0.01)  # doctest: +SKIP
        >>> params = run.train(0, 4)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        hook: Callable[..., Any] | None,
        state: object,
        batch: Callable[[int], torch.Tensor],
        *,
        lr: float = 0.05,
        momentum: float = 0.9,
        loss: Callable[[torch.Tensor], torch.Tensor] = _sum_of_squares,
        **ddp_kwargs: Any,
    ) -> None:
        self.model, self.state, self.batch, self.loss = model, state, batch, loss
        self.ddp = DDP(model, **ddp_kwargs)
        if hook is not None:
            self.ddp.register_comm_hook(state, hook)
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

    def step(self, step: int) -> None:
        """One optimizer step on ``batch(step)``."""
        self.opt.zero_grad()
        self.loss(self.ddp(self.batch(step))).backward()
        self.opt.step()

    def train(self, first: int, last: int) -> list[torch.Tensor]:
        """Steps ``first`` to ``last - 1``; the parameters after them."""
        for step in range(first, last):
            self.step(step)
        return self.params()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def train_ddp(
    model: nn.Module,
    hook: Callable[..., Any] | None,
    state: object,
    batch: Callable[[int], torch.Tensor],
    steps: int,
    **kwargs: Any,
) -> list[torch.Tensor]:
    """``model``'s parameters after ``steps`` steps of a :class:`DDPRun` (``kwargs``: its options).

    Example::

        >>> train_ddp(model, fp16_compress_hook, None, lambda step: x[step], 4, bucket_cap_mb=0.01)  # doctest: +SKIP
    """
    return DDPRun(model, hook, state, batch, **kwargs).train(0, steps)


def train_sgd(
    model: nn.Module,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    *,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
    keep: Callable[[torch.Tensor], torch.Tensor] = _detached_copy,
    lr: float = 0.05,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(first-step gradients, parameters after ``steps`` plain SGD steps), each passed through ``keep``.

    Step ``s`` minimises ``loss(model(x), y)`` for ``x, y = batch(s)``. ``keep`` copies a tensor
    out (a detached clone by default; ``lambda t: t.detach().full_tensor()`` for sharded ones).

    Example::

        >>> grads, params = train_sgd(fsdp_model, lambda step: seeded_pair(step, (4, 6), (4, 5)), 3)  # doctest: +SKIP
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    first: list[torch.Tensor] = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss(model(x), y).backward()
        if step == 0:
            first = [keep(p.grad) for p in model.parameters()]
        opt.step()
    return first, [keep(p) for p in model.parameters()]


class PostLocalSGDRun:
    """DDP with torch's ``post_localSGD_hook``, SGD with momentum and ``lib``'s averager, on seeded batches.

    ``lib`` is :func:`dcomm_testing.implementation`'s namespace of one side; ``make_averager(lib)``
    builds the averager. ``layers=1`` trains one bias-free ``Linear(6, 3)`` and a Tanh (DDP's
    bucket layout then never changes, so a resumed run is bit-identical), ``layers=2``
    ``seeded_mlp(6, 8, 3)``; both seeded with ``seed``. With ``wrapped`` the averager runs inside
    ``lib.PostLocalSGDOptimizer``, else after each optimizer step.

    Example::

        >>> run = PostLocalSGDRun(implementation("dcomm"), make_averager, subgroup, warmup=3)  # doctest: +SKIP
        >>> run.step(rank, 0); blob = run.checkpoint()  # doctest: +SKIP
    """

    def __init__(
        self,
        lib: Any,
        make_averager: Callable[[Any], Any],
        subgroup: Any,
        *,
        warmup: int,
        layers: int = 1,
        wrapped: bool = True,
        seed: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.device = device or torch.device("cpu")
        if layers == 1:
            torch.manual_seed(seed)
            module: nn.Module = nn.Sequential(nn.Linear(6, 3, bias=False), nn.Tanh())
        else:
            module = seeded_mlp(6, 8, 3, seed=seed)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DDP(module.to(self.device), device_ids=ids)
        self.hook_state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=warmup)
        self.model.register_comm_hook(self.hook_state, post_localSGD_hook)
        self.averager = make_averager(lib)
        self.local = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.opt = lib.PostLocalSGDOptimizer(self.local, self.averager) if wrapped else self.local
        self.wrapped = wrapped

    def step(self, rank: int, step: int) -> None:
        """One training step on this rank's batch of ``step``, then the averager's turn."""
        self.opt.zero_grad()
        x, y = seeded_pair(1000 * rank + step, (5, 6), (5, 3), y_scale=0.5 * (rank + 1), uniform_y=True)
        ((self.model(x.to(self.device)) - y.to(self.device)) ** 2).mean().backward()
        self.opt.step()
        if not self.wrapped:
            self.averager.average_parameters(self.model.parameters())

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def checkpoint(self) -> bytes:
        """Model, optimizer, averager and the hook's iteration, saved with ``torch.save``."""
        buffer = io.BytesIO()
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.opt.state_dict(),
            "averager": self.averager.state_dict(),
            "hook_iter": self.hook_state.iter,  # torch's hook state has no state_dict
        }
        torch.save(state, buffer)
        return buffer.getvalue()

    def restore(self, blob: bytes) -> None:
        """Load a :meth:`checkpoint` (the averager's own state only when not wrapped: the optimizer holds it)."""
        checkpoint = torch.load(io.BytesIO(blob), map_location=self.device)
        self.model.module.load_state_dict(checkpoint["model"])
        self.opt.load_state_dict(checkpoint["optimizer"])
        if not self.wrapped:
            self.averager.load_state_dict(checkpoint["averager"])
        self.hook_state.iter = checkpoint["hook_iter"]

    def assert_resumes(
        self, fresh: Callable[[], PostLocalSGDRun], rank: int, saved: dict[int, bytes], history: list, what: str
    ) -> None:
        """Each checkpoint ``saved[start]`` restored into ``fresh()`` replays ``history[start:]`` bit for bit.

        ``history[step]`` holds this run's parameters after ``step``; ``saved[start]`` its checkpoint
        taken before ``start``.
        """
        for start, blob in saved.items():
            resumed = fresh()
            resumed.restore(blob)
            assert resumed.averager.step == start, (what, start, resumed.averager.step)
            for step in range(start, len(history)):
                resumed.step(rank, step)
                assert_close(resumed.params(), history[step], 0.0, f"{what}: resumed at {start}, step {step}")
