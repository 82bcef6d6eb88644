"""The bench's ``python floor`` DDP hook averages like DDP's built-in allreduce, at 2 and 3 gloo ranks.

It is the reference that separates the cost of DDP calling any Python hook from the cost of what a
hook does; a reference that trained differently would measure something else.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm_testing import run_ranks


def _floor_equals_builtin(rank: int, world: int) -> None:
    from tools.bench.cases.ddp import FloorState, python_floor_hook

    def train(hook: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets: the works are waited for at the last one
        state = FloorState()
        if hook:
            ddp.register_comm_hook(state, python_floor_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(4):
            torch.manual_seed(100 * step + rank)  # different data on every rank
            opt.zero_grad()
            ddp(torch.randn(8, 16)).square().mean().backward()
            opt.step()
        assert state.pending == []
        return [p.detach().clone() for p in model.parameters()]

    builtin, floor = train(False), train(True)
    for a, b in zip(floor, builtin, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(p, q) for p, q in zip(builtin, _initial(), strict=True)), "nothing trained"


def _initial() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_python_floor_hook_averages_like_the_builtin(world: int) -> None:
    run_ranks(_floor_equals_builtin, world, timeout=240)
