"""Gradient compression beyond fp16/bf16 for DDP: PowerSGD (dcomm's and torch's), int8 and fp8.

PowerSGD runs at rank 4 and starts compressing at step 2 (torch's minimum with error feedback),
inside the warm-up. int8/fp8 are compared with DDP's built-in allreduce, with dcomm's bf16 hook
and, int8, with torch's nearest hook (``quantization_pertensor_hook``: uint8 codes, each rank's
whole bucket all-gathered), and report the bytes each rank sent. ``no communication`` hands
every bucket back unaveraged: the floor under any compression's step.

Example::

    >>> case = compression_case(ctx)  # doctest: +SKIP
    >>> sorted(case.variants)  # doctest: +SKIP
    ['builtin', 'dcomm bf16', 'dcomm fp8', 'dcomm int8', 'no communication', ...]
"""

from __future__ import annotations

import torch.distributed as dist

from dcomm.core import completed_future
from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import Context, add_versions, sgd_variant
from tools.bench.cases.ddp import build_ddp
from tools.impls import resolve

__all__ = ["POWERSGD_RANK", "compression_case"]

POWERSGD_RANK = 4
START_POWERSGD_ITER = 2
# Past DDP's bucket rebuild (after step 1) and the int8/fp8 hooks' first use of each rebuilt
# bucket (its buffers and error memories), with margin.
WARMUP_STEPS = 6


def build_powersgd(ctx: Context, impl: str) -> Variant:
    """DDP + PowerSGD (rank 4, error feedback, warm start) from ``impl``."""
    if impl == "torch" and dist.get_backend() == "gloo":
        raise RuntimeError(
            "torch's powerSGD_hook launches its second and third allreduce from gloo callbacks, which can "
            "mismatch them across ranks with several buckets in flight (gloo aborts the process); not run on gloo"
        )
    ddp = ctx.ddp(ctx.model())
    state = resolve(impl, "PowerSGDState")(
        None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=START_POWERSGD_ITER
    )
    ddp.register_comm_hook(state, resolve(impl, "powerSGD_hook"))
    return sgd_variant(ctx, ddp)


def build_quantized(ctx: Context, fmt: str) -> Variant:
    """DDP + dcomm's int8/fp8 hook with error feedback; reports the bytes this rank sent."""
    from dcomm.ddp import QuantizedState, fp8_compress_hook, int8_compress_hook

    ddp = ctx.ddp(ctx.model())
    state = QuantizedState(None, error_feedback=True)
    ddp.register_comm_hook(state, int8_compress_hook if fmt == "int8" else fp8_compress_hook)
    variant = sgd_variant(ctx, ddp)
    return Variant(variant.step, details=lambda: {"bytes sent": state.bytes_sent})


def build_torch_uint8(ctx: Context) -> Variant:
    """DDP + torch's ``quantization_pertensor_hook`` (uint8 codes, all-gathered whole): torch's nearest to int8."""
    from torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks import quantization_pertensor_hook

    ddp = ctx.ddp(ctx.model())
    ddp.register_comm_hook(None, quantization_pertensor_hook)
    return sgd_variant(ctx, ddp)


def no_communication_hook(state, bucket):  # type: ignore[no-untyped-def]
    """Hand the bucket back unaveraged: what a DDP step costs with no gradient communication at all.

    Unannotated: DDP checks a hook's annotations against the real ``dist.GradBucket``, and this
    module's are strings (``from __future__ import annotations``).
    """
    return completed_future(bucket.buffer())


def build_no_communication(ctx: Context) -> Variant:
    """DDP whose hook sends nothing: the floor under any compression's step (not a valid training run)."""
    ddp = ctx.ddp(ctx.model())
    ddp.register_comm_hook(None, no_communication_hook)
    return sgd_variant(ctx, ddp)


def compression_case(ctx: Context) -> Case:
    variants = {
        "builtin": lambda: build_ddp(ctx, None),
        "dcomm bf16": lambda: build_ddp(ctx, ("dcomm", "bf16")),
        "dcomm int8": lambda: build_quantized(ctx, "int8"),
        "dcomm fp8": lambda: build_quantized(ctx, "fp8"),
        "torch uint8": lambda: build_torch_uint8(ctx),
        "no communication": lambda: build_no_communication(ctx),
    }
    pairs = []
    for fmt in ("int8", "fp8"):
        pairs.append(Pair(f"compression/{fmt}", f"dcomm {fmt}", "builtin", "dcomm/reference"))
        pairs.append(Pair(f"compression/{fmt} vs bf16", f"dcomm {fmt}", "dcomm bf16", "dcomm/reference"))
    # torch's nearest hook: per-tensor uint8 codes, every rank's whole bucket all-gathered.
    pairs.append(Pair("compression/int8 vs torch uint8", "dcomm int8", "torch uint8", "dcomm/torch"))
    # The floor: the step with nothing sent, against the built-in (no compression can go below it).
    pairs.append(Pair("compression/floor", "no communication", "builtin", "dcomm/reference"))
    # Warm-up past PowerSGD's start and DDP's bucket rebuild, so no timed round pays them.
    case = Case("compression", variants, pairs, warmup_steps=max(START_POWERSGD_ITER + 1, WARMUP_STEPS))
    add_versions(case, "compression/powersgd", "powersgd", lambda impl: build_powersgd(ctx, impl), "builtin")
    return case
