"""DiLoCo: dcomm's ``DiLoCoOptimizer`` against torchft's ``DiLoCo`` (the peer) and DDP, same task.

Every variant trains the workload in fp32 with AdamW (lr 4e-4) on each rank's own batch. The two
DiLoCo variants sync every ``ctx.sync_every`` inner steps (``--sync-every``, 8 by default) with
an outer SGD (lr 0.7, momentum 0.9, Nesterov), plain DiLoCo (one fragment, no delay, no
compression), and on GPUs also with fp8 pseudo-gradients (dcomm's ``compression="fp8"``,
torchft's ``should_quantize``); ``ddp adamw`` (the reference) allreduces the gradients every
step. A round times one period of each, sync included; the warm-up is one period too (torchft's
first quorum, and its healing of the other replicas from the first at step 0, happen there).

torchft runs as across hosts, one replica group of one rank per process: a lighthouse
(``min_replicas`` = the world size) in rank 0's process, a ``Manager`` with its own gloo (NCCL on
GPUs) process group per rank, its global copy on the parameters' device like dcomm's. Each built
variant gets a fresh lighthouse and managers, shut down when the variant is freed. Without an
importable torchft the variant is left out and the case says why in ``details["torchft"]``
(else that is torchft's version).

Each variant reports the bytes each rank sent per inner step, the inner steps it ran (the same for
all) and the loss afterwards, averaged over the ranks' batches (every variant ends on a sync, so
its replicas are equal). dcomm's bytes are its own counter (``bytes_sent``). torchft has none: the
case counts the bytes of the tensors handed to its ``Manager.allreduce`` (every parameter's fp32
pseudo-gradient once per sync; one byte per value when it quantizes, its scales not counted) at
the cost dcomm's counter charges an allreduce, ``2 (n - 1) / n`` bytes sent per byte; DDP's
is the same cost for its fp32 gradients every step. torchft's quorum and commit RPCs to the
lighthouse and the managers are not counted.

Example::

    >>> case = diloco_case(ctx)  # doctest: +SKIP
    >>> sorted(case.variants)  # doctest: +SKIP
    ['dcomm diloco', 'ddp adamw', 'torchft diloco']
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tools.bench.ab import Case, Pair, Variant
from tools.bench.cases.common import Context, impl_pairs, train_step
from tools.launch import short_error

__all__ = ["allreduce_bytes_sent", "diloco_case", "torchft_missing"]

INNER_LR = 4e-4
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
TORCHFT_TIMEOUT = timedelta(seconds=60)
"""torchft's quorum, connect and collective timeout: a rank that failed to build fails the others' warm-up."""


def allreduce_bytes_sent(nbytes: int, world: int) -> int:
    """Bytes each rank sends in an allreduce of ``nbytes`` (ring: ``2 (n - 1) / n`` of them), as dcomm counts.

    Example::

        >>> allreduce_bytes_sent(1000, 4)
        1500
    """
    return 2 * (world - 1) * nbytes // world


def torchft_missing() -> str:
    """Why torchft cannot be used here ('' when it imports).

    Example::

        >>> torchft_missing()  # doctest: +SKIP
        "skipped: torchft is not importable (No module named 'torchft'); pip install torchft to compare"
    """
    os.environ.setdefault("RUST_LOG", "warn")  # its lighthouse and managers log every quorum at info
    try:
        import torchft  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install: either way there is no peer to run
        return f"skipped: torchft is not importable ({short_error(exc)}); pip install torchft to compare"
    return ""


def _torchft_version() -> str:
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:  # on the path without its metadata
        import torchft

        return str(getattr(torchft, "__version__", "unknown version"))


def _optimizers(model: nn.Module) -> tuple[torch.optim.AdamW, torch.optim.SGD]:
    return torch.optim.AdamW(model.parameters(), lr=INNER_LR), torch.optim.SGD(model.parameters(), **OUTER)


def _inner_steps(inner: torch.optim.Optimizer) -> int:
    """Steps ``inner`` (AdamW) has taken: its per-parameter step count."""
    return int(inner.state[inner.param_groups[0]["params"][0]]["step"])


def _report(ctx: Context, model: nn.Module, inner: torch.optim.Optimizer, bytes_sent: Callable[[], int]) -> Any:
    """The variant's details: bytes per inner step, inner steps, and the loss now over all ranks' batches.

    Every rank calls it for the same variants in the same order (the loss is averaged over the
    bench's side group).
    """
    batch = ctx.workload.make_batch(ctx.device)

    def details() -> dict[str, Any]:
        steps = _inner_steps(inner)
        with torch.no_grad():
            loss = ctx.workload.loss(model, batch).detach().to(torch.float64).reshape(1).cpu()
        dist.all_reduce(loss, group=ctx.bench.side_group)
        mean = float(f"{loss.item() / ctx.world:.6g}")
        return {"bytes/inner step": bytes_sent() // steps, "inner steps": steps, "loss": mean}

    return details


def build_ddp_adamw(ctx: Context) -> Variant:
    """DDP with AdamW: an fp32 gradient allreduce every step (the reference)."""
    ddp = ctx.ddp(ctx.model())
    inner = torch.optim.AdamW(ddp.parameters(), lr=INNER_LR)
    per_step = allreduce_bytes_sent(sum(p.numel() * p.element_size() for p in ddp.parameters()), ctx.world)
    details = _report(ctx, ddp.module, inner, lambda: per_step * _inner_steps(inner))
    return Variant(train_step(ctx, ddp, inner), details=details)


def build_dcomm(ctx: Context, compression: str | None = None) -> Variant:
    """dcomm's ``DiLoCoOptimizer`` over WORLD, its pseudo-gradients sent in ``compression``."""
    from dcomm.averaging import DiLoCoOptimizer

    model = ctx.model()
    inner, outer = _optimizers(model)
    opt = DiLoCoOptimizer(inner, outer, sync_every=ctx.sync_every, compression=compression)
    return Variant(train_step(ctx, model, opt), details=_report(ctx, model, inner, lambda: opt.bytes_sent))


def _start_lighthouse(ctx: Context) -> tuple[Any, str]:
    """Rank 0 starts a lighthouse for all ranks; every rank gets its address (or rank 0's error)."""
    from torchft.coordination import LighthouseServer

    lighthouse, message = None, ""
    if ctx.bench.rank == 0:
        try:
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=ctx.world)
            message = lighthouse.address()
        except Exception as exc:  # sent to the other ranks, which would otherwise wait for an address
            message = f"error: {short_error(exc)}"
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ctx.bench.side_group)
    if box[0].startswith("error: "):
        raise RuntimeError(f"torchft's LighthouseServer failed on rank 0: {box[0]}")
    return lighthouse, box[0]


def _shut_down(manager: Any, lighthouse: Any, store: dist.TCPStore) -> None:
    """Stop this rank's torchft manager, then (rank 0) the lighthouse; ``store`` lives until then.

    ``wait=True``: torchft's non-blocking shutdown leaves its checkpoint server's thread running.
    """
    del store
    manager.shutdown(wait=True)
    if lighthouse is not None:
        lighthouse.shutdown()


def _torchft_manager(ctx: Context) -> tuple[Any, Any, dist.TCPStore]:
    """This rank's torchft ``Manager`` (a replica group of one), rank 0's lighthouse and the store."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    lighthouse, address = _start_lighthouse(ctx)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    process_group = ProcessGroupNCCL if ctx.bench.is_cuda else ProcessGroupGloo
    timeouts = {key: TORCHFT_TIMEOUT for key in ("timeout", "quorum_timeout", "connect_timeout")}
    manager = Manager(
        pg=process_group(timeout=TORCHFT_TIMEOUT),
        min_replica_size=ctx.world,
        use_async_quorum=False,  # DiLoCo requires it
        load_state_dict=None,
        state_dict=None,
        replica_id=f"bench{ctx.bench.rank}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,  # a replica group of one rank
        world_size=1,
        lighthouse_addr=address,
        **timeouts,
    )
    return manager, lighthouse, store


def build_dcomm_ft(ctx: Context) -> Variant:
    """dcomm's ``DiLoCoOptimizer(manager=...)``: the torchft variant's managers, dcomm's syncs."""
    from dcomm.averaging import DiLoCoOptimizer

    manager, lighthouse, store = _torchft_manager(ctx)
    model = ctx.model()
    inner, outer = _optimizers(model)
    opt = DiLoCoOptimizer(inner, outer, sync_every=ctx.sync_every, manager=manager)
    step = train_step(ctx, model, opt)
    weakref.finalize(step, _shut_down, manager, lighthouse, store)
    return Variant(step, details=_report(ctx, model, inner, lambda: opt.bytes_sent))


def build_torchft(ctx: Context, quantize: bool = False) -> Variant:
    """torchft's ``DiLoCo``: this rank is a replica group of one, meeting the others at rank 0's lighthouse.

    ``quantize``: its fp8 pseudo-gradients (``should_quantize``; CUDA with triton only), counted as
    one byte per value (its scales are not counted).
    """
    from torchft.local_sgd import DiLoCo

    manager, lighthouse, store = _torchft_manager(ctx)
    handed = [0]
    allreduce = manager.allreduce

    def counted_allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        handed[0] += tensor.numel() * (1 if kwargs.get("should_quantize") else tensor.element_size())
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counted_allreduce
    model = ctx.model()
    inner, outer = _optimizers(model)
    diloco = DiLoCo(
        manager, [model], inner, outer, sync_every=ctx.sync_every, backup_device=ctx.device, should_quantize=quantize
    )
    diloco.__enter__()  # its hooks on inner.step run the syncs; they go with inner
    step = train_step(ctx, model, inner)
    weakref.finalize(step, _shut_down, manager, lighthouse, store)
    return Variant(step, details=_report(ctx, model, inner, lambda: allreduce_bytes_sent(handed[0], ctx.world)))


def diloco_case(ctx: Context) -> Case:
    variants: dict[str, Callable[[], Variant]] = {"ddp adamw": lambda: build_ddp_adamw(ctx)}
    pairs: list[Pair] = []
    missing = ctx.bench.agree(torchft_missing())  # every rank builds the same variants
    details: dict[str, Any] = {"H": ctx.sync_every, "torchft": missing or _torchft_version()}
    # (row, variant suffix, dcomm's compression); torchft quantizes only on CUDA, so the
    # compressed pseudo-gradients are compared there.
    runs = [("diloco", "", None)] + ([("diloco/fp8", " fp8", "fp8")] if ctx.bench.is_cuda else [])
    for label, suffix, compression in runs:
        dcomm, torchft = f"dcomm diloco{suffix}", f"torchft diloco{suffix}"
        variants[dcomm] = functools.partial(build_dcomm, ctx, compression)
        if missing:
            pairs.append(Pair(label, dcomm, "ddp adamw", "dcomm/reference"))
        else:
            variants[torchft] = functools.partial(build_torchft, ctx, compression is not None)
            pairs += impl_pairs(label, dcomm, torchft, "ddp adamw")
            if compression is None:  # fault tolerance's cost: dcomm on torchft's manager
                variants["dcomm diloco ft"] = functools.partial(build_dcomm_ft, ctx)
                pairs.append(Pair("diloco ft", "dcomm diloco ft", dcomm, "dcomm/reference"))
                pairs.append(Pair("diloco ft", "dcomm diloco ft", torchft, "dcomm/torch"))
    return Case("diloco", variants, pairs, steps_per_round=ctx.sync_every, warmup_steps=ctx.sync_every, details=details)
