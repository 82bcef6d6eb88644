"""ZeRO overlap with whole parameters per owner: the default (``reduce_scatter=False``) path.

The wrapped hook averages every bucket (an allreduce); when it is an ``allreduce_hook`` the
driver launches that allreduce itself and waits for it at the last bucket, which saves a future
callback per bucket on the backward pass's thread. Each parameter has one owner rank (see
:func:`dcomm.ddp._zero.layout.partition`); the owner steps it with the averaged gradient and
sends it to the other ranks. A bucket's ZeRO parameters are packed by owner into one flat buffer
that they become views of: when the owned pieces are nearly equal they are padded to one size
and one ``all_gather_into_tensor`` returns them all, otherwise each owner broadcasts its piece.
With ``hook_with_zero_step`` every bucket's owned parameters are stepped together at the last
bucket, and the collectives of every bucket follow back to back; once DDP has settled its buckets,
the pieces that owners broadcast (one owner's parameters in one bucket) are laid out in groups
across owners (:mod:`dcomm.ddp._zero.send_groups`), so that the last bucket returns each group with one all-gather
instead of one broadcast per piece. Pieces, not buckets: where gradients arrive in another order than
the parameters' (autocast puts a weight's cast between it and its layer's bias), DDP's settled
buckets mix the owners chosen from the expected ones.

Example::

    >>> driver = ParameterDriver(Setup(allreduce_hook, ddp, zero, buckets, True, checks), False)  # doctest: +SKIP
    >>> ddp.register_comm_hook(None, driver)  # doctest: +SKIP
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import dcomm.ddp._torch_private as private
from dcomm.core import AveragePlan, completed_future, plan_average, start_allreduce
from dcomm.ddp._zero.checks import averaging_dtype
from dcomm.ddp._zero.driver import (
    Driver,
    Setup,
    all_gather,
    all_gathers,
    averaged_bucket,
    logger,
    optimizer_class,
)
from dcomm.ddp._zero.layout import bind_views
from dcomm.ddp._zero.send_groups import SendGroup, choose_groups, merge_owners, pack_group


@dataclass
class _Owner:
    """The parameters of one bucket that one rank updates: one contiguous piece of ``flat``."""

    rank: int
    src: int  # global rank, for broadcast
    flat: torch.Tensor  # the buffer the parameters are views of: the bucket's, or their send group's
    start: int  # of the piece in flat
    numel: int
    params: list[torch.Tensor]
    offsets: list[int]  # of each parameter in the bucket's flat gradient
    positions: list[int]  # of each parameter in the bucket
    # Set once DDP settled: hook_with_zero_step sends the group's pieces with one all-gather.
    group: SendGroup | None = None


@dataclass
class _BucketPlan:
    """How one DDP bucket is communicated and updated.

    ``flat`` holds the bucket's ZeRO parameters (they are views into it), packed by owner. With
    ``gather`` every owner's piece is padded to ``piece`` elements and laid out by rank
    (``[rank0 | rank1 | ...]``), so one ``all_gather_into_tensor`` returns the updated
    parameters; otherwise pieces are packed back to back and each owner broadcasts its own, or,
    once in a send group, lives in the group's buffer (``flat`` then holds the rest, or is None).
    """

    key: tuple[int, ...]
    numel: int
    owners: list[_Owner]
    mine: _Owner | None
    flat: torch.Tensor | None
    gather: bool
    piece: int
    # (param, its gradient view) of mine into DDP's bucket buffer at address ``views_of``: a hook
    # that averages in place (allreduce_hook) hands over the same memory every step once DDP
    # settled, so the views are made once.
    grad_views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    views_of: int = -1


@dataclass
class _Send:
    """One parameter collective: an all-gather ``(output, this rank's piece)`` or a broadcast ``(piece, src)``."""

    params: list[torch.Tensor]  # what it brings back
    gather: tuple[torch.Tensor, torch.Tensor] | None = None
    broadcast: tuple[torch.Tensor, int] | None = None

    def start(self, group: dist.ProcessGroup) -> Any:
        """Issue the collective on ``group``; its work."""
        if self.gather is not None:
            return all_gather(*self.gather, group)
        assert self.broadcast is not None  # a send is one or the other
        piece, src = self.broadcast
        return dist.broadcast(piece, src=src, group=group, async_op=True)


@dataclass
class _Update:
    plan: _BucketPlan
    fut: torch.futures.Future  # what DDP gets
    buffer_address: int  # of DDP's bucket buffer
    work: Any = None  # the driver's own allreduce of the bucket (see ParameterDriver.launch)
    used: torch.Tensor | None = None  # per bucket parameter: 1 if any rank computed its gradient
    used_work: Any = None  # the MAX allreduce of ``used`` (find_unused_parameters=True only)
    used_here: bool = True  # this rank computed every gradient of the bucket: all are used, no need to look


class ParameterDriver(Driver):
    """Per-(ddp, zero) state of a ``reduce_scatter=False`` overlap hook."""

    def __init__(self, setup: Setup, shard_buckets: bool) -> None:
        super().__init__(setup, shard_buckets)
        zero = setup.zero
        zero.optim = optimizer_class(zero)(self.local_groups, **private.optim_defaults(zero))
        private.sync_param_groups(zero, zero.optim.param_groups, zero.param_groups)
        self.averages_itself = _is_allreduce_hook(setup.hook)
        self.grouped = False  # the broadcast pieces were put into send groups
        self.average_plans: dict[tuple[torch.dtype, torch.device], AveragePlan] = {}
        # With find_unused_parameters=True, the ids of the parameters that got a gradient on this
        # rank since the last synchronized backward (as DDP's own used map, no_sync passes included).
        self.used: set[int] | None = None
        if getattr(setup.ddp, "find_unused_parameters", False):
            self.used = set()
            for bucket in setup.buckets:
                for p in bucket:
                    p.register_hook(_marks_used(self.used, id(p)))

    def can_run_in_cpp(self) -> bool:
        # The C++ hook averages as _launch does and steps at the last bucket only; which
        # parameters some rank used it cannot tell.
        return self.averages_itself and self.used is None and not self.interleaved

    def register_in_cpp(self, extension: Any, reducer: Any, state: object, python_hook: Any) -> Any:
        return extension.register_average_hook(
            reducer, self.group, self.plan_for_cpp, state, python_hook, self.run_last_bucket
        )

    def plan_for_cpp(self, dtype: torch.dtype, device: torch.device) -> tuple[float, Any, None]:
        """The C++ hook's averaging of a bucket: (divisor before the sum, op, None: in place)."""
        plan = self._average_plan_for(dtype, device)
        return plan.pre, plan.op, None

    def averaged_item(self, index: int, averaged: torch.Tensor) -> _Update:
        return _Update(self.frozen[index], completed_future(averaged), averaged.data_ptr())

    # -- planning ---------------------------------------------------------------------------

    @torch.no_grad()
    def make_plan(self, key: tuple[int, ...], params: list[torch.Tensor]) -> _BucketPlan:
        owner_of = private.param_to_rank(self.zero)
        per_rank: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        offset = 0
        for position, p in enumerate(params):
            if p in owner_of:
                per_rank.setdefault(owner_of[p], []).append((p, offset, position))
            offset += p.numel()
        sizes = {rank: sum(p.numel() for p, _, _ in members) for rank, members in per_rank.items()}
        total = sum(sizes.values())
        piece = max(sizes.values(), default=0)
        # One all-gather of world equal (padded) pieces moves about (world - 1) * piece elements
        # per link; one broadcast per owner about `total`. Gather when that is no worse. Every
        # rank sees the same layout, so every rank makes the same choice.
        gather = len(per_rank) >= 2 and (self.world - 1) * piece <= total
        owners = []
        flat = None
        if per_rank:
            first = next(iter(per_rank.values()))[0][0]
            flat = torch.zeros(self.world * piece if gather else total, dtype=first.dtype, device=first.device)
        start = 0
        for rank in sorted(per_rank):
            members = per_rank[rank]
            if gather:
                start = rank * piece
            assert flat is not None  # allocated above: per_rank is not empty
            params_, offsets, positions = (list(column) for column in zip(*members, strict=True))
            bind_views(flat, params_, start)
            src = dist.get_global_rank(self.group, rank)
            owners.append(_Owner(rank, src, flat, start, sizes[rank], params_, offsets, positions))
            start += sizes[rank]
        mine = next((o for o in owners if o.rank == self.rank), None)
        return _BucketPlan(key, offset, owners, mine, flat, gather, piece)

    # -- per-bucket work ----------------------------------------------------------------------

    def launch(self, state: Any, bucket: dist.GradBucket) -> _Update:
        update = self._launch(state, bucket)
        if self.used is not None:
            # DDP leaves the .grad of a parameter no rank used untouched, so plain ZeRO skips it
            # (or steps its old .grad); which ones those are, every rank learns from one small MAX.
            # Every rank joins it; only a rank that missed a gradient itself reads the result.
            flags = [key in self.used for key in update.plan.key]
            device = bucket.buffer().device
            update.used_here = all(flags)
            if update.used_here:  # a fill on the device: no host-to-device copy
                update.used = torch.ones(len(flags), dtype=torch.int32, device=device)
            else:  # from pinned memory: the host does not wait for the backward stream
                pinned = torch.tensor(flags, dtype=torch.int32, pin_memory=device.type == "cuda")
                update.used = pinned.to(device, non_blocking=True)
            update.used_work = start_allreduce(update.used, self.group, dist.ReduceOp.MAX)
        return update

    def end_backward(self) -> None:
        if self.used is not None:
            self.used.clear()

    def finish(self) -> None:
        super().finish()
        if not self.grouped and not self.interleaved and self.planned_for_good():
            # Every collective of the pass waited for (the deferred ones too, this once): the
            # parameters can move. (The interleaved hook sends bucket by bucket: no group to send.)
            self.wait_deferred()
            self._group_sends()

    @torch.no_grad()
    def _group_sends(self) -> None:
        """Lay the broadcast pieces out in send groups (once, with no collective in flight)."""
        self.grouped = True
        # Every parameter is sent at the last bucket: the pieces of a bucket padded to one size
        # may join groups across buckets too.
        plans = [plan for _, plan in sorted(self.frozen.items())]
        pieces = [owner for plan in plans for owner in plan.owners]
        sizes = [(owner.numel, owner.rank, (owner.flat.dtype, owner.flat.device)) for owner in pieces]
        # Sent all at once (no forward waits each module's own): one group per kind where it pads little.
        chosen = merge_owners(sizes, self.world) if self.forward_waits is None else []
        merged = {i for indices in chosen for i in indices}
        rest = [i for i in range(len(pieces)) if i not in merged]
        chosen += [[rest[j] for j in group] for group in choose_groups([sizes[i] for i in rest], self.world)]
        for indices in chosen:
            members = [pieces[i] for i in indices]
            group, starts = pack_group([(owner.rank, owner.params) for owner in members], self.world)
            for owner, start in zip(members, starts, strict=True):
                owner.flat, owner.start, owner.group = group.flat, start, group
        for plan in plans:
            _repack_ungrouped(plan)
        if chosen and self.rank == 0:
            logger.info(
                "ZeRO overlap: %d pieces that owners broadcast (%d buckets) now return in %d all-gathers",
                sum(len(indices) for indices in chosen),
                len({id(plan) for plan in plans for owner in plan.owners if owner.group is not None}),
                len(chosen),
            )

    def _launch(self, state: Any, bucket: dist.GradBucket) -> _Update:
        plan = self.plan(bucket)
        buffer = bucket.buffer()
        if not self.averages_itself:
            return _Update(plan, self.hook(state, bucket), buffer.data_ptr())
        # The wrapped hook is an allreduce_hook: average the bucket here, as DDP's built-in
        # reduction does (a premultiplied sum on NCCL), and hand DDP a completed future. The
        # allreduces are waited for at the last bucket, before DDP reads any bucket, so no bucket
        # pays for a future callback on the backward pass's thread.
        average = self._average_plan_for(buffer.dtype, buffer.device)
        if average.pre != 1.0:
            buffer.div_(average.pre)
        work = start_allreduce(buffer, self.group, average.op)
        self.gradient_works.append(work)  # waited for at the last bucket, before DDP reads any bucket
        return _Update(plan, completed_future(buffer), buffer.data_ptr(), work)

    def _average_plan_for(self, dtype: torch.dtype, device: torch.device) -> AveragePlan:
        key = (dtype, device)
        plan = self.average_plans.get(key)
        if plan is None:
            plan = self.average_plans[key] = plan_average(
                self.group, dtype, device, arithmetic="predivide", nccl_average=False
            )
        return plan

    def complete(self, item: _Update) -> None:
        """Wait for the bucket's averaged gradient, step this rank's share, send it out."""
        self.in_stream(lambda: self._step_and_send(item))

    def complete_all(self, items: list[_Update]) -> None:
        """One step over the owned parameters of every bucket, then send them all."""
        self.in_stream(lambda: self._step_and_send_all(items))

    def _step_and_send(self, item: _Update) -> None:
        self._step_owned(self._owned_grads(item))
        self._send(item.plan)

    def _step_and_send_all(self, items: list[_Update]) -> None:
        self._step_owned([owned for item in items for owned in self._owned_grads(item)])
        # A send group whose every piece was stepped here returns in one all-gather.
        grouped = [owner.group for item in items for owner in item.plan.owners if owner.group is not None]
        stepped = Counter(id(group) for group in grouped)
        whole = {id(group): group for group in grouped if stepped[id(group)] == group.members}
        self._start(self._sends([item.plan for item in items], whole))

    def _owned_grads(self, item: _Update) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, averaged gradient)`` of the parameters this rank owns in the bucket."""
        plan = item.plan
        if item.work is not None:
            item.work.wait()  # on the side stream on CUDA
            grad = item.fut.value()
        else:
            grad = averaged_bucket(item.fut.wait(), plan.numel)
        mine = plan.mine
        if mine is None:
            return []
        if grad.dtype != mine.flat.dtype:
            raise RuntimeError(
                f"hook: the wrapped hook returned a {grad.dtype} bucket for {mine.flat.dtype} "
                "parameters; wrap a hook that casts its result back to the bucket's dtype"
            )
        if self.stream is not None:
            grad.record_stream(self.stream)
        address = grad.data_ptr()
        if plan.grad_views is not None and plan.views_of == address:
            views = plan.grad_views
        else:
            views = [
                (p, grad[off : off + p.numel()].view_as(p)) for p, off in zip(mine.params, mine.offsets, strict=True)
            ]
            if address == item.buffer_address:
                # Views into DDP's own bucket buffer: keeping them holds no extra memory.
                plan.grad_views, plan.views_of = views, address
        if item.used_work is None or item.used_here:
            return views
        assert item.used is not None  # set with used_work
        item.used_work.wait()
        used = item.used.tolist()  # a host sync on CUDA, only on a rank that missed a gradient
        # A parameter no rank used: what plain ZeRO steps with, its untouched .grad (None: skipped).
        chosen = [(p, g if used[i] else p.grad) for (p, g), i in zip(views, mine.positions, strict=True)]
        return [(p, g) for p, g in chosen if g is not None]

    def _gather_pairs(self, plan: _BucketPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(output, piece)`` of the bucket's all-gather, if it has one."""
        if plan.flat is None or not plan.gather:
            return []
        return [(plan.flat, plan.flat[self.rank * plan.piece : (self.rank + 1) * plan.piece])]

    def _send(self, plan: _BucketPlan) -> None:
        """Return every owner's updated parameters of one bucket to every rank."""
        self._start(self._sends([plan], {}))

    def _sends(self, plans: list[_BucketPlan], whole: dict[int, SendGroup]) -> list[_Send]:
        """The collectives returning every owner's updated parameters of ``plans``.

        A bucket padded to one piece per owner is one all-gather; a send group in ``whole`` (every
        piece of it in ``plans``) is one all-gather; every other piece is its owner's broadcast.
        """
        sends: list[_Send] = []
        in_groups: dict[int, list[torch.Tensor]] = {key: [] for key in whole}
        for plan in plans:
            if plan.gather:
                params = [p for owner in plan.owners for p in owner.params]
                sends += [_Send(params, gather=pair) for pair in self._gather_pairs(plan)]
                continue
            for owner in plan.owners:
                if owner.group is not None and id(owner.group) in whole:
                    in_groups[id(owner.group)] += owner.params
                else:
                    piece = owner.flat[owner.start : owner.start + owner.numel]
                    sends.append(_Send(owner.params, broadcast=(piece, owner.src)))
        sends += [_Send(in_groups[key], gather=group.pair(self.rank)) for key, group in whole.items()]
        return sends

    def _start(self, sends: list[_Send]) -> None:
        """Issue ``sends``: waited for at the end of backward, or by the next forward of their modules.

        At the end of backward the all-gathers go first, coalesced into one NCCL group where torch
        allows. With ``gather_during_forward`` each collective goes alone, the first layers' first,
        and each module's next forward waits for those of its own parameters.
        """
        if self.forward_waits is None:
            self.works.extend(all_gathers([send.gather for send in sends if send.gather is not None], self.group))
            self.works.extend(send.start(self.group) for send in sends if send.broadcast is not None)
            return
        waits = self.forward_waits
        for send in sorted(sends, key=lambda send: waits.first_position(send.params)):
            self.defer(send.params, send.start(self.group))

    def _step_owned(self, owned: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One local step of the ``owned`` parameters with the given gradients."""
        if not owned:
            return
        saved = [p.grad for p, _ in owned]
        try:
            for p, grad in owned:
                p.grad = grad
            self.local_step([p for p, _ in owned])
        finally:
            for (p, _), g in zip(owned, saved, strict=True):
                p.grad = g


@torch.no_grad()
def _repack_ungrouped(plan: _BucketPlan) -> None:
    """Move the pieces of ``plan`` left out of every send group into a buffer of their own.

    The bucket's old buffer is then free, and the grouped pieces' memory is not held twice; the
    pieces left out are broadcast (a bucket that had one all-gather for all its pieces no longer has).
    """
    rest = [owner for owner in plan.owners if owner.group is None]
    if len(rest) == len(plan.owners):
        return
    plan.flat, plan.gather = None, False
    if rest:
        first = rest[0].params[0]
        plan.flat = torch.zeros(sum(owner.numel for owner in rest), dtype=first.dtype, device=first.device)
        start = 0
        for owner in rest:
            bind_views(plan.flat, owner.params, start)
            owner.flat, owner.start = plan.flat, start
            start += owner.numel


def _marks_used(used: set[int], key: int) -> Callable[[torch.Tensor], None]:
    """A gradient hook that adds ``key`` to ``used`` (it holds no reference to the parameter)."""

    def mark(grad: torch.Tensor) -> None:
        used.add(key)

    return mark


def _is_allreduce_hook(hook: object) -> bool:
    """Whether ``hook`` is dcomm's or torch's ``allreduce_hook``, which the driver can replace."""
    try:
        return averaging_dtype(hook) is None
    except ValueError:
        return False
