"""dcomm.core logging: rank 0 only, fallback warnings once."""

import logging
import warnings

import pytest

from dcomm.core import get_logger, warn_once
from dcomm_testing import run_ranks


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _logs(rank: int, world: int) -> tuple[list[str], int]:
    logger = get_logger("dcomm.test_core_log")
    assert get_logger("dcomm.test_core_log") is logger
    assert len(logger.filters) == 1  # the rank filter is added once
    logger.setLevel(logging.INFO)
    handler = Collect()
    logger.addHandler(handler)
    logger.info("starts after %d iterations", 10)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = warn_once(("fallback", "float32"), "slow path")
        second = warn_once(("fallback", "float32"), "slow path")
        other = warn_once(("fallback", "float16"), "another slow path")
    assert not second
    assert first == other == (rank == 0)
    return handler.messages, len(rec)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_rank_zero_only(world: int) -> None:
    results = run_ranks(_logs, world, timeout=200)
    assert results[0] == (["starts after 10 iterations"], 2)
    for rank in range(1, world):
        assert results[rank] == ([], 0)


def test_without_a_process_group_every_message_passes() -> None:
    logger = get_logger("dcomm.test_core_log.single")
    logger.setLevel(logging.INFO)
    handler = Collect()
    logger.addHandler(handler)
    logger.info("hello")
    assert handler.messages == ["hello"]
    with pytest.warns(UserWarning, match="single-process slow path"):
        assert warn_once(("single", 1), "single-process slow path")
