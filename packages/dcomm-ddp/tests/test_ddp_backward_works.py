"""Completed hook futures whose collectives are waited for at the backward pass's last bucket."""

import pytest
import torch

from dcomm.ddp._backward_works import defer_to_last_bucket, wait_deferred
from dcomm_testing import BucketStub


class FakeGroup:
    """A stand-in for a process group (a key the works are kept under)."""


class FakeWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(self.name)
        return True


def test_works_are_waited_for_at_the_last_bucket_of_their_group_only() -> None:
    waited: list[str] = []
    group_a, group_b = FakeGroup(), FakeGroup()
    results = [torch.full((2,), float(i)) for i in range(4)]
    futs = [
        defer_to_last_bucket(group_a, FakeWork(waited, "a0"), BucketStub(False, 0), results[0]),
        defer_to_last_bucket(group_b, FakeWork(waited, "b0"), BucketStub(False, 0), results[1]),
        defer_to_last_bucket(group_a, FakeWork(waited, "a1"), BucketStub(False, 1), results[2]),
    ]
    assert waited == []  # nothing waits before the last bucket
    assert all(fut.done() for fut in futs)  # DDP may hold them: they are complete at once
    assert all(fut.value() is result for fut, result in zip(futs, results, strict=False))
    defer_to_last_bucket(group_a, FakeWork(waited, "a2"), BucketStub(True, 2), results[3])
    assert waited == ["a0", "a1", "a2"]  # every work of the group, in launch order
    defer_to_last_bucket(group_a, FakeWork(waited, "a3"), BucketStub(False, 0), results[3])
    assert waited == ["a0", "a1", "a2"]  # the next backward defers again
    defer_to_last_bucket(group_a, FakeWork(waited, "a4"), BucketStub(True, 1), results[3])
    assert waited[-2:] == ["a3", "a4"]
    defer_to_last_bucket(group_b, FakeWork(waited, "b1"), BucketStub(True, 1), results[3])
    assert waited[-2:] == ["b0", "b1"]


def test_buckets_out_of_order_are_waited_for_at_once_until_a_last_bucket() -> None:
    # DDP's first static_graph iteration launches every bucket with the same index and no "last"
    # one, then reads them all: from the second such call on, each call waits at once.
    waited: list[str] = []
    group = FakeGroup()
    for i in range(3):
        defer_to_last_bucket(group, FakeWork(waited, f"s{i}"), BucketStub(False, 0), torch.zeros(1))
    assert waited == ["s0", "s1", "s2"]  # nothing is left in flight after the final call
    # The next backward pass comes in order; it still waits at once until its last bucket ...
    defer_to_last_bucket(group, FakeWork(waited, "n0"), BucketStub(False, 0), torch.zeros(1))
    defer_to_last_bucket(group, FakeWork(waited, "n1"), BucketStub(True, 1), torch.zeros(1))
    assert waited[-2:] == ["n0", "n1"]
    # ... and the one after it defers again.
    defer_to_last_bucket(group, FakeWork(waited, "m0"), BucketStub(False, 0), torch.zeros(1))
    assert waited[-1] == "n1"
    defer_to_last_bucket(group, FakeWork(waited, "m1"), BucketStub(True, 1), torch.zeros(1))
    assert waited[-2:] == ["m0", "m1"]


def test_a_failed_collective_raises_at_the_last_bucket() -> None:
    class FailedWork:
        def wait(self) -> bool:
            raise RuntimeError("collective failed")

    group = FakeGroup()
    defer_to_last_bucket(group, FailedWork(), BucketStub(False, 0), torch.zeros(1))
    with pytest.raises(RuntimeError, match="collective failed"):
        defer_to_last_bucket(group, FakeWork([], "x"), BucketStub(True, 1), torch.zeros(1))


def test_a_deleted_group_takes_its_entry_with_it() -> None:
    import gc

    from dcomm.ddp._backward_works import _IN_FLIGHT

    group = FakeGroup()
    defer_to_last_bucket(group, FakeWork([], "x"), BucketStub(False, 0), torch.zeros(1))
    assert group in _IN_FLIGHT
    before = len(_IN_FLIGHT)
    del group
    gc.collect()
    assert len(_IN_FLIGHT) == before - 1


def test_a_last_bucket_handled_otherwise_waits_for_the_deferred_works() -> None:
    # The quantized hooks defer buckets replayed as CUDA graphs and average others eagerly; an
    # eager last bucket calls wait_deferred, after which the next backward pass defers again.
    waited: list[str] = []
    group, other = FakeGroup(), FakeGroup()
    defer_to_last_bucket(group, FakeWork(waited, "g0"), BucketStub(False, 0), torch.zeros(1))
    defer_to_last_bucket(other, FakeWork(waited, "o0"), BucketStub(False, 0), torch.zeros(1))
    defer_to_last_bucket(group, FakeWork(waited, "g1"), BucketStub(False, 1), torch.zeros(1))
    wait_deferred(group)  # bucket 2, the last, was averaged eagerly
    assert waited == ["g0", "g1"]
    wait_deferred(group)
    wait_deferred(FakeGroup())  # nothing deferred there: nothing to do
    assert waited == ["g0", "g1"]
    # The next backward pass starts at bucket 0 again: it follows, so it is deferred.
    defer_to_last_bucket(group, FakeWork(waited, "h0"), BucketStub(False, 0), torch.zeros(1))
    assert waited == ["g0", "g1"]
    defer_to_last_bucket(group, FakeWork(waited, "h1"), BucketStub(True, 1), torch.zeros(1))
    assert waited == ["g0", "g1", "h0", "h1"]
    defer_to_last_bucket(other, FakeWork(waited, "o1"), BucketStub(True, 1), torch.zeros(1))
    assert waited[-2:] == ["o0", "o1"]
