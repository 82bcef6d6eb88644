"""The small models dcomm's tests train, the device a rank trains on, and a model's flat parameters.

Example::

    >>> model = seeded_mlp(6, 12, 3)  # Linear(6, 12), Tanh, Linear(12, 3), seeded with 0
    >>> flat_parameters(model).numel()
    123
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BackwardOrderedMLP", "flat_parameters", "rank_device", "seeded_mlp"]


def seeded_mlp(
    *widths: int,
    activation: type[nn.Module] = nn.Tanh,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> nn.Sequential:
    """``Linear`` layers from ``widths[0]`` to ``widths[-1]`` with ``activation`` between them.

    The global RNG is seeded with ``seed`` first, so every rank and every call builds the same
    initial parameters.

    Example::

        >>> [type(m).__name__ for m in seeded_mlp(8, 16, 4, activation=nn.ReLU)]
        ['Linear', 'ReLU', 'Linear']
    """
    if len(widths) < 2:
        raise ValueError(f"widths: expected the input and output widths at least, got {widths}")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        if index:
            layers.append(activation())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


class BackwardOrderedMLP(nn.Module):
    """``seeded_mlp(fan_in, hidden, fan_out)``, its parameters registered in the order backward fills them.

    DDP lays out its first step's buckets in parameter order and rebuilds them in gradient-ready
    order after it, so a freshly restored DDP reduces one step with a different layout; with more
    than 2 ranks the sum then runs in a different order and can change the last bit. Registered
    in ready order, both layouts are the same: a resumed run can be compared bit for bit.

    Example::

        >>> [name for name, _ in BackwardOrderedMLP(6, 10, 3).named_parameters()]
        ['b2', 'w2', 'b1', 'w1']
    """

    def __init__(self, fan_in: int, hidden: int, fan_out: int, seed: int = 0) -> None:
        super().__init__()
        mlp = seeded_mlp(fan_in, hidden, fan_out, seed=seed)
        first, second = mlp[0], mlp[2]
        self.b2, self.w2 = nn.Parameter(second.bias.detach()), nn.Parameter(second.weight.detach())
        self.b1, self.w1 = nn.Parameter(first.bias.detach()), nn.Parameter(first.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(nn.functional.linear(x, self.w1, self.b1))
        return nn.functional.linear(hidden, self.w2, self.b2)


def rank_device() -> torch.device:
    """This rank's device: its GPU (by ``LOCAL_RANK``) under NCCL, else the CPU.

    Example::

        >>> rank_device()  # on a gloo rank  # doctest: +SKIP
        device(type='cpu')
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count())
    return torch.device("cpu")


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """A detached copy of every parameter of ``module``, flattened and concatenated.

    Example::

        >>> flat_parameters(nn.Linear(2, 1)).shape
        torch.Size([3])
    """
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])
