"""Syncs that survive failures: averaging over the replicas of a torchft quorum, retried until committed.

torchft (``pip install 'dcomm-averaging[ft]'``) runs one ``Manager`` per replica group. Its
lighthouse decides which replicas take part in each sync (a *quorum*), its process group is
rebuilt for every new quorum, and a replica that joins or restarts *heals*: it loads the state
of a live peer that the peer registered with the manager. Here a sync over a quorum is:

1. :meth:`ReplicaQuorum.join` takes a quorum (synchronous; it may heal this replica, which then
   contributes nothing to this sync and only takes its result);
2. :class:`QuorumExchange` sums the contributions over the quorum and divides by the number of
   replicas that contributed (an fp32 ``SUM`` and a division, or the compressed two-stage average);
3. :meth:`ReplicaQuorum.commit` asks every replica whether the sync succeeded everywhere.

When a replica dies during a sync, the commit fails; the survivors have changed nothing yet, so
they join the next quorum and send the *same* input again. Nothing is lost or repeated: the
result is the average over the survivors, as if the dead replica had left before that sync.

The few private members of torchft that this relies on are read here and nowhere else:
``Manager._use_async_quorum``, ``Manager._pg``, ``Manager._quorum_timeout`` and
``Manager._min_replica_size``.

Example::

    >>> quorum = ReplicaQuorum(manager, "DiLoCoOptimizer", state_dict, load_state_dict)  # doctest: +SKIP
    >>> healed = quorum.join()  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dcomm.averaging._diloco.exchange import Feedback, PseudoGradientExchange
from dcomm.core.quantized_average import chunk_numel

__all__ = [
    "QuorumAverage",
    "QuorumExchange",
    "QuorumParameterAveraging",
    "ReplicaQuorum",
    "require_torchft_manager",
]

INSTALL_HINT = "pip install 'dcomm-averaging[ft]'"
FAILURES = (RuntimeError, OSError)
"""What a collective raises when a peer dies or the group is rebuilt (torch's DistBackendError is a
RuntimeError, a timeout an OSError); anything else is a bug and is not swallowed."""


def require_torchft_manager(manager: Any, owner: str) -> Any:
    """``manager``, checked to be a ``torchft.Manager`` with a synchronous quorum.

    Raises:
        ImportError: torchft is not installed (the message names the ``ft`` extra).
        TypeError: ``manager`` is not a ``torchft.Manager``.
        ValueError: the manager takes its quorum asynchronously.

    Example::

        >>> require_torchft_manager(manager, "DiLoCoOptimizer")  # doctest: +SKIP
    """
    try:
        from torchft import Manager
    except ImportError as error:
        raise ImportError(
            f"manager: {owner}(manager=...) needs torchft, which is not installed; install it with {INSTALL_HINT}"
        ) from error
    if not isinstance(manager, Manager):
        raise TypeError(f"manager: expected a torchft.Manager, got {type(manager).__name__}")
    if getattr(manager, "_use_async_quorum", True):
        raise ValueError(
            f"manager: {owner} needs a synchronous quorum (a healed replica must load its state before it "
            "steps); build the Manager with use_async_quorum=False"
        )
    return manager


class ReplicaQuorum:
    """This replica's side of a torchft ``Manager``: join a quorum, commit a sync, heal from a peer.

    ``state_dict`` and ``load_state_dict`` are registered with the manager under ``key``: a peer
    that heals from this replica receives ``state_dict()`` (called while this replica waits in
    :meth:`join`), and when this replica heals, :meth:`join` calls ``load_state_dict`` with a
    peer's state and returns True.

    Example::

        >>> quorum = ReplicaQuorum(manager, "PeriodicModelAverager", state, load_state)  # doctest: +SKIP
        >>> if not quorum.join():  # doctest: +SKIP
        ...     ...  # contribute to this sync
    """

    def __init__(
        self,
        manager: Any,
        key: str,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        self.manager = require_torchft_manager(manager, key)
        self.key = key
        self._load_state_dict = load_state_dict
        self._healed = False
        self._failing_since: float | None = None
        self.device = torch.device("cpu")  # of the tensors averaged (check_device sets it)
        self.manager.register_state_dict_fn(key, self._load, state_dict)

    def _load(self, state: dict[str, Any]) -> None:
        self._healed = True
        self._load_state_dict(state)

    @property
    def group(self) -> Any:
        """The manager's process group, configured for the current quorum."""
        return self.manager._pg

    @property
    def world(self) -> int:
        """Replicas in the current quorum (those healing in it included)."""
        return self.manager.num_participants()

    def min_replica_size(self) -> int:
        """The manager's ``min_replica_size``."""
        return int(self.manager._min_replica_size)

    def check_device(self, device: torch.device) -> None:
        """Average on ``device`` from now on; a ``ValueError`` if the manager's group cannot reduce there.

        Example::

            >>> quorum.check_device(torch.device("cpu"))  # doctest: +SKIP
        """
        backend = str(self.group.getBackendName())
        if "nccl" in backend.lower() and device.type == "cpu":
            raise ValueError(
                f"manager: its process group is {backend}, which cannot average the model's tensors on {device}; "
                "build the Manager with torchft.ProcessGroupGloo() for a CPU model, or move the model to the GPU"
            )
        self.device = device

    def join(self) -> bool:
        """Take part in the next quorum (blocks until the lighthouse forms it); True if this replica healed.

        Raises:
            TimeoutError: no quorum formed within the manager's ``quorum_timeout``.

        Example::

            >>> healed = quorum.join()  # doctest: +SKIP
        """
        self._healed = False
        try:
            self.manager.start_quorum()
        except FAILURES as error:
            raise TimeoutError(
                f"manager: no quorum formed ({error}); the lighthouse needs its min_replicas and the manager "
                f"min_replica_size={self.min_replica_size()} replicas: start them, or lower min_replica_size"
            ) from error
        return self._healed

    def barrier(self) -> None:
        """Wait until every replica of the quorum is here: healing replicas have loaded their state.

        A peer serves its state to healing replicas until its next commit; a sync's averaging holds
        its commit back until they have it, and this does the same for a quorum that averages nothing.
        A failure is reported to the manager (the commit then fails).

        Example::

            >>> quorum.barrier()  # doctest: +SKIP
        """
        if self.failed():
            return  # its group may not be configured: the commit fails, and the quorum is retried
        try:
            one = torch.ones(1, device=self.device)
            work = dist.all_reduce(one, group=self.group, async_op=True)
            assert work is not None
            work.wait()
        except FAILURES as error:
            self.report(error)

    def failed(self) -> bool:
        """Whether this quorum already failed (torchft reports a failed group setup instead of raising)."""
        return self.manager.errored() is not None

    def commit(self) -> bool:
        """Whether the sync since :meth:`join` succeeded on every replica (call it once per join).

        Raises:
            TimeoutError: no sync has committed for the manager's ``quorum_timeout``, e.g. because
                fewer than ``min_replica_size`` replicas keep arriving.

        Example::

            >>> if quorum.commit():  # doctest: +SKIP
            ...     apply(average)
        """
        committed = bool(self.manager.should_commit())
        now = time.monotonic()
        if committed:
            self._failing_since = None
            return True
        if self._failing_since is None:
            self._failing_since = now
        limit: timedelta = self.manager._quorum_timeout
        if now - self._failing_since > limit.total_seconds():
            raise TimeoutError(
                f"manager: no sync committed for {limit.total_seconds():.0f} s; the last quorum had {self.world} "
                f"replicas and min_replica_size={self.min_replica_size()}; start more replicas or lower "
                "min_replica_size"
            )
        return False

    def report(self, error: Exception) -> None:
        """Mark this sync failed: the next :meth:`commit` returns False on every replica."""
        self.manager.report_error(error)


class QuorumAverage:
    """One average over a quorum in flight: ``advance()`` moves it on, ``result()`` ends it (None: failed).

    A failure (a peer died, the group was rebuilt) is reported to the manager, so the commit fails
    everywhere. :meth:`undo` puts back the error feedback this attempt changed, before a retry.
    """

    def __init__(self, exchange: QuorumExchange, flat: torch.Tensor, feedback: Feedback | None, contributes: bool):
        self._exchange = exchange
        self._quorum = exchange.quorum
        self._feedback = feedback
        self._saved = None if feedback is None else (feedback.sent.clone(), feedback.chunk.clone())
        self._result: torch.Tensor | None = None
        self._failed = False
        group = self._quorum.group
        self._world = self._quorum.world
        if not contributes:
            flat.zero_()
            if feedback is not None:
                feedback.sent.zero_()
        # How many replicas contribute (a replica healing in this quorum sends zeros).
        self._count = torch.full((1,), float(contributes), dtype=flat.dtype, device=flat.device)
        if self._quorum.failed():
            self._failed = True  # no collective on a group that may not be configured; the commit fails
            return
        try:
            self._count_work = dist.all_reduce(self._count, group=group, async_op=True)
            if exchange.compression is None:
                self._flat = flat
                self._work = dist.all_reduce(flat, group=group, async_op=True)
                exchange.bytes_sent += 2 * (self._world - 1) * flat.numel() * flat.element_size() // self._world
            else:
                inner = PseudoGradientExchange(group.parent, exchange.compression)
                self._pending = inner.start(flat, feedback)
                exchange.bytes_sent += inner.bytes_sent
        except FAILURES as error:  # the group broke while starting: this attempt fails
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        self._failed = True
        self._quorum.report(error)

    def advance(self) -> None:
        """Compressed: start the second stage once the first is done. Else nothing."""
        if self._failed or self._exchange.compression is None:
            return
        try:
            self._pending.advance()
        except FAILURES as error:
            self._fail(error)

    def result(self) -> torch.Tensor | None:
        """The average over the replicas that contributed, or None if this attempt failed."""
        if self._failed or self._result is not None:
            return self._result
        try:
            assert self._count_work is not None
            self._count_work.wait()
            if self._exchange.compression is None:
                self._work.wait()
                average = self._flat
                summed = True
            else:
                average = self._pending.result()  # already divided by the quorum size
                summed = False
        except FAILURES as error:
            self._fail(error)
            return None
        count = int(self._count.item())
        if count == 0:
            self._fail(RuntimeError("no replica of the quorum contributed to this sync"))
            return None
        if summed:
            average.div_(count)
        elif count != self._world:
            average.mul_(self._world).div_(count)
        self._result = average
        return average

    def undo(self) -> None:
        """Put the error feedback back as it was before this attempt (for a retry)."""
        if self._feedback is not None and self._saved is not None:
            self._feedback.sent.copy_(self._saved[0])
            self._feedback.chunk = self._saved[1]


class QuorumExchange:
    """Averages flat pseudo-gradients over the replicas of the current quorum that contribute.

    The same face as :class:`dcomm.averaging._diloco.exchange.PseudoGradientExchange`, for a
    group whose size changes with every quorum: a compressed fragment's per-rank error memory is
    reset when its size changes (the chunks of the new group are other slices of the vector).

    Example::

        >>> exchange = QuorumExchange(quorum, None)  # doctest: +SKIP
        >>> average = exchange.start(flat, None).result()  # doctest: +SKIP
    """

    def __init__(self, quorum: ReplicaQuorum, compression: str | None) -> None:
        self.quorum = quorum
        self.compression = compression
        self.bytes_sent = 0

    def new_feedback(self, numel: int, device: torch.device) -> Feedback | None:
        """Zero error feedback for ``numel`` values (None without compression); sized at each start."""
        if self.compression is None:
            return None
        return Feedback(torch.zeros(numel, dtype=torch.float32, device=device), torch.zeros(0, device=device))

    def start(self, flat: torch.Tensor, feedback: Feedback | None, contributes: bool = True) -> QuorumAverage:
        """Start averaging ``flat`` (consumed) over the quorum; ``contributes=False`` sends zeros."""
        if feedback is not None:
            size = chunk_numel(flat.numel(), max(self.quorum.world, 1))
            if feedback.chunk.numel() != size:
                feedback.chunk = torch.zeros(size, dtype=torch.float32, device=flat.device)
        return QuorumAverage(self, flat, feedback, contributes)


class QuorumParameterAveraging:
    """The averaging of ``PeriodicModelAverager(manager=...)``: local SGD over a torchft quorum.

    At its first call, and at every call the averager's schedule makes an averaging one, the
    replica joins a quorum; an averaging call sums the parameters over the replicas that contribute
    and divides by their number, and copies the average into them only once the sync commits
    (otherwise the parameters are untouched and the sync is retried with the next quorum). A
    replica that heals takes a peer's step counter, sends zeros and takes the average. The
    parameters travel as one flat copy (fp64 if one is fp64, else fp32): the price of a retry.

    Example::

        >>> averaging = QuorumParameterAveraging(manager, averager)  # doctest: +SKIP
        >>> averaging.average(list(model.parameters()))  # doctest: +SKIP
    """

    def __init__(self, manager: Any, averager: Any) -> None:
        self._averager = averager  # has .step and .averages_at(step)
        self._averaging = False  # whether the quorum being joined averages (a healing peer learns it)
        self._joined = False
        self.quorum = ReplicaQuorum(manager, "PeriodicModelAverager", self._state, self._load)
        self._exchange = QuorumExchange(self.quorum, None)

    def _state(self) -> dict[str, Any]:
        return {"step": self._averager.step, "averaging": self._averaging}

    def _load(self, state: dict[str, Any]) -> None:
        self._averager.step = state["step"]
        self._averaging = state["averaging"]

    def average(self, params: list[torch.Tensor]) -> None:
        """Average ``params`` over the quorum if the averager's step is due (see the class docstring)."""
        self._averaging = self._averager.averages_at(self._averager.step)
        if self._joined and not self._averaging:
            return
        if params:
            self.quorum.check_device(params[0].device)
        self._joined = True
        contributes = True
        while True:
            if self.quorum.join():
                contributes = False
            if not self._averaging or not params:
                self.quorum.barrier()
                if self.quorum.commit():
                    return
                continue
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in params])
            average = self._exchange.start(flat, None, contributes).result()
            if self.quorum.commit():
                assert average is not None
                with torch.no_grad():
                    offset = 0
                    for param in params:
                        param.copy_(average[offset : offset + param.numel()].view_as(param))
                        offset += param.numel()
                return
