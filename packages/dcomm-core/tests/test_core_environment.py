"""dcomm.core.environment: the one-variable override."""

from __future__ import annotations

import os

import pytest

from dcomm.core.environment import variable_set

NAME = "DCOMM_TEST_ENVIRONMENT_VARIABLE"


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
