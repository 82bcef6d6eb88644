"""dcomm.core.environment: the switches' one rule and the one-variable override."""

from __future__ import annotations

import os

import pytest

from dcomm.core.environment import switched_on, variable_set

NAME = "DCOMM_TEST_ENVIRONMENT_VARIABLE"


@pytest.mark.parametrize(
    ("value", "on"),
    [("0", False), (" Off ", False), ("no", False), ("FALSE", False), ("1", True), ("yes", True), ("", True)],
)
def test_switched_on_reads_the_off_words(value: str, on: bool) -> None:
    with variable_set(NAME, value):
        assert switched_on(NAME, default=not on) is on


def test_variable_set_restores_a_previous_value_and_touches_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "before")
    others = {k: v for k, v in os.environ.items() if k != NAME}
    with variable_set(NAME, "inside"):
        assert os.environ[NAME] == "inside"
    assert os.environ[NAME] == "before"
    assert {k: v for k, v in os.environ.items() if k != NAME} == others


def test_variable_set_removes_a_variable_it_created_even_on_error() -> None:
    assert NAME not in os.environ
    with pytest.raises(KeyError), variable_set(NAME, "1"):
        raise KeyError("inside")
    assert NAME not in os.environ
