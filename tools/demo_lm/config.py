"""The demo's sizes: ``small`` (default, 4 CPU ranks, minutes), ``large`` (GPUs), ``tiny`` (CI), and
``diloco`` (the small model, DDP and DiLoCo only, 1000 steps: DiLoCo's quality goal at H = 50).

Example::

    >>> CONFIGS["small"].world_size
    4
"""

from __future__ import annotations

import dataclasses
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
    diloco_start: int
    """DiLoCo: steps of DDP (fp32 gradient allreduce) before the first inner step (0: DiLoCo from the start)."""
    powersgd_start: int
    timeout_s: float
    """Seconds before a hung job is stopped (the whole demo, every run)."""
    seed: int = 0
    only: tuple[str, ...] = ()
    """The runs whose name contains one of these words (and the baseline) when ``--only`` is not given; () all."""

    def new_model(self) -> TinyGPT:
        """The initial model, the same for every rank and run (seeded by ``seed``)."""
        torch.manual_seed(self.seed)
        return TinyGPT(self.layers, self.width, self.heads, self.context)


# One row per size; the columns are Config's fields after the name, in order (ctx: context,
# eval: eval_every, val: val_windows, sgd: local_sgd_start, start: diloco_start, psgd:
# powersgd_start). Three keyword calls would repeat the same eighteen lines three times.
# fmt: off
_SIZES = {
    #        world layers width heads ctx batch steps eval val  lr    corpus      sgd period diloco start psgd timeout
    "small": (4,   2,     64,   4,    64,  8,    40,   8,   64,  3e-3, 4_000_000,  10, 4,     10,    10,   10,  900.0),
    "large": (4,   6,     384,  6,    256, 32,   600,  50,  256, 1e-3, 64_000_000, 100, 8,    50,    150,  100, 3600.0),
    "tiny":  (2,   1,     32,   2,    32,  4,    12,   4,   16,  3e-3, 500_000,    4,  2,     4,     0,    4,   600.0),
}
# fmt: on
CONFIGS = {name: Config(name, *row) for name, row in _SIZES.items()}
# DiLoCo's quality goal at H = 50: the small model, the baseline and the DiLoCo runs only, long
# enough for 15 syncs after a quarter of the run as DDP (the DiLoCo paper starts from a model
# trained synchronously for 24k of its 88k steps; large does the same with 150 of 600 steps, small
# with 10 of 40).
CONFIGS["diloco"] = dataclasses.replace(
    CONFIGS["small"],
    name="diloco",
    steps=1000,
    eval_every=50,
    diloco_every=50,
    diloco_start=250,
    timeout_s=1800.0,
    only=("DiLoCo",),
)
