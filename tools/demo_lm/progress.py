"""The live display on rank 0: one bar over all runs, one over the current run's steps.

On a terminal it is a ``rich`` progress display with the latest validation loss; elsewhere
(CI logs, pipes) it prints one line per finished run instead.

Example::

    >>> with Progress([("DDP", "dcomm")], steps=10, enabled=True, live=False) as progress:
    ...     progress.start("DDP", "dcomm")
    ...     progress.advance(10, 2.5)
    ...     progress.finish(2.5, "")  # prints "[1/1] DDP ... dcomm  val loss 2.5000"
"""

from __future__ import annotations

import math
from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

__all__ = ["Progress"]


class Progress:
    """Progress over ``runs`` of ``steps`` steps each; silent unless ``enabled``."""

    def __init__(self, runs: list[tuple[str, str]], steps: int, enabled: bool, live: bool) -> None:
        self.runs, self.steps, self.enabled, self.done = runs, steps, enabled, 0
        self.current = ("", "")
        self.bar: RichProgress | None = None
        if enabled and live:
            self.bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"),
                TimeElapsedColumn(),
            )
            self.all_runs = self.bar.add_task("all runs", total=len(runs), loss="")
            self.run = self.bar.add_task("", total=steps, loss="")

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.stop()

    def start(self, algorithm: str, impl: str) -> None:
        self.current = (algorithm, impl)
        if self.bar is not None:
            self.bar.update(self.run, description=f"{algorithm} [{impl}]", completed=0, loss="")

    def advance(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.run, completed=step, loss=f"val loss {loss:.4f}")

    def finish(self, loss: float, note: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        algorithm, impl = self.current
        outcome = note if note else f"val loss {loss:.4f}" if not math.isnan(loss) else ""
        line = f"[{self.done}/{len(self.runs)}] {algorithm:<45} {impl:<5}  {outcome}"
        if self.bar is not None:
            self.bar.update(self.all_runs, completed=self.done)
            self.bar.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)
