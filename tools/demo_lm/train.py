"""What every rank runs: each (algorithm, implementation) of the table in turn, measured.

Per run: validation loss every ``eval_every`` steps (averaged over ranks, whose models differ
under local SGD and DiLoCo), the bytes each rank handed to collectives during the training steps
(counted by :mod:`.comm_bytes`, averaged over ranks), and the wall time of the steps (the
slowest rank's). Evaluation is outside both the byte count and the clock, but it can change what
the next step sends: FSDP keeps its root unit's parameters gathered after an evaluation forward,
so the first training step after it skips that all-gather. A run that raises is a result too
(its error, agreed by all ranks), and the next run goes on.

Example::

    >>> run_ranks(rank_main, 4, CONFIGS["small"], corpus)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tools.launch import agree_on_error, short_error

from .comm_bytes import CommCounter
from .config import Config
from .corpus import Corpus
from .model import next_byte_loss
from .progress import Progress
from .runs import ALGORITHMS, BASELINE, Context, Trainee, Unavailable

__all__ = ["RunResult", "planned_runs", "rank_main"]


@dataclass
class RunResult:
    """One (algorithm, implementation) run as the ranks agreed on it."""

    algorithm: str
    impl: str
    error: str = ""
    skipped: str = ""
    steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    bytes_sent: list[float] = field(default_factory=list)
    """Cumulative bytes per rank handed to collectives at each evaluated step."""
    wall_s: list[float] = field(default_factory=list)
    """Cumulative training wall time at each evaluated step."""
    step_ms: float = math.nan
    """Median step time."""
    bytes_by_collective: dict[str, float] = field(default_factory=dict)
    """Bytes per rank over the whole run, per ``c10d`` operator (``allreduce_``, ``_allgather_base_``...)."""

    @property
    def ok(self) -> bool:
        return not self.error and not self.skipped and bool(self.val_loss)

    @property
    def final_loss(self) -> float:
        return self.val_loss[-1] if self.ok else math.nan


def planned_runs(selected: list[str] | None = None) -> list[tuple[str, str]]:
    """(algorithm, implementation) pairs in table order: the baseline and, when ``selected`` is
    given, only the algorithms whose name contains one of its words (any case)."""
    return [
        (algorithm, impl)
        for algorithm, builders in ALGORITHMS.items()
        for impl in builders
        if not selected or algorithm == BASELINE or any(word.lower() in algorithm.lower() for word in selected)
    ]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Evaluator:
    """Validation loss of a model, averaged over ranks, on the fixed validation windows."""

    def __init__(self, ctx: Context, corpus: Corpus, side: dist.ProcessGroup) -> None:
        tokens, targets = corpus.validation(ctx.config.val_windows, ctx.config.context)
        self.tokens, self.targets = tokens.to(ctx.device), targets.to(ctx.device)
        self.side = side

    @torch.no_grad()
    def __call__(self, trainee: Trainee) -> float:
        chunks = zip(self.tokens.split(32), self.targets.split(32), strict=True)
        loss = sum(next_byte_loss(trainee.model(x), y).item() * len(x) for x, y in chunks) / len(self.tokens)
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total, group=self.side)
        return total.item() / dist.get_world_size()


def _mean_and_max(values: tuple[float, float], side: dist.ProcessGroup) -> tuple[float, float]:
    """(mean over ranks of the first value, max over ranks of the second)."""
    total = torch.tensor([values[0]], dtype=torch.float64)
    slowest = torch.tensor([values[1]], dtype=torch.float64)
    dist.all_reduce(total, group=side)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=side)
    return total.item() / dist.get_world_size(), slowest.item()


def train(
    ctx: Context,
    corpus: Corpus,
    trainee: Trainee,
    result: RunResult,
    evaluate: Evaluator,
    side: Any,
    progress: Progress,
) -> None:
    counter = CommCounter.install()
    config = ctx.config
    sent_before, by_collective_before, wall, times = counter.bytes_sent, dict(counter.by_collective), 0.0, []
    result.steps, result.val_loss, result.bytes_sent, result.wall_s = [0], [evaluate(trainee)], [0.0], [0.0]
    for step in range(config.steps):
        tokens, targets = corpus.batch(step, ctx.rank, config.batch_size, config.context, config.seed)
        tokens, targets = tokens.to(ctx.device), targets.to(ctx.device)
        _synchronize(ctx.device)
        start = time.perf_counter()
        with counter.counting():
            trainee.step(tokens, targets)
            _synchronize(ctx.device)
        times.append(time.perf_counter() - start)
        wall += times[-1]
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            sent, slowest = _mean_and_max((counter.bytes_sent - sent_before, wall), side)
            result.steps.append(step + 1)
            result.val_loss.append(evaluate(trainee))
            result.bytes_sent.append(sent)
            result.wall_s.append(slowest)
            progress.advance(step + 1, result.val_loss[-1])
    result.step_ms = statistics.median(times) * 1e3
    mine = {name: sent - by_collective_before.get(name, 0) for name, sent in counter.by_collective.items()}
    everyone: list[dict[str, int]] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=side)
    names = sorted({name for counts in everyone for name, sent in counts.items() if sent})
    result.bytes_by_collective = {name: sum(c.get(name, 0) for c in everyone) / len(everyone) for name in names}


def run_one(
    ctx: Context, corpus: Corpus, algorithm: str, impl: str, side: Any, evaluate: Evaluator, progress: Progress
) -> RunResult:
    result = RunResult(algorithm, impl)
    error = ""
    try:
        trainee = ALGORITHMS[algorithm][impl](ctx)
        train(ctx, corpus, trainee, result, evaluate, side, progress)
    except Unavailable as exc:
        result.skipped = str(exc)
    except Exception as exc:  # a failing run is a result; the others go on
        error = short_error(exc)
    result.error = agree_on_error(error, side)
    return result


def rank_main(
    rank: int, world: int, config: Config, corpus: Corpus, selected: list[str] | None, live: bool
) -> list[dict[str, Any]]:
    """Run every planned run; rank 0 shows progress and returns the results."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    side = dist.new_group(backend="gloo")
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node_group, _ = dist.new_subgroups(group_size=node_size)
    ctx = Context(config, rank, world, device, node_size, node_group)
    evaluate = Evaluator(ctx, corpus, side)
    runs = planned_runs(selected)
    results = []
    with Progress(runs, config.steps, enabled=rank == 0, live=live) as progress:
        for algorithm, impl in runs:
            progress.start(algorithm, impl)
            result = run_one(ctx, corpus, algorithm, impl, side, evaluate, progress)
            progress.finish(result.final_loss, result.error or result.skipped)
            results.append(asdict(result))
    return results
