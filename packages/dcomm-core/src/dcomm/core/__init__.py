"""dcomm.core: communication state, divide factors, collectives, block quantization, group helpers.

Example::

    >>> from dcomm.core import DefaultState, divide_factors
    >>> divide_factors(4)
    (2.0, 2.0)
"""

from dcomm.core.__about__ import __version__
from dcomm.core.average_plan import AveragePlan, average_sync, plan_average
from dcomm.core.collectives import (
    all_gather_single,
    allreduce_future,
    allreduce_options,
    completed_future,
    gather_objects,
    group_size,
    member_size,
    rank_device,
    reduce_scatter_future,
    reduce_scatter_single,
    reduced_by_nccl,
    resolve_group,
    start_all_gather,
    start_allreduce,
    start_reduce_scatter,
)
from dcomm.core.divide_factors import divide_factors
from dcomm.core.groups import host_identity, intra_node_subgroups, node_layout, subgroups_of_size
from dcomm.core.log import get_logger, warn_once
from dcomm.core.low_precision import (
    LOW_PRECISION_DTYPES,
    cast_for_communication,
    copy_back,
    divide_into,
    keep_until_stream_done,
)
from dcomm.core.quantization import (
    QUANTIZED_FORMATS,
    dequantize,
    payload_bytes,
    quantize,
)
from dcomm.core.quantized_average import QuantizedAverage, quantized_average_bytes
from dcomm.core.state import DefaultState, LowPrecisionState
from dcomm.core.torch_private import foreach_copy_, foreach_div_, foreach_sub_, views_like

__all__ = [
    "allreduce_options",
    "LOW_PRECISION_DTYPES",
    "AveragePlan",
    "DefaultState",
    "LowPrecisionState",
    "QUANTIZED_FORMATS",
    "QuantizedAverage",
    "__version__",
    "all_gather_single",
    "completed_future",
    "gather_objects",
    "allreduce_future",
    "average_sync",
    "cast_for_communication",
    "divide_into",
    "copy_back",
    "dequantize",
    "divide_factors",
    "foreach_copy_",
    "foreach_div_",
    "foreach_sub_",
    "get_logger",
    "group_size",
    "host_identity",
    "intra_node_subgroups",
    "keep_until_stream_done",
    "member_size",
    "rank_device",
    "node_layout",
    "payload_bytes",
    "plan_average",
    "quantize",
    "quantized_average_bytes",
    "reduce_scatter_future",
    "reduce_scatter_single",
    "reduced_by_nccl",
    "resolve_group",
    "start_all_gather",
    "start_allreduce",
    "start_reduce_scatter",
    "subgroups_of_size",
    "views_like",
    "warn_once",
]
