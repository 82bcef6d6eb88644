"""Whether int8/fp8 codes pay on this link, or bf16 averages faster: timed once DDP has settled.

Quantizing a bucket costs a few passes over it on the GPU and a second collective; on a slow
link the bytes it saves pay for that several times over, but on NVLink a bf16 allreduce of the
same bucket is as quick as the two quantized shots, so the int8/fp8 hooks would be slower than
dcomm's bf16 hook (1.07-1.16x on 4x H200), which also rounds less. :class:`WireChoice` times
whole backward passes of both (:class:`dcomm.ddp._calibration.Calibration`, blocks of bf16 and
the quantized format) right after DDP has settled its buckets and the quantized averages are
captured as CUDA graphs, and keeps the codes only where their slowest rank is at least 2% faster
(:data:`CODES_MARGIN`), bf16 otherwise. Every rank takes the same decision, which is logged once.

The wire of each backward pass is decided at the end of the one before, so a pass is sent in one
wire from its first bucket to its last. A bf16 pass runs on the C++ averaging hook
(:mod:`dcomm.ddp.native_hooks`), registered switched off beside the quantized hook and switched on
for bf16 passes, exactly as dcomm's ``bf16_compress_hook`` runs (it calls back at its last bucket);
where there is no C++ hook, the Python bf16 average runs. Both paths are timed as they will run.

Example::

    >>> choice = WireChoice()
    >>> choice.wire("int8")  # before any backward pass
    'int8'
    >>> choice.end_pass("int8", None, torch.device("cpu"))  # the next pass's wire
    'int8'
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import resolve_group
from dcomm.ddp._calibration import Calibration

__all__ = ["SETTLE_PASSES", "WIRES", "WireChoice"]

logger = logging.getLogger("dcomm.ddp.quantized_hooks")

SETTLE_PASSES = 5
"""Backward passes before timing: DDP rebuilds its buckets after the first, each bucket's CUDA graph
is captured at its third call, and the next pass replays them all."""

CALIBRATION_STEPS = 6
"""Timed iterations per block (4 blocks, one more per block dropped): 12 per wire."""

CODES_MARGIN = 0.98
"""The codes are kept only where their slowest-rank step is at least 2% faster than bf16's: bf16
rounds less, and where the two are that close the bytes saved do not pay for the noise of
timing them (a host-bound model's steps swing more than that)."""

WIRES = ("bf16", "int8", "fp8")


class WireChoice:
    """Counts a quantized hook's backward passes, times bf16 against its format, holds the choice.

    Args:
        clock: for tests, the times of the calibration (seconds); CUDA events or the host clock
            otherwise.
    """

    __slots__ = ("calibration", "chosen", "clock", "current", "passes", "switches")

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.passes = 0  # backward passes ended (until the choice)
        self.chosen: str | None = None  # "bf16" or the format, once calibrated
        self.current: str | None = None  # the wire of the backward pass under way or next
        self.calibration: Calibration | None = None
        self.clock = clock
        self.switches: list[Any] = []  # C++ averaging hooks sending bf16, switched on once it is chosen

    def wire(self, fmt: str) -> str:
        """The wire of the current backward pass: ``fmt`` or ``"bf16"``."""
        return self.chosen or self.current or fmt

    def end_pass(self, fmt: str, group: dist.ProcessGroup | None, device: torch.device) -> str:
        """At the last bucket of a backward pass: count it, time it; the next pass's wire (switches set)."""
        if self.chosen is None:
            self.passes += 1
            if self.passes >= SETTLE_PASSES:
                if self.calibration is None:
                    self.calibration = Calibration(
                        resolve_group(group),
                        ("bf16", fmt),
                        _bf16_if_faster(fmt),
                        _log_choice(fmt),
                        steps=CALIBRATION_STEPS,
                        clock=self.clock,
                    )
                self.current = self.calibration.next_path(device)
                if self.calibration.chosen is not None:
                    self.chosen, self.calibration = self.calibration.chosen, None
        wire = self.wire(fmt)
        self.set_switches(wire == "bf16")
        return wire

    def restore(self, chosen: str | None, passes: int) -> None:
        """Continue from a checkpoint: a choice made holds; a calibration under way starts again."""
        self.chosen, self.current, self.calibration = chosen, None, None
        self.passes = passes if chosen is not None else min(passes, SETTLE_PASSES - 1)
        self.set_switches(chosen == "bf16")

    def set_switches(self, on: bool) -> None:
        """Switch the C++ bf16 hooks on or off; once the choice is made they stop calling back.

        After the choice a pass's end has nothing left to count or decide, so the C++ hook runs as
        dcomm's ``bf16_compress_hook`` does, with no trip to Python at the last bucket.
        """
        for switch in self.switches:
            switch.set(on)
            switch.set_hand_over(self.chosen is None)

    def native_bytes(self) -> int:
        """Bytes the C++ bf16 hooks have sent."""
        return sum(int(switch.bytes_sent) for switch in self.switches)


def _bf16_if_faster(fmt: str) -> Callable[[dict[str, float]], str]:
    """The choice between bf16 and ``fmt`` from their slowest-rank times: ``fmt`` where clearly faster.

    Example::

        >>> choose = _bf16_if_faster("int8")
        >>> choose({"bf16": 1.0, "int8": 0.97}), choose({"bf16": 1.0, "int8": 0.99})
        ('int8', 'bf16')
    """

    def choose(slowest: dict[str, float]) -> str:
        return fmt if slowest[fmt] < CODES_MARGIN * slowest["bf16"] else "bf16"

    return choose


def _log_choice(fmt: str) -> Callable[[str, dict[str, float]], None]:
    def report(chosen: str, slowest: dict[str, float]) -> None:
        times = f"per step, slowest rank: {fmt} {slowest[fmt] * 1e3:.3f} ms, bf16 {slowest['bf16'] * 1e3:.3f} ms"
        if chosen == "bf16":
            logger.info(
                "%s_compress_hook: bf16 is faster on this link (%s): sending bf16 from now on (more precise, "
                "twice the bytes); pass QuantizedState(..., bf16_if_faster=False) to keep %s",
                fmt,
                times,
                fmt,
            )
        else:
            logger.info("%s_compress_hook: keeps %s (%s)", fmt, fmt, times)

    return report
