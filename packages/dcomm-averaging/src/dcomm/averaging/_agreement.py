"""That every rank of a group passes alike parameters, checked in one small collective per new parameter list.

:func:`dcomm.averaging.average_parameters` is a collective: every rank of the group must make the
same allreduces. A rank that passes other parameters (fewer, other sizes, dtypes or devices), a
parameter that cannot be averaged, or another ``bucket_cap_mb`` would leave its peers waiting in
an allreduce until the process group times out. So the first time a group sees a call's
:class:`CallSignature`, every rank gathers every rank's signature and the problem it found, if
any (:func:`agree`): where one differs, every rank raises the same error naming the rank. A
signature agreed once is kept per group (:class:`AgreedSignatures`), and later calls with it
cost nothing.

Example::

    >>> one = CallSignature(8.0, ((3, "torch.float32", "cpu"),), ())
    >>> disagreement([(None, one), (None, CallSignature(8.0, (), ()))])[1][:60]
    'params: rank 1 passed 0 parameters where rank 0 passed 1 par'
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dcomm.core import gather_objects

__all__ = ["AgreedSignatures", "CallSignature", "Problem", "agree", "disagreement"]

KEPT = 64
"""At most this many agreed signatures are kept per group, the least recently used dropped first."""

_FIX = (
    "pass the same parameters, in the same order and memory layout, and the same bucket_cap_mb on every "
    "rank of the group (an averager passes the parameters that have a gradient: every rank must compute "
    "the same ones)"
)


class CallSignature:
    """What every rank of a group must pass alike: the bucket cap, each parameter's size, dtype and
    device type, and what the call does with them (``layout``: per device, the computation dtype,
    the in-place tensors' and the buckets' element counts: the collectives it makes).

    Hashed once: every call looks its signature up among the agreed ones.
    """

    __slots__ = ("_hash", "cap_bytes", "layout", "params")

    def __init__(self, cap_bytes: float, params: tuple[tuple[int, str, str], ...], layout: tuple[Any, ...]) -> None:
        self.cap_bytes = cap_bytes
        self.params = params
        self.layout = layout
        self._hash = hash((cap_bytes, params, layout))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, CallSignature) or self._hash != other._hash:
            return False
        return (self.cap_bytes, self.params, self.layout) == (other.cap_bytes, other.params, other.layout)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CallSignature, (self.cap_bytes, self.params, self.layout))


class Problem(NamedTuple):
    """A parameter or argument this rank cannot average: the exception's type name and its message."""

    kind: str
    message: str


_KINDS: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}


def _count(n: int) -> str:
    return f"{n} parameter" + ("" if n == 1 else "s")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _difference(odd: CallSignature, reference: CallSignature) -> tuple[str, str]:
    """What the odd rank passed and what the reference ranks passed, at their first difference."""
    if odd.cap_bytes != reference.cap_bytes:
        return f"bucket_cap_mb={odd.cap_bytes / 2**20:g}", f"bucket_cap_mb={reference.cap_bytes / 2**20:g}"
    if len(odd.params) != len(reference.params):
        return _count(len(odd.params)), _count(len(reference.params))
    for index, (mine, theirs) in enumerate(zip(odd.params, reference.params, strict=True)):
        if mine != theirs:
            return (
                f"parameter {index} as {mine[0]} {mine[1]} elements on {mine[2]}",
                f"{theirs[0]} {theirs[1]} elements on {theirs[2]}",
            )
    return (
        "the same sizes and dtypes laid out differently in memory (views of one buffer, as "
        "flatten_parameters makes them, on some ranks only)",
        "another layout",
    )


def disagreement(gathered: list[tuple[Problem | None, CallSignature | None]]) -> tuple[type[Exception], str] | None:
    """The error every rank raises for the gathered ``(problem, signature)`` of each rank, or None if they agree.

    A problem found on some rank wins (the lowest such rank's). Otherwise the signature most
    ranks passed (on a tie, the lowest rank's) is the reference, and the message names the first
    rank that differs from it and what differs. Computed from the same list on every rank, so
    every rank raises the same message.

    Args:
        gathered: per rank of the group, in rank order, its problem (or None) and its signature.

    Returns:
        ``(exception type, message)``, or None when every rank passed the same and none found a problem.

    Example::

        >>> same = (None, CallSignature(8.0, (), ()))
        >>> disagreement([same, same]) is None
        True
    """
    problems = [(rank, problem) for rank, (problem, _) in enumerate(gathered) if problem is not None]
    if problems:
        first = problems[0][1]
        where = _ranks([rank for rank, problem in problems if problem == first])
        return _KINDS.get(
            first.kind, ValueError
        ), f"{first.message} (found on {where}; every rank of the group raises this error)"
    signatures = [signature for _, signature in gathered]
    counts = collections.Counter(signatures)
    reference = max(signatures, key=lambda s: (counts[s], -signatures.index(s)))
    odd = [rank for rank, signature in enumerate(signatures) if signature != reference]
    if not odd:
        return None
    agreeing = [rank for rank, signature in enumerate(signatures) if signature == reference]
    odd_signature, reference_signature = signatures[odd[0]], reference
    assert odd_signature is not None
    assert reference_signature is not None
    mine, theirs = _difference(odd_signature, reference_signature)
    others = f" (ranks {odd} differ from ranks {agreeing})" if len(odd) > 1 else ""
    return ValueError, f"params: rank {odd[0]} passed {mine} where {_ranks(agreeing)} passed {theirs}{others}; {_FIX}"


def agree(
    group: dist.ProcessGroup, problem: Problem | None, signature: CallSignature | None, device: torch.device | None
) -> None:
    """Gather every rank's ``(problem, signature)`` in one collective; raise on every rank if they differ.

    Args:
        group: the call's process group (this rank is a member).
        problem: what this rank cannot average, or None.
        signature: this rank's call signature (None where ``problem`` is set).
        device: the device of this rank's parameters, which the gather goes through (see
            :func:`dcomm.core.gather_objects`).

    Raises:
        ValueError: a rank found a problem with a parameter, or the ranks passed different
            parameters (the message names the rank); the same on every rank.
        TypeError: a rank passed an argument of the wrong type (e.g. ``bucket_cap_mb``).

    Example::

        >>> agree(dist.group.WORLD, None, signature, params[0].device)  # every rank calls it  # doctest: +SKIP
    """
    found = disagreement(gather_objects((problem, signature), group, device))
    if found is not None:
        kind, message = found
        raise kind(message)


class AgreedSignatures:
    """The signatures a group's ranks agreed on, per process group (gone with it), most recent last.

    Example::

        >>> agreed = AgreedSignatures()
        >>> agreed.contains(dist.group.WORLD, signature)  # doctest: +SKIP
        False
    """

    def __init__(self) -> None:
        self._by_group: weakref.WeakKeyDictionary[dist.ProcessGroup, collections.OrderedDict[CallSignature, None]]
        self._by_group = weakref.WeakKeyDictionary()

    def contains(self, group: dist.ProcessGroup, signature: CallSignature) -> bool:
        """Whether ``group``'s ranks agreed on ``signature`` (marked most recent if so)."""
        kept = self._by_group.get(group)
        if kept is None or signature not in kept:
            return False
        kept.move_to_end(signature)
        return True

    def add(self, group: dist.ProcessGroup, signature: CallSignature) -> None:
        """Keep ``signature`` as agreed by ``group``'s ranks, within :data:`KEPT` per group."""
        kept = self._by_group.setdefault(group, collections.OrderedDict())
        kept[signature] = None
        while len(kept) > KEPT:
            kept.popitem(last=False)
