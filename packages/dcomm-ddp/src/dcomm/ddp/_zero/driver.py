"""What every ZeRO overlap driver does per DDP bucket, whatever it owns.

A driver is the state behind one wrapped hook. The base class runs the first-call checks, keeps the
CUDA side stream, queues each bucket until it is updated (behind the next bucket with
``hook_with_zero_step_interleaved``; all together at the last bucket, in one local step, with
``hook_with_zero_step``), runs the local optimizer on a subset of its parameters, and waits for the
parameter collectives before the next forward: at the end of backward, or, with
``gather_during_forward``, in each module's next forward for that module's own parameters.
:class:`ParameterDriver` and :class:`ShardedDriver` say what a bucket's update is.

Example::

    >>> class MyDriver(Driver):  # doctest: +SKIP
    ...     def launch(self, state, bucket): ...
    ...     def complete(self, item): ...
    ...     def complete_all(self, items): ...
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import dcomm.ddp._torch_private as private
from dcomm.core import all_gather_single, start_all_gather
from dcomm.ddp._zero.forward_waits import ForwardWaits
from dcomm.ddp._zero.fused_step import fusable, fused
from dcomm.ddp._zero.layout import partition

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
Checks = Callable[[Any], None]

logger = logging.getLogger("dcomm.ddp.zero_overlap")


def optimizer_class(zero: ZeroRedundancyOptimizer) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class of ``zero``'s (functional) overlap optimizer."""
    constructor = private.optim_constructor(zero)
    table = private.functional_optimizers()
    for cls, functional in table.items():
        if constructor is functional or constructor is cls:
            return cls
    raise ValueError(
        f"zero: optimizer {constructor!r} has no torch.optim equivalent; use one of {sorted(c.__name__ for c in table)}"
    )


def averaged_bucket(value: object, numel: int) -> torch.Tensor:
    """The flat averaged bucket that a wrapped DDP hook's future gave, checked for its size."""
    if isinstance(value, (list, tuple)):
        value = value[0] if len(value) == 1 else None
    if not isinstance(value, torch.Tensor) or value.numel() != numel:
        got = type(value).__name__ if not isinstance(value, torch.Tensor) else f"{value.numel()} elements"
        raise RuntimeError(
            f"hook: the wrapped hook's future gave {got}, expected a tensor of the bucket's {numel} elements; "
            "wrap a hook that returns the averaged bucket (allreduce_hook, fp16_compress_hook, bf16_compress_hook)"
        )
    return value.reshape(-1)


def all_gather(output: torch.Tensor, piece: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Asynchronous all-gather of every rank's ``piece`` into ``output`` (a direct process group call)."""
    return start_all_gather(output, piece, group)


def all_gathers(pairs: list[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup) -> list[Any]:
    """Asynchronous all-gathers of ``(output, piece)`` pairs, issued back to back.

    On CUDA they are coalesced into one NCCL group where torch offers ``_coalescing_manager``;
    elsewhere (gloo, or a torch without it) they are launched one by one.
    """
    manager = private.coalescing_manager()
    if manager is None or len(pairs) < 2 or not pairs[0][0].is_cuda:
        return [all_gather(output, piece, group) for output, piece in pairs]
    with manager(group=group, async_ops=True) as coalesced:
        for output, piece in pairs:
            # Through torch's function: the coalescing manager collects the calls made through it.
            all_gather_single(output, piece, group, async_op=True)
    return [coalesced]


@dataclass(frozen=True)
class Setup:
    """What every driver is built from."""

    hook: Hook  # the wrapped DDP hook
    ddp: DistributedDataParallel
    zero: ZeroRedundancyOptimizer
    buckets: list[list[torch.Tensor]]  # DDP's expected settled buckets
    interleaved: bool  # update each bucket behind the next one, or all in one step at the last
    first_call_checks: Checks
    gather_during_forward: bool = False  # wait for each module's parameters in the next forward


class Driver:
    """Per-(ddp, zero) state shared by every call of one wrapped hook.

    Subclasses implement :meth:`launch` (communicate one bucket's gradient; return an item with
    a ``fut`` attribute, the future DDP gets), :meth:`complete` (the interleaved hook: update the
    bucket's parameters and send them out) and :meth:`complete_all` (``hook_with_zero_step``: one
    step over every bucket's parameters at the last bucket, then send them all out).
    """

    def __init__(self, setup: Setup, shard_buckets: bool) -> None:
        self.hook = setup.hook
        # Weak: DDP's C++ reducer holds this hook, and Python's garbage collector cannot see that
        # reference, so a strong one back to DDP would keep the model, DDP and ZeRO alive forever.
        self._ddp = weakref.ref(setup.ddp)
        self.zero = zero = setup.zero
        self.group: dist.ProcessGroup = zero.process_group
        self.rank: int = zero.rank
        self.world: int = zero.world_size
        self.interleaved = setup.interleaved
        self.first_call_checks: Checks | None = setup.first_call_checks
        self.plans: dict[int, Any] = {}
        self.pending: list[Any] = []
        self.gradient_works: list[Any] = []  # the driver's own gradient collectives: waited at the last bucket
        self.works: list[Any] = []  # parameter collectives: waited once backward has ended
        # With gather_during_forward, the parameter collectives each module's next forward waits
        # for (or the next backward, for a module that did not run).
        self.forward_waits = ForwardWaits(setup.ddp.module) if setup.gather_during_forward else None
        self._group_of: dict[int, int] | None = None  # id(param) -> its local group (several groups only)
        self._fused_step = False  # the local step runs torch's fused Adam (decided once per backward pass)
        self.stream: Any = None
        self.fallbacks = 0  # buckets allreduced instead of reduce-scattered once DDP settled
        self.settled = False  # DDP has rebuilt its buckets: a plan checked since then stays valid
        # Set when DDP's reducer runs this hook in C++ (dcomm.ddp.native_hooks): switched on, the
        # C++ hook averages every bucket and calls :meth:`run_last_bucket` once per backward.
        self.native_switch: Any = None
        self.frozen: dict[int, Any] = {}  # bucket index -> plan, checked after DDP settled
        self.bucket_count = 0  # DDP's buckets in the last backward pass
        # Fix every parameter's owner now, for good: the step can then run from iteration 1.
        private.clear_cache(zero)
        owners = partition(setup.buckets, self.world, shard_buckets)
        self.local_groups = private.partition_parameters(zero, owners)[self.rank]

    @property
    def ddp(self) -> DistributedDataParallel:
        ddp = self._ddp()
        if ddp is None:
            raise RuntimeError("hook: its DistributedDataParallel was deleted; build a new hook for the new model")
        return ddp

    # -- what subclasses define -------------------------------------------------------------------

    def can_run_in_cpp(self) -> bool:
        """Whether a C++ hook can communicate every bucket and leave only the last one to Python.

        Only ``hook_with_zero_step``'s can: the interleaved hook steps at every bucket.
        """
        return False

    def register_in_cpp(self, extension: Any, reducer: Any, state: object, python_hook: Hook) -> Any:
        """Put this driver's C++ hook on DDP's reducer, switched off (it runs ``python_hook``); its switch."""
        raise NotImplementedError

    def ready_for_cpp(self) -> bool:
        """Give the C++ hook what it needs once DDP settled; False where it cannot take over."""
        return True

    def launch(self, state: Any, bucket: dist.GradBucket) -> Any:
        raise NotImplementedError

    def complete(self, item: Any) -> None:
        raise NotImplementedError

    def complete_all(self, items: list[Any]) -> None:
        raise NotImplementedError

    def start_backward(self) -> None:
        """Called on the first bucket of every backward."""

    def end_backward(self) -> None:
        """Called on the last bucket of every backward, before :meth:`finish_after_backward`."""

    # -- gather_during_forward ------------------------------------------------------------------

    def defer(self, params: list[torch.Tensor], work: Any) -> None:
        """Leave ``work`` (bringing back ``params``) to the next forward (``gather_during_forward`` only)."""
        assert self.forward_waits is not None  # only drivers built with gather_during_forward defer
        self.forward_waits.defer(params, work)

    def wait_deferred(self) -> None:
        """Wait for every deferred parameter collective (a stream wait on CUDA); a no-op without any."""
        if self.forward_waits is not None:
            self.forward_waits.wait_all()

    # -- shared machinery ----------------------------------------------------------------------

    def plan(self, bucket: dist.GradBucket) -> Any:
        """The plan of this bucket: made once per layout, never re-checked once DDP settled."""
        index = bucket.index()
        plan = self.frozen.get(index)
        if plan is not None:
            return plan
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        plan = self.plans.get(index)
        if plan is None or plan.key != key:
            # DDP changed this bucket (first iterations, or its rebuild): plan it anew.
            plan = self.plans[index] = self.make_plan(key, params)
        if self.settled:
            self.frozen[index] = plan  # DDP rebuilds its buckets once: this layout is final
        return plan

    def make_plan(self, key: tuple[int, ...], params: list[torch.Tensor]) -> Any:
        raise NotImplementedError

    def in_stream(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the side stream (after the work queued so far), or directly off CUDA."""
        stream = self.stream
        if stream is None:
            fn()
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            fn()

    def local_step(self, params: list[torch.Tensor]) -> None:
        """Step the local optimizer on ``params`` only (their ``.grad`` set by the caller).

        Each parameter is stepped with the hyperparameters of its own group. They are copied from
        ``zero.param_groups`` once per backward pass (see :meth:`begin_backward`), not per call.
        Adam and AdamW left to torch's default implementation step in its fused kernel on CUDA
        (:mod:`dcomm.ddp._zero.fused_step`).
        """
        groups = self.zero.optim.param_groups
        everything = [group["params"] for group in groups]
        if len(groups) == 1:
            chosen = [params]
        else:
            if self._group_of is None:
                self._group_of = {id(p): i for i, group in enumerate(groups) for p in group["params"]}
            chosen = [[] for _ in groups]
            for p in params:
                chosen[self._group_of[id(p)]].append(p)
        try:
            for group, subset in zip(groups, chosen, strict=True):
                group["params"] = subset
            optim = self.zero.optim
            with fused(optim) if self._fused_step else contextlib.nullcontext():
                optim.step()
        finally:
            for group, own in zip(groups, everything, strict=True):
                group["params"] = own

    def begin_backward(self) -> None:
        """Once per backward pass: take the hyperparameters set since the last."""
        zero = self.zero
        private.sync_param_groups(zero, zero.param_groups, zero.optim.param_groups)
        self._fused_step = fusable(zero.optim)  # with the hyperparameters just taken
        if not self.settled and private.has_rebuilt_buckets(self.ddp):
            self.settled = True
        # Parameters whose modules did not run in the forward: back before their owners step them again.
        self.wait_deferred()
        self.start_backward()

    def finish(self) -> None:
        """Make the next forward see every updated parameter (a stream wait on CUDA)."""
        works, self.works = self.works, []
        for work in works:
            work.wait()

    def finish_after_backward(self) -> None:
        """:meth:`finish` once backward has ended, after DDP's own end-of-backward work.

        Waiting at the last bucket would queue DDP's copy of the averaged buckets into ``.grad``
        behind the parameter collectives on the current stream; waited for from a callback that
        the autograd engine runs after DDP's (queued from one queued now, so it runs after every
        callback queued so far), the copy runs beside them. ``backward()`` still returns with the
        current stream (or the host, off CUDA) ordered after them. Outside a backward pass (a hook
        called directly) it waits now.
        """
        engine = private.autograd_engine()

        def after_what_is_queued() -> None:
            engine.queue_callback(self.finish)

        try:
            engine.queue_callback(after_what_is_queued)
        except RuntimeError:  # not inside a backward pass
            self.finish()

    def wait_gradients(self) -> None:
        """Order the current stream (or the host) after the driver's own gradient collectives."""
        works, self.gradient_works = self.gradient_works, []
        for work in works:
            work.wait()

    def refuse_buckets_at_once(self) -> None:
        """Raise if DDP hands over several buckets at once, as ``static_graph=True`` first does.

        In its first iteration a static-graph DDP launches every bucket from its post-backward
        callback, all with index 0 and none last, so the updates could not be ordered or
        stepped: the run would silently drift from a non-overlapped ZeRO. A model that fits in
        DDP's first bucket (1 MiB) has a single bucket then, and works.
        """
        ddp = self._ddp()
        if ddp is not None and getattr(ddp, "static_graph", False):
            raise RuntimeError(
                "hook: DDP was built with static_graph=True and handed over several buckets at once in its "
                "first iteration (the model is larger than DDP's first bucket), which the ZeRO overlap hooks "
                "cannot order; build DistributedDataParallel without static_graph for them"
            )

    def reset(self) -> None:
        """Drop what an interrupted backward left behind."""
        self.pending.clear()
        self.wait_gradients()
        self.finish()
        self.wait_deferred()

    # -- the hook -----------------------------------------------------------------------------------

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.first_call_checks is not None:
            checks, self.first_call_checks = self.first_call_checks, None
            checks(state)
        index = bucket.index()
        if index == 0:
            if self.pending or self.works or self.gradient_works:
                self.refuse_buckets_at_once()
                self.reset()
            buffer = bucket.buffer()
            if self.stream is None and buffer.is_cuda:
                self.stream = torch.cuda.Stream(device=buffer.device)
            self.begin_backward()
        item = self.launch(state, bucket)
        self.pending.append(item)
        last = bucket.is_last()
        if self.interleaved:
            # Update the previous bucket now: its step and parameter collective queue behind
            # this bucket's gradient collective, so the two pipeline instead of serializing.
            while len(self.pending) > (0 if last else 1):
                self.complete(self.pending.pop(0))
        elif last:
            self.complete_all(self.pending)
            self.pending = []
        if last:
            if not self.settled:
                for stale in [i for i in self.plans if i > index]:
                    del self.plans[stale]
            self.wait_gradients()  # before DDP reads any bucket
            self._backward_ended(index + 1)
            if self.native_switch is not None:
                self._switch_to_cpp()
        return item.fut

    def _backward_ended(self, bucket_count: int) -> None:
        """At the last bucket, every bucket handed over: the subclass's end, then the parameters' wait."""
        self.bucket_count = bucket_count
        self.end_backward()
        self.finish_after_backward()

    def planned_for_good(self) -> bool:
        """Whether DDP has settled and every bucket of the last backward pass has its final plan."""
        return self.settled and sorted(self.frozen) == list(range(self.bucket_count))

    # -- run by DDP's reducer in C++ ------------------------------------------------------------

    def _switch_to_cpp(self) -> None:
        """Switch the C++ hook on once ``hook_with_zero_step``'s buckets are final: settled, every one planned."""
        if self.interleaved or self.pending or not self.planned_for_good():
            return
        if not self.ready_for_cpp():
            return
        if self.stream is not None:
            # Only the side stream, where the step runs, waits for every bucket; DDP's copies of
            # the buckets into .grad each follow their own bucket's collective.
            stream = self.stream
            self.native_switch.wait_on(stream.stream_id, stream.device_index, stream.device_type)
        self.native_switch.set(True)
        if self.rank == 0:
            logger.info(
                "ZeRO overlap: DDP's reducer now communicates every bucket in C++ and calls the fused step "
                "once per backward pass, at its last bucket"
            )

    def run_last_bucket(self, indices: list[int], averaged: list[torch.Tensor]) -> None:
        """The fused step, called by the C++ hook at the last bucket with every bucket averaged.

        The C++ hook has ordered the side stream (CUDA) or the host after every bucket's
        collective; ``averaged[i]`` is bucket ``indices[i]``'s averaged gradient.
        """
        self.begin_backward()
        self.complete_all([self.averaged_item(index, tensor) for index, tensor in zip(indices, averaged, strict=True)])
        self._backward_ended(len(indices))

    def averaged_item(self, index: int, averaged: torch.Tensor) -> Any:
        """What :meth:`launch` would have returned for bucket ``index``, already averaged into ``averaged``."""
        raise NotImplementedError
