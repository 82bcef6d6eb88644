"""What every integration scenario shares: the device of this rank and the scenario registry.

A scenario is a module-level function ``scenario_<name>(rank, world_size)`` in a
``scenarios_<area>.py`` module here, run on an already initialized process group of any backend
(gloo on CPU, NCCL on GPUs). It trains or communicates with dcomm and with torch's built-in
counterpart in the same process and asserts they agree (or match a float64 reference), raising
``AssertionError`` otherwise. Register it with :func:`scenario`.

Example::

    @scenario(min_world_size=2)
    def scenario_allreduce_hook(rank: int, world_size: int) -> None:
        model = torch.nn.Linear(4, 4).to(device())
        ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dcomm_testing import rank_device

__all__ = ["SCENARIOS", "Scenario", "device", "scenario"]


@dataclass(frozen=True)
class Scenario:
    """A registered scenario and the world sizes it can run at."""

    fn: Callable[[int, int], None]
    min_world_size: int
    world_size_multiple: int
    backends: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.fn.__name__.removeprefix("scenario_")

    def runs_at(self, world_size: int, backend: str) -> bool:
        return (
            world_size >= self.min_world_size
            and world_size % self.world_size_multiple == 0
            and backend in self.backends
        )


SCENARIOS: list[Scenario] = []


def scenario(
    min_world_size: int = 2, world_size_multiple: int = 1, backends: tuple[str, ...] = ("gloo", "nccl")
) -> Callable[[Callable[[int, int], None]], Callable[[int, int], None]]:
    """Register ``fn`` as an integration scenario."""

    def register(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
        SCENARIOS.append(Scenario(fn, min_world_size, world_size_multiple, backends))
        return fn

    return register


device = rank_device
"""This rank's device: its GPU under NCCL, the CPU under gloo (``dcomm_testing.rank_device``)."""


def load_all() -> list[Scenario]:
    """Import every ``scenarios_*.py`` module beside this file; return the registry."""
    import importlib
    import pathlib

    for path in sorted(pathlib.Path(__file__).parent.glob("scenarios_*.py")):
        importlib.import_module(path.stem)
    return SCENARIOS
