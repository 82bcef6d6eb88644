"""dcomm_testing: the helpers shared by dcomm's test suites (not shipped in any runtime wheel).

Example::

    >>> from dcomm_testing import run_ranks
    >>> run_ranks(worker, 2)  # doctest: +SKIP
"""

from dcomm_testing.helpers import (
    BucketStub,
    LogMessages,
    assert_close,
    assert_same_on_ranks,
    assert_updates_close,
    captured_log,
    cpu_record_stream_is_noop,
    device_synchronize_forbidden,
    rank_groups,
    recorded_calls,
    seeded_batch,
    seeded_normal,
    seeded_pair,
    spread_normal,
)
from dcomm_testing.implementations import IMPLEMENTATIONS, implementation
from dcomm_testing.models import BackwardOrderedMLP, flat_parameters, rank_device, seeded_mlp
from dcomm_testing.quantization_bounds import block_scales, quantization_half_step
from dcomm_testing.ranks import RankFailure, rank_process_context, run_ranks
from dcomm_testing.training import DDPRun, PostLocalSGDRun, train_ddp, train_sgd

__all__ = [
    "BackwardOrderedMLP",
    "BucketStub",
    "DDPRun",
    "PostLocalSGDRun",
    "IMPLEMENTATIONS",
    "LogMessages",
    "RankFailure",
    "assert_close",
    "assert_same_on_ranks",
    "assert_updates_close",
    "block_scales",
    "captured_log",
    "cpu_record_stream_is_noop",
    "device_synchronize_forbidden",
    "flat_parameters",
    "implementation",
    "quantization_half_step",
    "rank_device",
    "rank_groups",
    "rank_process_context",
    "recorded_calls",
    "run_ranks",
    "seeded_batch",
    "seeded_mlp",
    "seeded_normal",
    "seeded_pair",
    "spread_normal",
    "train_ddp",
    "train_sgd",
]
