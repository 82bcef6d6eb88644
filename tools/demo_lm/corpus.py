"""The text the demo learns: the running interpreter's own standard library, as bytes.

Every Python installation carries it, so the demo needs no download. The ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (installed packages left out) are sorted by path; every
tenth file goes to validation, the rest to training, so the split is the same on every run and
no file is in both. A batch is a set of windows at offsets drawn from a generator seeded by
(seed, rank, step): the same data order for every algorithm, different data on every rank.

Example::

    >>> corpus = Corpus.load(max_bytes=2_000_000)
    >>> x, y = corpus.batch(step=0, rank=1, batch_size=8, context=64)
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([8, 64]), True)
"""

from __future__ import annotations

import hashlib
import pathlib
import sys
import sysconfig
from dataclasses import dataclass

import torch

__all__ = ["Corpus", "stdlib_files"]

VALIDATION_EVERY = 10
"""Every tenth file (in sorted order) is a validation file."""


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted, without installed packages."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (uint8 tensors) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    files: int
    source: str
    digest: str

    @classmethod
    def load(cls, max_bytes: int) -> Corpus:
        """Read files in sorted order until ``max_bytes`` are in hand (split 9:1 by file)."""
        train, val = bytearray(), bytearray()
        files = stdlib_files()
        used = 0
        for index, path in enumerate(files):
            if len(train) + len(val) >= max_bytes:
                break
            (val if index % VALIDATION_EVERY == 0 else train).extend(path.read_bytes())
            used += 1
        if not files or not val:
            raise RuntimeError(f"no standard library sources found under {sysconfig.get_paths()['stdlib']}")
        digest = hashlib.sha256(bytes(train) + bytes(val)).hexdigest()[:12]
        source = f"Python {sys.version.split()[0]} standard library ({used} of {len(files)} .py files)"
        as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8)  # noqa: E731
        return cls(as_tensor(train), as_tensor(val), used, source, digest)

    def batch(
        self, step: int, rank: int, batch_size: int, context: int, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets (int64, ``batch_size x context``) for this rank and step."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 100_003 + step)
        starts = torch.randint(0, self.train.numel() - context - 1, (batch_size,), generator=generator)
        return self._windows(self.train, starts, context)

    def validation(self, windows: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed set of evenly spaced validation windows (the same on every rank and run)."""
        starts = torch.linspace(0, self.val.numel() - context - 2, windows).long()
        return self._windows(self.val, starts, context)

    @staticmethod
    def _windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = starts[:, None] + torch.arange(context + 1)
        chunk = data[index].long()
        return chunk[:, :-1], chunk[:, 1:]
