"""dcomm.core: communication state, divide factors, collectives, block quantization and group helpers.

Example::

    >>> from dcomm.core import DefaultState, divide_factors
    >>> divide_factors(4)
    (2.0, 2.0)
"""

from dcomm.core.__about__ import __version__
from dcomm.core.collectives import (
    allreduce_future,
    group_size,
    reduce_scatter_future,
    reduced_by_nccl,
    resolve_group,
    start_allreduce,
)
from dcomm.core.divide_factors import divide_factors
from dcomm.core.groups import intra_node_subgroups, local_world_size, subgroups_of_size
from dcomm.core.log import get_logger, log_all_ranks, warn_once
from dcomm.core.low_precision import (
    LOW_PRECISION_DTYPES,
    cast_for_communication,
    copy_back,
    keep_until_stream_done,
)
from dcomm.core.quantization import (
    QUANTIZED_FORMATS,
    dequantize,
    payload_bytes,
    quantize,
)
from dcomm.core.state import DefaultState, LowPrecisionState

__all__ = [
    "LOW_PRECISION_DTYPES",
    "DefaultState",
    "LowPrecisionState",
    "QUANTIZED_FORMATS",
    "__version__",
    "allreduce_future",
    "cast_for_communication",
    "copy_back",
    "dequantize",
    "divide_factors",
    "get_logger",
    "group_size",
    "intra_node_subgroups",
    "keep_until_stream_done",
    "local_world_size",
    "log_all_ranks",
    "payload_bytes",
    "quantize",
    "reduce_scatter_future",
    "reduced_by_nccl",
    "resolve_group",
    "start_allreduce",
    "subgroups_of_size",
    "warn_once",
]
