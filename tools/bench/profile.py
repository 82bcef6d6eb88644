"""GPU time of a step by kernel kind (NCCL collectives, GEMMs, elementwise and copies).

``python -m tools.bench --profile`` adds this to every variant's details after its rounds, so
a ratio above 1 can be traced to the kind of work one side does more of.

Example::

    >>> kernel_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL")
    'nccl reduce-scatter'
    >>> gpu_time_by_kind(step, steps=3)  # doctest: +SKIP
    {'gemm/attention': 5120.0, 'nccl all-reduce': 2050.0, 'elementwise/copy': 310.0}
"""

from __future__ import annotations

import torch

from tools.bench.timing import Step

__all__ = ["gpu_time_by_kind", "kernel_kind"]

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


def gpu_time_by_kind(step: Step, steps: int = 3) -> dict[str, float]:
    """Microseconds of GPU time per step of ``step``, by kernel kind (call on every rank)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        micros = getattr(event, "self_device_time_total", 0) or 0
        if micros > 0:
            kind = kernel_kind(event.key)
            kinds[kind] = round(kinds.get(kind, 0.0) + micros / steps, 1)
    return kinds
