"""Process-group start-up shared by every tool: one rank of torchrun, NVLink multicast off.

The lent GPU hosts must never use NVLink multicast (NVLS), so every tool that starts ranks sets
:data:`MULTICAST_OFF` in their environment. :func:`init_rank` starts this torchrun rank's group
(its GPU from ``LOCAL_RANK`` under NCCL; a fair share of the CPU threads under gloo), and
:func:`agree_on_error` lets all ranks report the same first error, so a variant or scenario that
fails on one rank fails on all of them and the run goes on.

Example::

    >>> backend = init_rank("auto", timeout_s=300.0)  # doctest: +SKIP
    >>> side = side_group(300.0)  # doctest: +SKIP
    >>> agree_on_error("", side)  # '' when every rank succeeded  # doctest: +SKIP
    ''
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "MULTICAST_OFF",
    "agree_on_error",
    "disable_multicast",
    "gather_errors",
    "init_rank",
    "pick_backend",
    "short_error",
    "side_group",
    "with_multicast_off",
]

MULTICAST_OFF: Mapping[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""The three variables that keep NCCL, symmetric memory and NVSHMEM off NVLink multicast."""


def disable_multicast() -> None:
    """Set :data:`MULTICAST_OFF` in this process (before any NCCL communicator exists)."""
    os.environ.update(MULTICAST_OFF)


def with_multicast_off(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) plus :data:`MULTICAST_OFF`, for child processes."""
    return {**(os.environ if env is None else env), **MULTICAST_OFF}


def pick_backend(requested: str) -> str:
    """``auto`` becomes ``nccl`` when this host has a GPU, else ``gloo``; other names pass."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'auto', 'nccl' or 'gloo', got {requested!r}")
    return requested


def init_rank(backend: str = "auto", timeout_s: float = 300.0) -> str:
    """Start the default process group of this torchrun rank and return its backend.

    Under NCCL the rank takes GPU ``LOCAL_RANK`` (modulo the GPU count); under gloo it takes its
    share of the host's CPU threads (``LOCAL_WORLD_SIZE`` ranks per host).
    """
    disable_multicast()
    backend = pick_backend(backend)
    device_id = None
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device_id = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return backend


def side_group(timeout_s: float = 300.0) -> dist.ProcessGroup:
    """A gloo group over all ranks for agreeing on outcomes (never blocks the NCCL stream)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def gather_errors(error: str, group: dist.ProcessGroup) -> dict[int, str]:
    """Every rank's error message (``''`` for success), keyed by rank, failures only."""
    errors: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return {rank: message for rank, message in enumerate(errors) if message}


def agree_on_error(error: str, group: dist.ProcessGroup) -> str:
    """The first error any rank reported, with its rank, or ``''`` when all succeeded."""
    failed = gather_errors(error, group)
    if not failed:
        return ""
    rank = min(failed)
    return f"{failed[rank]} (rank {rank})"


def short_error(exc: BaseException) -> str:
    """The exception's type and first message line, plus the dcomm or tools line that raised it."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:160]
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/dcomm/" in frame.filename or "/tools/" in frame.filename:
            where = f" [{os.path.basename(frame.filename)}:{frame.lineno}]"
            break
    return f"{type(exc).__name__}: {first_line}{where}"
