"""The demo's sizes: ``small`` (default, 4 CPU ranks, minutes), ``large`` (GPUs), ``tiny`` (CI).

Example::

    >>> CONFIGS["small"].world_size
    4
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import TinyGPT

__all__ = ["CONFIGS", "Config"]


@dataclass(frozen=True)
class Config:
    """Model, data and schedule of one demo configuration (the same for every algorithm)."""

    name: str
    world_size: int
    layers: int
    width: int
    heads: int
    context: int
    batch_size: int
    """Sequences per rank and step."""
    steps: int
    eval_every: int
    val_windows: int
    lr: float
    corpus_bytes: int
    local_sgd_start: int
    """Post-local SGD: steps of global gradient allreduce before local steps (averagers' warmup)."""
    period: int
    """Model averaging period; the hierarchy averages within a node at half of it."""
    diloco_every: int
    """DiLoCo: inner steps between synchronisations."""
    powersgd_start: int
    timeout_s: float
    """Seconds before a hung job is stopped (the whole demo, every run)."""
    seed: int = 0

    def new_model(self) -> TinyGPT:
        """The initial model, the same for every rank and run (seeded by ``seed``)."""
        torch.manual_seed(self.seed)
        return TinyGPT(self.layers, self.width, self.heads, self.context)


CONFIGS = {
    "small": Config(
        name="small",
        world_size=4,
        layers=2,
        width=64,
        heads=4,
        context=64,
        batch_size=8,
        steps=40,
        eval_every=8,
        val_windows=64,
        lr=3e-3,
        corpus_bytes=4_000_000,
        local_sgd_start=10,
        period=4,
        diloco_every=10,
        powersgd_start=10,
        timeout_s=900.0,
    ),
    "large": Config(
        name="large",
        world_size=4,
        layers=6,
        width=384,
        heads=6,
        context=256,
        batch_size=32,
        steps=600,
        eval_every=50,
        val_windows=256,
        lr=1e-3,
        corpus_bytes=64_000_000,
        local_sgd_start=100,
        period=8,
        diloco_every=50,
        powersgd_start=100,
        timeout_s=3600.0,
    ),
    "tiny": Config(
        name="tiny",
        world_size=2,
        layers=1,
        width=32,
        heads=2,
        context=32,
        batch_size=4,
        steps=12,
        eval_every=4,
        val_windows=16,
        lr=3e-3,
        corpus_bytes=500_000,
        local_sgd_start=4,
        period=2,
        diloco_every=4,
        powersgd_start=4,
        timeout_s=600.0,
    ),
}
