"""The shared validators: TypeError for a wrong type, ValueError for a wrong value, one message form."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dcomm.core.validation import even_int, non_negative_number, positive_number, process_group_or_none


@pytest.mark.parametrize(
    ("value", "error"),
    [(3, ValueError), (0, ValueError), (-2, ValueError), (True, TypeError), (4.0, TypeError), ("4", TypeError)],
)
def test_even_int_refuses(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^block_size: expected an even int >= 2, got {value!r}; the default is 256$"):
        even_int("block_size", value, 2, "the default is 256")


def test_even_int_accepts() -> None:
    assert [even_int("block_size", v, 2, "") for v in (2, 4, 256)] == [2, 4, 256]


@pytest.mark.parametrize(
    ("check", "value", "error", "expected"),
    [
        (non_negative_number, -1e-9, ValueError, "a non-negative number"),
        (non_negative_number, float("nan"), ValueError, "a non-negative number"),
        (non_negative_number, False, TypeError, "a non-negative number"),
        (positive_number, 0, ValueError, "a positive number"),
        (positive_number, "1", TypeError, "a positive number"),
    ],
)
def test_numbers_refuse(check: object, value: object, error: type[Exception], expected: str) -> None:
    with pytest.raises(error, match=rf"^eps: expected {expected}, got .*; pass e\.g\. 1e-8$"):
        check("eps", value, "pass e.g. 1e-8")  # type: ignore[operator]


def test_numbers_accept() -> None:
    assert non_negative_number("eps", 0, "") == 0.0
    assert isinstance(non_negative_number("eps", 0, ""), float)
    assert positive_number("eps", 2, "") == 2.0


@pytest.mark.parametrize(("value", "got"), [(3, "int"), ("WORLD", "str"), ([0, 1], "list")])
def test_process_group_refuses_other_types(value: object, got: str) -> None:
    with pytest.raises(TypeError, match=rf"^subgroup: expected a ProcessGroup or None, got {got}; pass None$"):
        process_group_or_none("subgroup", value, "pass None")


def test_process_group_refuses_non_member_and_accepts_none() -> None:
    with pytest.raises(ValueError, match=r"^process_group: this rank is not a member .*NON_GROUP_MEMBER.*; pass None$"):
        process_group_or_none("process_group", dist.GroupMember.NON_GROUP_MEMBER, "pass None")
    assert process_group_or_none("process_group", None, "") is None
