"""pytest marks shared by the suites (imported by name: ``dcomm_testing`` itself does not need pytest).

Example::

    >>> from dcomm_testing.marks import ON_GLOO_AND_NCCL
    >>> @ON_GLOO_AND_NCCL  # doctest: +SKIP
    ... def test_sync(device_type: str, backend: str) -> None:
    ...     run_ranks(_sync, 2, device_type, backend=backend)
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["ON_GLOO_AND_NCCL"]

ON_GLOO_AND_NCCL = pytest.mark.parametrize(
    ("device_type", "backend"),
    [
        pytest.param("cpu", "gloo", id="gloo"),
        pytest.param(
            "cuda",
            "nccl",
            id="nccl",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)"),
        ),
    ],
)
"""Run a test as ``(device_type, backend)`` = ``("cpu", "gloo")``, then ``("cuda", "nccl")`` where 2 GPUs are."""
