"""dcomm_testing: the helpers shared by dcomm's test suites (not shipped in any runtime wheel).

Example::

    >>> from dcomm_testing import run_ranks
    >>> run_ranks(worker, 2)  # doctest: +SKIP
"""

from dcomm_testing.helpers import assert_close, assert_same_on_ranks, cpu_record_stream_is_noop, seeded_batch
from dcomm_testing.implementations import IMPLEMENTATIONS, implementation
from dcomm_testing.quantization_bounds import block_scales, quantization_half_step
from dcomm_testing.ranks import RankFailure, run_ranks

__all__ = [
    "IMPLEMENTATIONS",
    "RankFailure",
    "assert_close",
    "assert_same_on_ranks",
    "block_scales",
    "cpu_record_stream_is_noop",
    "implementation",
    "quantization_half_step",
    "run_ranks",
    "seeded_batch",
]
