"""How ``hatch run test:readme`` runs the READMEs' Python blocks (pytest-markdown-docs).

A plain ```` ```python ```` block runs in the test process. A block opened with
```` ```python runner:ranks ```` is a complete program run on 2 gloo ranks, as
``torchrun --nproc-per-node 2`` would (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` set; ``dist.init_process_group("gloo")`` in the block).
```` ```python runner:program ```` runs a block as ``python block.py`` (for blocks that start
processes themselves), and ```` ```python runner:gpu ```` blocks are skipped on machines without
2 CUDA GPUs, saying so.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from dcomm_testing import rank_process_context

RANKS = 2
TIMEOUT_S = 240
"""Seconds a block may run; below the tests' pytest timeout (300 s), so a hang reports its stacks."""

try:
    from pytest_markdown_docs._runners import DefaultRunner, register_runner
except ImportError:  # pytest-markdown-docs is installed in the test environment only
    DefaultRunner = register_runner = None  # type: ignore[assignment,misc]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(source: str, filename: str, folder: str, env: dict[str, str], argv: list[str]) -> None:
    os.environ.update(env)
    os.chdir(folder)
    sys.argv = argv
    stacks = open(Path(folder, f"rank{env['RANK']}.stacks"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # run_block asks on a hang
    try:
        exec(compile(source, filename, "exec"), {"__name__": "__main__"})
    except BaseException:
        Path(folder, f"rank{env['RANK']}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def run_block(source: str, where: str, ranks: int, argv: list[str] | None = None) -> None:
    """Run ``source`` as ``__main__`` on ``ranks`` processes; raise with the failing ranks' tracebacks.

    ``argv`` becomes ``sys.argv`` in each rank (default: ``[where]``), as a script's command line.
    """
    with tempfile.TemporaryDirectory(prefix="dcomm-readme-") as folder:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(ranks)}
        env["LOCAL_WORLD_SIZE"] = str(ranks)
        ctx = rank_process_context()  # ranks fork from a server that has imported torch once
        processes = [
            ctx.Process(
                target=_rank_main,
                args=(source, where, folder, env | {"RANK": str(r), "LOCAL_RANK": str(r)}, argv or [where]),
            )
            for r in range(ranks)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + TIMEOUT_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        failures = []
        for rank, process in enumerate(processes):
            if process.is_alive():
                failures.append(f"rank {rank} hung for {TIMEOUT_S} s; its threads:\n{_stacks(process, folder, rank)}")
            elif process.exitcode != 0:
                error = Path(folder, f"rank{rank}.err")
                story = error.read_text() if error.exists() else "(no traceback: the process died)"
                failures.append(f"rank {rank} exited with {process.exitcode}:\n{story}")
        if failures:
            raise AssertionError(f"{where}: the code block failed\n" + "\n".join(failures))


def _stacks(process: Any, folder: str, rank: int) -> str:
    """Ask a hung rank for its threads' Python stacks (faulthandler), then kill it."""
    assert process.pid is not None
    os.kill(process.pid, signal.SIGUSR1)
    time.sleep(2.0)
    process.kill()
    process.join()
    stacks = Path(folder, f"rank{rank}.stacks")
    return stacks.read_text() if stacks.exists() else "(no stacks written)"


def run_program(source: str, where: str) -> None:
    """Run ``source`` as ``python block.py`` (a block that starts processes of its own)."""
    with tempfile.TemporaryDirectory(prefix="dcomm-readme-") as folder:
        program = Path(folder) / "block.py"
        program.write_text(source)
        result = subprocess.run(
            [sys.executable, str(program)], cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
        if result.returncode != 0:
            raise AssertionError(f"{where}: the code block exited with {result.returncode}\n{result.stderr}")


if register_runner is not None:

    class _BlockRunner(DefaultRunner):
        def runtest(self, test: Any, args: dict[str, Any], **_: Any) -> None:
            run_block(test.source, f"{test.source_path}:{test.start_line + 1}", RANKS)

        def repr_failure(self, test: Any, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
            return str(excinfo.value)

    @register_runner()
    class ranks(_BlockRunner):
        pass

    @register_runner()
    class program(_BlockRunner):
        def runtest(self, test: Any, args: dict[str, Any], **_: Any) -> None:
            run_program(test.source, f"{test.source_path}:{test.start_line + 1}")

    @register_runner()
    class gpu(_BlockRunner):
        def runtest(self, test: Any, args: dict[str, Any], **_: Any) -> None:
            import torch

            if torch.cuda.device_count() < RANKS:
                pytest.skip(f"needs {RANKS} CUDA GPUs (this block runs on NCCL)")
            super().runtest(test, args)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build dcomm.ddp's C++ hooks once, before any test starts ranks that would all wait for the build."""
    try:
        from dcomm.ddp import native_hooks_available
    except ImportError:  # dcomm-ddp not installed in this environment
        return
    native_hooks_available()
