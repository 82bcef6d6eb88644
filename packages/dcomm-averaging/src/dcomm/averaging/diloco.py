"""DiLoCo: local steps with an inner optimizer, and an outer optimizer on the averaged parameter change.

Every rank trains its replica with the inner optimizer (AdamW, say) for ``sync_every`` steps;
then the change since the last sync, averaged over the group, is the gradient of an outer
optimizer (SGD with Nesterov momentum) that moves a global copy shared by all ranks (DiLoCo,
arXiv 2311.08105). With ``fragments > 1`` the model is synced a fragment at a time, each
fragment at its own point of the period, and ``fragment_sync_delay`` steps later than its
averaging started, so the communication hides behind compute (Streaming DiLoCo, arXiv
2501.18512). ``compression`` sends the averaged change as bf16 or 8/4-bit codes with error
feedback.

Example::

    >>> from dcomm.averaging import DiLoCoOptimizer
    >>> inner = torch.optim.AdamW(model.parameters(), lr=4e-4)  # doctest: +SKIP
    >>> outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)  # doctest: +SKIP
    >>> opt = DiLoCoOptimizer(inner, outer, sync_every=50, compression="int8")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcomm.averaging._diloco.exchange import (
    COMPRESSIONS,
    PendingAverage,
    PseudoGradientExchange,
    ReadyAverage,
)
from dcomm.averaging._diloco.fragments import split_bytes, sync_offsets
from dcomm.averaging._wrapping_optimizer import WrappingOptimizer
from dcomm.averaging.fault_tolerance import QuorumAverage, QuorumExchange, ReplicaQuorum
from dcomm.core import foreach_copy_, foreach_sub_, reduced_by_nccl, resolve_group, views_like
from dcomm.core.validation import boolean, non_negative_int, positive_int

__all__ = ["DiLoCoOptimizer"]


@dataclass
class _InFlight:
    fragment: int
    advance_step: int
    apply_step: int
    average: PendingAverage | ReadyAverage | QuorumAverage
    # With a torchft manager: the pseudo-gradient to send again if the sync fails (None: g - p,
    # unchanged since the sync started), and whether this replica contributes (not when it healed).
    source: torch.Tensor | None = None
    contributes: bool = True


def _finished(average: PendingAverage | ReadyAverage | QuorumAverage) -> torch.Tensor:
    """The result of an average that cannot fail (not one over a torchft quorum)."""
    result = average.result()
    assert result is not None
    return result


def _unique_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            seen.setdefault(id(param), param)
    return list(seen.values())


def _pinned_like(tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """A CPU copy of ``tensor``, in pinned memory when it comes from a GPU (then, with
    ``non_blocking``, the copy is queued on the current stream and the host does not wait)."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    copy.copy_(tensor, non_blocking=non_blocking)
    return copy


@dataclass(frozen=True)
class _FragmentParts:
    """One fragment's tensors, listed once: its parameters, their global copies, the other parameters."""

    params: list[torch.Tensor]
    global_copies: list[torch.Tensor]
    others: list[torch.Tensor]
    numel: int
    dtype: torch.dtype  # of the flat pseudo-gradient: fp32, or fp64 if a parameter is fp64

    @classmethod
    def of(cls, indices: list[int], params: list[torch.Tensor], global_copies: list[torch.Tensor]) -> _FragmentParts:
        mine = [params[j] for j in indices]
        members = set(indices)
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in mine) else torch.float32
        return cls(
            mine,
            [global_copies[j] for j in indices],
            [p for j, p in enumerate(params) if j not in members],
            sum(p.numel() for p in mine),
            dtype,
        )


class DiLoCoOptimizer(WrappingOptimizer):
    """Inner steps on each replica; every ``sync_every`` steps an outer step on the averaged change.

    At construction every parameter of ``inner`` is broadcast from the first rank of
    ``process_group`` (WORLD when None), and a global copy ``g`` of it is kept. ``outer`` must
    optimize exactly the parameters of ``inner``. Each ``step()`` runs ``inner.step()``; after
    every ``sync_every``-th inner step, for every parameter ``p``: ``delta = g - p`` is averaged
    over the group (an fp32 ``SUM`` and a division; fp64 for fp64 parameters), ``p`` is set to
    ``g`` and ``p.grad`` to the averaged delta, ``outer.step()`` runs, ``g`` is set to the new
    ``p`` and the gradients are cleared. Replicas are identical after every sync. A parameter
    with ``requires_grad=False`` at a sync gets no gradient there, so the outer step leaves it
    alone (no weight decay), as torch's optimizers leave one without a gradient.

    * ``fragments=F``: the parameters, in order, form ``F`` contiguous fragments of whole
      parameters and about equal bytes; fragment ``i`` syncs after inner step ``t`` when
      ``t % sync_every == (i + 1) * sync_every // F % sync_every`` (only its parameters take
      the outer step; the others keep their gradients).
    * ``fragment_sync_delay=tau`` (``0 <= tau < sync_every``): a fragment's averaging starts
      (asynchronously) at its sync step and is applied ``tau`` inner steps later; then its
      parameters equal the new global values (or, with ``fragment_update_alpha=a``, ``a`` times
      the local values plus ``1 - a`` times the global ones).
    * ``compression``: ``None``, ``"bf16"``, ``"fp8"``, ``"int8"`` or ``"int4"`` (block-wise fp32
      scales, 256 values a block) for the averaged change, with error feedback kept in
      ``state_dict()``; bytes travel as ``uint8`` and are summed in fp32. A compressed average has
      two stages; on NCCL both are queued at the sync step (the second runs once the first is
      done, and the host never waits), elsewhere the second starts ``(tau + 1) // 2`` steps later.
    * ``offload_global=True`` keeps ``g`` and the outer optimizer's state in CPU (pinned) memory
      between syncs instead of on the parameters' device.
    * ``manager`` (a ``torchft.Manager`` built with ``use_async_quorum=False``, instead of
      ``process_group``; ``pip install 'dcomm-averaging[ft]'``): each sync averages over the
      replicas of torchft's quorum and survives failures. A sync that fails (a replica died inside
      it) is retried with the next quorum on the same pseudo-gradients, so no inner step is lost;
      a replica that joins or restarts heals from a live peer (the whole state is registered with
      the manager) and starts from ``g``. Without failures the result equals the
      ``process_group`` path's bit for bit on gloo. See :mod:`dcomm.averaging.fault_tolerance`.

    Extra memory per parameter byte (fp32 parameters, outer SGD with momentum): ``g`` 1 and the
    momentum 1, on the device by default, on the CPU with ``offload_global``; error feedback
    ``4 (1 + 1/n) / itemsize`` with compression (on the device); while a fragment syncs, its
    fp32 pseudo-gradient (and, with compression, its encoding).

    ``bytes_sent`` counts the pseudo-gradient bytes this rank has sent (ring allreduce:
    ``2 (n - 1) / n`` of the fp32 bytes; compressed: ``2 (n - 1)`` encoded chunks of ``1/n`` of
    the fragment each). ``state_dict()`` holds the inner and outer state, ``g``, the step
    counter, the error feedback and any averaged change not applied yet (it finishes the
    averaging in flight, so call it on every rank at the same step).

    Example::

        >>> opt = DiLoCoOptimizer(inner, outer, sync_every=50, fragments=4, fragment_sync_delay=5)  # doctest: +SKIP
        >>> for x, y in loader:  # doctest: +SKIP
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
        ...     opt.zero_grad()
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        outer: torch.optim.Optimizer,
        sync_every: int,
        process_group: dist.ProcessGroup | None = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        compression: str | None = None,
        *,
        fragment_update_alpha: float = 0.0,
        offload_global: bool = False,
        manager: Any = None,
    ) -> None:
        for name, value in (("inner", inner), ("outer", outer)):
            if not isinstance(value, torch.optim.Optimizer):
                raise TypeError(f"{name}: expected a torch.optim.Optimizer, got {type(value).__name__}")
        if inner is outer:
            raise ValueError("outer: got the same optimizer as inner; build a second one, e.g. SGD(lr=0.7, ...)")
        self.sync_every = positive_int("sync_every", sync_every, "pass the number of inner steps per sync, e.g. 50")
        self.fragments = positive_int("fragments", fragments, "pass 1 for plain DiLoCo")
        self.fragment_sync_delay = non_negative_int(
            "fragment_sync_delay", fragment_sync_delay, "pass 0 to apply each sync at once"
        )
        if self.fragment_sync_delay >= self.sync_every:
            raise ValueError(
                f"fragment_sync_delay: {fragment_sync_delay} must be smaller than sync_every={sync_every}; "
                f"pass 0 to {sync_every - 1}"
            )
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression: expected one of {COMPRESSIONS}, got {compression!r}")
        alpha = fragment_update_alpha
        is_number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
        if not is_number or not 0.0 <= alpha < 1.0:
            raise (ValueError if is_number else TypeError)(
                f"fragment_update_alpha: expected a number in [0, 1), got {alpha!r}; pass 0 (the default)"
            )
        self.compression = compression
        self.fragment_update_alpha = float(alpha)
        self.offload_global = boolean("offload_global", offload_global, "pass True to keep g in CPU memory")
        self.inner = inner
        self.outer = outer
        self.param_groups = inner.param_groups

        self._params = _unique_params(inner)
        self._check_same_params(outer)
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(
                f"inner: its parameters lie on several devices {sorted(map(str, devices))}; "
                "DiLoCoOptimizer needs them on one device (one optimizer pair per device)"
            )
        self._quorum: ReplicaQuorum | None = None
        if manager is not None:
            if process_group is not None:
                raise ValueError(
                    "process_group: got both a process group and a torchft manager; pass one: the manager's "
                    "quorum decides who averages"
                )
            self._quorum = ReplicaQuorum(manager, "DiLoCoOptimizer", self._replica_state, self._load_replica_state)
            self._quorum.check_device(self._params[0].device)
            self.process_group: dist.ProcessGroup | None = None
        else:
            self.process_group = resolve_group(process_group)
            if dist.get_rank(self.process_group) < 0:  # -1: not a member
                raise ValueError("process_group: this rank is not a member; build the optimizer on its members only")
        if len(self._params) < self.fragments:
            raise ValueError(
                f"fragments: {fragments} is more than the {len(self._params)} parameters of inner; "
                f"pass at most {len(self._params)} (a fragment holds whole parameters)"
            )
        sizes = [p.numel() * p.element_size() for p in self._params]
        self._fragments = split_bytes(sizes, self.fragments)
        self._offsets = sync_offsets(self.sync_every, self.fragments)
        self._exchange: PseudoGradientExchange | QuorumExchange
        if self._quorum is not None:
            self._check_one_sync_at_a_time()
            self._exchange = QuorumExchange(self._quorum, compression)
            self._advance_at_launch = False
        else:
            assert self.process_group is not None
            self._exchange = PseudoGradientExchange(self.process_group, compression)
            # On NCCL a compressed sync's second stage only queues work on a side stream: start it at once.
            on_nccl = reduced_by_nccl(self.process_group, self._params[0].device)
            self._advance_at_launch = compression is not None and on_nccl
        self._feedback = [
            self._exchange.new_feedback(sum(self._params[j].numel() for j in indices), self._params[0].device)
            for indices in self._fragments
        ]
        self._in_flight: list[_InFlight] = []
        # Offloaded: the last queued copy between g (or the outer state) and the device; the host
        # waits for it before it reads or writes them itself (state_dict, load_state_dict).
        self._offload_copies: Any = None
        self.inner_steps = 0
        # With a manager: the sync that the quorum being joined is for, (fragment, apply step), or
        # None for the first quorum; a replica healing from this one learns it from its state.
        self._syncing: tuple[int, int] | None = None
        if self._quorum is None:
            self._broadcast_params()
        with torch.no_grad():
            self._global = [_pinned_like(p) if offload_global else p.detach().clone() for p in self._params]
        self._parts = [_FragmentParts.of(indices, self._params, self._global) for indices in self._fragments]
        if self._quorum is not None:
            # The first quorum: with init_sync every replica but the first heals from it; a replica
            # that (re)starts while the others train heals from one of them, at their next sync.
            self._join(None)

    # -- construction -------------------------------------------------------------------------

    def _check_same_params(self, outer: torch.optim.Optimizer) -> None:
        inner_ids = {id(p) for p in self._params}
        outer_ids = {id(p) for p in _unique_params(outer)}
        if inner_ids != outer_ids:
            raise ValueError(
                f"outer: optimizes {len(outer_ids - inner_ids)} parameters that inner does not and misses "
                f"{len(inner_ids - outer_ids)} of inner's; build both from the same parameters, "
                "e.g. model.parameters()"
            )

    def _check_one_sync_at_a_time(self) -> None:
        """A manager commits one sync at a time: each fragment's sync must end before the next starts."""
        offsets = sorted(self._offsets)
        gaps = [b - a for a, b in zip(offsets, [*offsets[1:], offsets[0] + self.sync_every], strict=True)]
        if self.fragment_sync_delay > min(gaps):
            raise ValueError(
                f"fragment_sync_delay: {self.fragment_sync_delay} is longer than the {min(gaps)} steps between two "
                f"fragments' syncs (sync_every={self.sync_every}, fragments={self.fragments}); with a torchft manager "
                f"one sync must end before the next starts: pass at most {min(gaps)}"
            )

    def _broadcast_params(self) -> None:
        """Make every rank start from the parameters of the group's first rank."""
        assert self.process_group is not None
        source = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            sent = [p.detach() if p.is_contiguous() else p.detach().contiguous() for p in self._params]
            works = [dist.broadcast(t, source, group=self.process_group, async_op=True) for t in sent]
            for work in works:
                assert work is not None
                work.wait()
            for param, tensor in zip(self._params, sent, strict=True):
                if tensor.data_ptr() != param.data_ptr():
                    param.detach().copy_(tensor)

    # -- the optimizer interface (param_groups, state, defaults and zero_grad are inner's) ----------

    def _wrapped(self) -> torch.optim.Optimizer:
        return self.inner

    @property
    def bytes_sent(self) -> int:
        """Pseudo-gradient bytes this rank has sent since construction (kept across ``load_state_dict``).

        Example::

            >>> opt.bytes_sent / opt.inner_steps  # bytes per inner step  # doctest: +SKIP
        """
        return self._exchange.bytes_sent

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sync_every={self.sync_every}, fragments={self.fragments}, "
            f"fragment_sync_delay={self.fragment_sync_delay}, compression={self.compression!r},\n"
            f"inner={self.inner!r},\nouter={self.outer!r})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: inner, outer and the global copy must hold the same parameters.

        Example::

            >>> opt.add_param_group({"params": head.parameters()})  # doctest: +SKIP
            Traceback (most recent call last):
            RuntimeError: ...
        """
        raise RuntimeError(
            "add_param_group: DiLoCoOptimizer keeps a global copy of a fixed set of parameters; add the group "
            "to inner and outer before building the DiLoCoOptimizer"
        )

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Run ``inner.step()`` (with ``closure`` if given), then any fragment sync that is due.

        Example::

            >>> opt.step()  # doctest: +SKIP
        """
        loss = self._wrapped_step(closure)
        self.inner_steps += 1
        now = self.inner_steps
        for flight in self._in_flight:
            if flight.advance_step == now:
                flight.average.advance()
        for flight in [f for f in self._in_flight if f.apply_step == now]:
            self._in_flight.remove(flight)
            if self._quorum is not None:
                self._finish(flight)
            else:
                self._apply(flight.fragment, _finished(flight.average))
        delay = self.fragment_sync_delay
        for fragment, offset in enumerate(self._offsets):
            if now % self.sync_every != offset:
                continue
            if self._quorum is not None:
                self._start(fragment)
                continue
            assert isinstance(self._exchange, PseudoGradientExchange)
            average = self._exchange.start(self._pseudo_gradient(fragment), self._feedback[fragment])
            if delay == 0:
                self._apply(fragment, average.result())
            elif self._advance_at_launch:  # queues stage 2 behind stage 1: it starts once stage 1 is done
                average.advance()
                self._in_flight.append(_InFlight(fragment, now, now + delay, average))
            else:  # advancing waits for stage 1 on the host: halfway through the delay
                self._in_flight.append(_InFlight(fragment, now + (delay + 1) // 2, now + delay, average))
        return loss

    # -- syncs over a torchft quorum -----------------------------------------------------------
    #
    # A sync is: join a quorum, start averaging, (fragment_sync_delay steps later) commit. A failed
    # commit joins the next quorum and sends the same pseudo-gradient again, until one commits. A
    # replica that heals in a quorum has the state of a peer that was starting or retrying sync
    # ``self._syncing``: it takes part in that sync with zeros and applies its result.

    def _start(self, fragment: int) -> None:
        """Join a quorum for ``fragment``'s sync and start averaging its pseudo-gradient."""
        apply_step = self.inner_steps + self.fragment_sync_delay
        if self._join((fragment, apply_step)):
            return
        flat = self._pseudo_gradient(fragment)
        source = flat.clone() if self.fragment_sync_delay else None  # p moves before the commit
        self._launch(_InFlight(fragment, 0, apply_step, None, source), flat)  # type: ignore[arg-type]

    def _launch(self, flight: _InFlight, flat: torch.Tensor) -> None:
        """Start ``flight``'s averaging of ``flat``; finish it now if it applies at this step."""
        delay = self.fragment_sync_delay
        flight.advance_step = flight.apply_step - delay + (delay + 1) // 2
        flight.average = self._quorum_start(flight, flat)
        if flight.apply_step == self.inner_steps:
            self._finish(flight)
        else:
            self._in_flight.append(flight)

    def _quorum_start(self, flight: _InFlight, flat: torch.Tensor) -> QuorumAverage:
        assert isinstance(self._exchange, QuorumExchange)
        return self._exchange.start(flat, self._feedback[flight.fragment], flight.contributes)

    def _finish(self, flight: _InFlight) -> None:
        """Commit ``flight`` and apply it, or retry it with the next quorum until it commits."""
        assert self._quorum is not None
        assert isinstance(flight.average, QuorumAverage)
        while True:
            average = flight.average.result()
            if self._quorum.commit():
                assert average is not None
                self._apply(flight.fragment, average)
                return
            flight.average.undo()
            if self._join((flight.fragment, flight.apply_step)):
                return  # healed: this replica now follows its peer's sync
            if not flight.contributes:
                flat = self._zeros(flight.fragment)
            elif flight.source is not None:
                flat = flight.source.clone()
            else:
                flat = self._pseudo_gradient(flight.fragment)
            flight.average = self._quorum_start(flight, flat)

    def _join(self, syncing: tuple[int, int] | None) -> bool:
        """Join a quorum for ``syncing`` (None: the first); True if this replica healed in it.

        A healed replica follows the sync its peer was in (with zeros for its own contribution).
        The first quorum, and one where a healed replica's peer was at its first quorum, commits here.
        """
        assert self._quorum is not None
        self._syncing = syncing
        healed = self._quorum.join()
        while self._syncing is None:  # the first quorum: nothing to average
            self._quorum.barrier()
            if self._quorum.commit():
                return healed
            healed = self._quorum.join() or healed
        if healed:
            fragment, apply_step = self._syncing
            self._launch(_InFlight(fragment, 0, apply_step, None, contributes=False), self._zeros(fragment))  # type: ignore[arg-type]
        return healed

    def _zeros(self, fragment: int) -> torch.Tensor:
        parts = self._parts[fragment]
        return torch.zeros(parts.numel, dtype=parts.dtype, device=parts.params[0].device)

    def _replica_state(self) -> dict[str, Any]:
        """What a replica that heals from this one loads (a copy: this replica goes on training)."""
        self._wait_offload_copies()
        return {
            "config": self._config(),
            "step": self.inner_steps,
            "syncing": self._syncing,
            "inner": copy.deepcopy(self.inner.state_dict()),
            "outer": copy.deepcopy(self.outer.state_dict()),
            "global": [g.clone() for g in self._global],
        }

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        """Become a copy of a peer: its optimizers, ``g`` and schedule; parameters = ``g``; feedback zero.

        The parameters start from the global copy, not the peer's local ones, so that the peer's
        progress since its last sync is not sent twice.
        """
        for key, value in self._config().items():
            if state["config"].get(key) != value:
                raise ValueError(
                    f"manager: a peer's DiLoCoOptimizer has {key}={state['config'].get(key)!r}, this one {value!r}; "
                    "build every replica with the same settings"
                )
        self._wait_offload_copies()
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        self._outer_state_offload(list(range(len(self._params))))
        with torch.no_grad():
            for mine, saved, param in zip(self._global, state["global"], self._params, strict=True):
                mine.copy_(saved)
                param.copy_(mine)
            for feedback in self._feedback:
                if feedback is not None:
                    feedback.sent.zero_()
                    feedback.chunk.zero_()
        self._note_offload_copies()
        self._in_flight = []
        self.inner_steps = state["step"]
        self._syncing = state["syncing"]

    # -- one fragment's sync ------------------------------------------------------------------

    def _pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """``g - p`` of the fragment's parameters, flat, in fp32 (fp64 if one of them is fp64)."""
        parts = self._parts[fragment]
        flat = torch.empty(parts.numel, dtype=parts.dtype, device=parts.params[0].device)
        views = views_like(flat, parts.params)  # shaped like the parameters, made in C++: host time per sync
        with torch.no_grad():  # a few many-tensor kernels, not two per parameter
            foreach_copy_(views, parts.global_copies, non_blocking=True)
            foreach_sub_(views, parts.params)
        self._note_offload_copies()
        return flat

    def _apply(self, fragment: int, average: torch.Tensor) -> None:
        """Reset the fragment to ``g``, take the outer step on the averaged change, and update ``g``."""
        indices = self._fragments[fragment]
        parts = self._parts[fragment]
        params, global_copies, others = parts.params, parts.global_copies, parts.others
        kept_grads = [p.grad for p in others]
        alpha = self.fragment_update_alpha
        with torch.no_grad():
            for param in others:
                param.grad = None
            local = [p.detach().clone() for p in params] if alpha else []
            foreach_copy_(params, global_copies, non_blocking=True)  # offloaded g is pinned: no host wait
            grads = views_like(average, params)
            for param, grad in zip(params, grads, strict=True):
                # A frozen parameter gets no gradient, so the outer step leaves it as it is (its
                # weight decay included), as any torch optimizer leaves a parameter without one.
                if param.requires_grad:
                    param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)
            self._outer_state_to_device(indices)
            self.outer.step()
            self._outer_state_offload(indices)
            foreach_copy_(global_copies, params, non_blocking=True)
            if alpha:
                for param, kept in zip(params, local, strict=True):
                    param.lerp_(kept, alpha)
            for param in params:
                param.grad = None
            for param, kept_grad in zip(others, kept_grads, strict=True):
                param.grad = kept_grad
        self._note_offload_copies()

    def _outer_state_to_device(self, indices: list[int]) -> None:
        if not self.offload_global:
            return
        for j in indices:
            param = self._params[j]
            state = self.outer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != param.device:
                    state[key] = value.to(param.device, non_blocking=True)

    def _outer_state_offload(self, indices: list[int]) -> None:
        if not self.offload_global:
            return
        for j in indices:
            param = self._params[j]
            if param.device.type == "cpu":
                continue
            state = self.outer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device == param.device:
                    state[key] = _pinned_like(value, non_blocking=True)

    def _note_offload_copies(self) -> None:
        """Offloaded on an accelerator: mark the copies queued so far (g and the outer state are pinned)."""
        device = self._params[0].device
        if self.offload_global and device.type != "cpu":
            self._offload_copies = torch.get_device_module(device).current_stream(device).record_event()

    def _wait_offload_copies(self) -> None:
        """Let the host touch g and the outer state: wait for the copies queued to or from them."""
        if self._offload_copies is not None:
            self._offload_copies.synchronize()
            self._offload_copies = None

    # -- checkpoints --------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "fragment_sync_delay": self.fragment_sync_delay,
            "compression": self.compression,
            "world_size": None if isinstance(self._exchange, QuorumExchange) else self._exchange.world,
        }

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"step"`` and ``"diloco"`` (outer state, ``g``, feedback).

        Averaging still in flight is finished first (a collective: call it on every rank).

        Example::

            >>> torch.save(opt.state_dict(), "diloco.pt")  # doctest: +SKIP
        """
        if self._quorum is not None and self._in_flight:
            raise RuntimeError(
                "state_dict: with a torchft manager a sync in flight ends only at its commit; call state_dict() "
                "at a step where no fragment sync is in flight (replicas heal from live peers without it)"
            )
        for flight in self._in_flight:
            flight.average = ReadyAverage(_finished(flight.average))
        self._wait_offload_copies()
        state = self.inner.state_dict()
        state["step"] = self.inner_steps
        state["diloco"] = {
            "config": self._config(),
            "outer": self.outer.state_dict(),
            "global": list(self._global),
            "feedback": [None if f is None else {"sent": f.sent, "chunk": f.chunk} for f in self._feedback],
            "pending": [
                {"fragment": f.fragment, "apply_step": f.apply_step, "average": _finished(f.average)}
                for f in self._in_flight
            ],
            "bytes_sent": self._exchange.bytes_sent,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; everything is checked before anything changes.

        Example::

            >>> opt.load_state_dict(torch.load("diloco.pt"))  # doctest: +SKIP
        """
        extra = self._validated(state_dict)
        self._wait_offload_copies()
        self.inner.load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        self.outer.load_state_dict(extra["outer"])
        self._outer_state_offload(list(range(len(self._params))))
        self._note_offload_copies()
        self._wait_offload_copies()
        with torch.no_grad():
            for mine, saved in zip(self._global, extra["global"], strict=True):
                mine.copy_(saved)
            for feedback, saved in zip(self._feedback, extra["feedback"], strict=True):
                if feedback is not None:
                    feedback.sent.copy_(saved["sent"])
                    feedback.chunk.copy_(saved["chunk"])
        device = self._params[0].device
        self._in_flight = [
            _InFlight(p["fragment"], p["apply_step"], p["apply_step"], ReadyAverage(p["average"].to(device)))
            for p in extra["pending"]
        ]
        self.inner_steps = state_dict["step"]
        self._exchange.bytes_sent = extra["bytes_sent"]

    def _validated(self, state_dict: Any) -> dict[str, Any]:
        """``state_dict["diloco"]`` after checking every part of ``state_dict`` against this optimizer."""
        fix = "pass what DiLoCoOptimizer.state_dict() returned"
        if not isinstance(state_dict, dict):
            got = type(state_dict).__name__
            raise TypeError(f"state_dict: expected the dict DiLoCoOptimizer.state_dict() returns, got {got}; {fix}")
        if not {"state", "param_groups", "step", "diloco"} <= state_dict.keys():
            raise ValueError(f"state_dict: expected keys 'state', 'param_groups', 'step', 'diloco'; {fix}")
        step = state_dict["step"]
        non_negative_int("state_dict['step']", step, fix)
        extra = state_dict["diloco"]
        keys = {"config", "outer", "global", "feedback", "pending", "bytes_sent"}
        if not isinstance(extra, dict) or not keys <= extra.keys():
            raise ValueError(f"state_dict['diloco']: expected keys {sorted(keys)}; {fix}")
        for key, value in self._config().items():
            saved = extra["config"].get(key)
            if saved != value:
                raise ValueError(
                    f"state_dict['diloco']['config']['{key}']: the checkpoint has {saved!r}, this optimizer "
                    f"{value!r}; build the DiLoCoOptimizer with {key}={saved!r} to resume it"
                )
        non_negative_int("state_dict['diloco']['bytes_sent']", extra["bytes_sent"], fix)
        self._check_groups("state_dict", self.inner, state_dict)
        self._check_groups("state_dict['diloco']['outer']", self.outer, extra["outer"])
        self._check_tensors("global", extra["global"], [(p.shape, p.dtype) for p in self._params])
        expected_feedback = [
            None if f is None else [(f.sent.shape, f.sent.dtype), (f.chunk.shape, f.chunk.dtype)]
            for f in self._feedback
        ]
        saved_feedback = extra["feedback"]
        if not isinstance(saved_feedback, list) or len(saved_feedback) != len(expected_feedback):
            raise ValueError(f"state_dict['diloco']['feedback']: expected a list of {len(expected_feedback)}; {fix}")
        for i, (saved, expected) in enumerate(zip(saved_feedback, expected_feedback, strict=True)):
            if expected is None:
                if saved is not None:
                    raise ValueError(f"state_dict['diloco']['feedback'][{i}]: expected None without compression; {fix}")
                continue
            if not isinstance(saved, dict):
                raise ValueError(f"state_dict['diloco']['feedback'][{i}]: expected a dict of 'sent' and 'chunk'; {fix}")
            self._check_tensors(f"feedback'][{i}", [saved.get("sent"), saved.get("chunk")], expected)
        self._check_pending(extra["pending"], step)
        return extra

    @staticmethod
    def _check_groups(name: str, optimizer: torch.optim.Optimizer, saved: Any) -> None:
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list) or "state" not in saved:
            raise ValueError(f"{name}: expected an optimizer state dict with 'state' and 'param_groups'")
        lengths = [len(g["params"]) for g in optimizer.param_groups]
        saved_lengths = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
        if lengths != saved_lengths:
            raise ValueError(
                f"{name}['param_groups']: parameters per group {saved_lengths} do not match this optimizer's "
                f"{lengths}; load a checkpoint of the same model and optimizers"
            )

    @staticmethod
    def _check_tensors(name: str, saved: Any, expected: list[tuple[torch.Size, torch.dtype]]) -> None:
        where = f"state_dict['diloco']['{name}']"
        if not isinstance(saved, list) or len(saved) != len(expected):
            raise ValueError(f"{where}: expected a list of {len(expected)} tensors; load a checkpoint of this model")
        for i, (tensor, (shape, dtype)) in enumerate(zip(saved, expected, strict=True)):
            if not isinstance(tensor, torch.Tensor) or tensor.shape != shape or tensor.dtype != dtype:
                got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else repr(tensor)
                raise ValueError(
                    f"{where}[{i}]: expected a tensor of shape {tuple(shape)} and dtype {dtype}, got {got}; "
                    "load a checkpoint of this model and settings"
                )

    def _check_pending(self, pending: Any, step: int) -> None:
        where = "state_dict['diloco']['pending']"
        if not isinstance(pending, list):
            raise ValueError(f"{where}: expected a list; pass what DiLoCoOptimizer.state_dict() returned")
        seen: set[int] = set()
        for entry in pending:
            fragment = entry.get("fragment") if isinstance(entry, dict) else None
            if not isinstance(fragment, int) or not 0 <= fragment < self.fragments or fragment in seen:
                raise ValueError(f"{where}: bad or repeated fragment {fragment!r}; expected 0 to {self.fragments - 1}")
            seen.add(fragment)
            apply_step = entry.get("apply_step")
            if not isinstance(apply_step, int) or not step < apply_step <= step + self.fragment_sync_delay:
                raise ValueError(
                    f"{where}: fragment {fragment} applies at step {apply_step!r}, outside "
                    f"({step}, {step + self.fragment_sync_delay}]; the checkpoint does not match these settings"
                )
            numel = sum(self._params[j].numel() for j in self._fragments[fragment])
            average = entry.get("average")
            if not isinstance(average, torch.Tensor) or not average.is_floating_point() or average.shape != (numel,):
                raise ValueError(f"{where}: fragment {fragment} needs a 1-D floating tensor of {numel} values")
