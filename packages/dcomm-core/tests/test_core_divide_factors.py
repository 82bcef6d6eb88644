"""Divide factors against torch's FSDP state and an exact float64 average."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState as TorchState

from dcomm.core import divide_factors


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 64, 96, 128, 1000])
def test_matches_torch_rule(world: int) -> None:
    pre, post = divide_factors(world)
    assert pre == TorchState._get_gradient_predivide_factor(world)
    assert pre * post == world
    assert isinstance(pre, float)
    assert isinstance(post, float)


@pytest.mark.parametrize(
    ("world", "expected"),
    [(1, (1.0, 1.0)), (2, (2.0, 1.0)), (3, (2.0, 1.5)), (4, (2.0, 2.0)), (6, (4.0, 1.5)), (8, (4.0, 2.0))],
)
def test_known_values(world: int, expected: tuple[float, float]) -> None:
    assert divide_factors(world) == expected


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("4", TypeError), (True, TypeError), (None, TypeError)],
)
def test_rejects_non_positive_int(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"world_size: expected a positive int, got .*; pass dist.get_world_size"):
        divide_factors(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_fp16_average_stays_finite_where_plain_sum_overflows(world: int) -> None:
    # Gradients whose plain sum overflows fp16 while the pre-divided sum stays in range.
    pre, post = divide_factors(world)
    fp16_max = torch.finfo(torch.float16).max
    value = fp16_max * (1 + pre) / (2 * world)
    grads = [torch.full((4,), value * (1 - 0.01 * r), dtype=torch.float16) for r in range(world)]
    exact = torch.stack([g.double() for g in grads]).mean(0)
    total = torch.zeros(4, dtype=torch.float16)
    for g in grads:
        total += g / pre
    result = (total / post).double()
    assert torch.isinf(sum(grads)).all()
    torch.testing.assert_close(result, exact, rtol=2e-3, atol=0)
