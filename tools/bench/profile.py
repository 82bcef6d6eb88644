"""GPU time of a step by kernel kind, and the compute stream's busy and idle time.

Kernel kinds: NCCL collectives, GEMMs (and attention), elementwise and copies.

``python -m tools.bench --profile`` adds both to every variant's details after its rounds, so
a ratio above 1 can be traced to the kind of work one side does more of, and told apart: the
compute stream idle longer (communication left exposed) or busy longer (more work, or the same
kernels slowed by collectives running beside them).

Example::

    >>> kernel_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL")
    'nccl reduce-scatter'
    >>> profile_details(step, steps=3)["gpu us/step"]  # doctest: +SKIP
    {'gemm/attention': 5120.0, 'nccl all-reduce': 2050.0, 'elementwise/copy': 310.0}
    >>> kernels = [Kernel(7, "sm90_gemm", 0, 10), Kernel(7, "add", 15, 20), Kernel(9, "ncclDevKernel", 5, 30)]
    >>> stream_summary(kernels, steps=1)
    {'compute busy': 15.0, 'compute idle': 5.0, 'compute kernels': 2.0, 'nccl busy': 25.0}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from tools.bench.timing import Step

__all__ = ["Kernel", "after_first_collective", "kernel_kind", "profile_details", "stream_summary", "time_by_kind"]

_NCCL_KINDS = (("reducescatter", "reduce-scatter"), ("allgather", "all-gather"), ("allreduce", "all-reduce"))


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name."""
    lowered = name.lower()
    if "nccl" in lowered:
        kind = next((kind for key, kind in _NCCL_KINDS if key in lowered), "other")
        return f"nccl {kind}"
    if "gemm" in lowered or "cutlass" in lowered or "sm90" in lowered or "flash" in lowered:
        return "gemm/attention"
    return "elementwise/copy"


class Kernel(NamedTuple):
    """One kernel of a profiled step: its stream, name, and start and end in microseconds."""

    stream: int
    name: str
    start: float
    end: float


def profile_details(step: Step, steps: int = 3) -> dict[str, dict[str, float]]:
    """Per step, from one CUDA-activity profile of ``steps`` steps (call on every rank): GPU time by
    kernel kind (:func:`time_by_kind`), and the compute stream's busy and idle time
    (:func:`stream_summary`), in microseconds.

    The ranks first meet in a one-element allreduce inside the profile, and only kernels that
    start after it count: a rank whose profiler started early would otherwise count its first
    collective's wait for the others (up to hundreds of milliseconds) as NCCL and idle time.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        aligned = _meet_other_ranks()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = _kernels(prof)
    if aligned:
        kernels = after_first_collective(kernels)
    return {"gpu us/step": time_by_kind(kernels, steps), "stream us/step": stream_summary(kernels, steps)}


def _meet_other_ranks() -> bool:
    """One-element allreduce over the default group on this GPU, waited for; False when there is
    no NCCL group to meet in."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
        return False
    dist.all_reduce(torch.zeros(1, device="cuda"))
    torch.cuda.synchronize()
    return True


def after_first_collective(kernels: Sequence[Kernel]) -> list[Kernel]:
    """The kernels that start after the first NCCL kernel ends (the ranks' meeting); all of them
    when there is none."""
    first = min((k for k in kernels if kernel_kind(k.name).startswith("nccl")), key=lambda k: k.start, default=None)
    return list(kernels) if first is None else [k for k in kernels if k.start >= first.end]


def time_by_kind(kernels: Sequence[Kernel], steps: int) -> dict[str, float]:
    """Per step, in microseconds: the kernels' time summed by :func:`kernel_kind`."""
    kinds: dict[str, float] = {}
    for kernel in kernels:
        kind = kernel_kind(kernel.name)
        kinds[kind] = kinds.get(kind, 0.0) + (kernel.end - kernel.start) / steps
    return {kind: round(micros, 1) for kind, micros in kinds.items()}


def stream_summary(kernels: Sequence[Kernel], steps: int) -> dict[str, float]:
    """Per step, in microseconds: the compute stream's busy time, its idle time between its first
    and last kernel, its kernel count, and the time NCCL kernels ran (on any stream).

    The compute stream is the one that runs the most GEMM/attention kernels (else the most kernels).
    """
    by_stream: dict[int, list[Kernel]] = {}
    for kernel in kernels:
        by_stream.setdefault(kernel.stream, []).append(kernel)
    if not by_stream:
        return {}

    def gemms(stream: int) -> tuple[int, int]:
        found = by_stream[stream]
        return sum(kernel_kind(k.name) == "gemm/attention" for k in found), len(found)

    compute = sorted(by_stream[max(by_stream, key=gemms)], key=lambda k: k.start)
    busy = idle = 0.0
    reached = compute[0].start
    for kernel in compute:
        idle += max(0.0, kernel.start - reached)
        busy += max(0.0, kernel.end - max(kernel.start, reached))
        reached = max(reached, kernel.end)
    nccl = sum(k.end - k.start for k in kernels if kernel_kind(k.name).startswith("nccl"))
    return {
        "compute busy": round(busy / steps, 1),
        "compute idle": round(idle / steps, 1),
        "compute kernels": round(len(compute) / steps, 1),
        "nccl busy": round(nccl / steps, 1),
    }


def _is_annotation(event: Any) -> bool:
    """A ``record_function`` range drawn on the GPU timeline ("nccl:all_reduce", "Optimizer.step#Adam.step").

    torch marks them; where it does not, by name: one colon ("nccl:all_reduce"), unlike the
    namespaces of kernel names ("void at::native::...").
    """
    marked = getattr(event, "is_user_annotation", None)
    if marked is not None:
        return bool(marked)
    head = event.name.split("(")[0]
    return (":" in head and "::" not in head) or event.name.startswith(("DistributedDataParallel", "Optimizer."))


def _kernels(prof: Any) -> list[Kernel]:
    return [
        Kernel(
            int(getattr(event, "device_resource_id", 0) or 0), event.name, event.time_range.start, event.time_range.end
        )
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
        and event.time_range.elapsed_us() > 0
        and not _is_annotation(event)
    ]
