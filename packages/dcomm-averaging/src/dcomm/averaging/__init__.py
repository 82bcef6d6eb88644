"""dcomm.averaging: drop-in, resumable model averaging with lean in-place parameter averaging, and DiLoCo.

The same names as ``torch.distributed.algorithms.model_averaging`` and
``torch.distributed.optim.PostLocalSGDOptimizer``; a migration is an import change.

Example::

    >>> from dcomm.averaging import PeriodicModelAverager, PostLocalSGDOptimizer
    >>> opt = PostLocalSGDOptimizer(local_optim, PeriodicModelAverager(period=4))  # doctest: +SKIP
"""

from dcomm.averaging.__about__ import __version__
from dcomm.averaging.averagers import ModelAverager, PeriodicModelAverager
from dcomm.averaging.diloco import DiLoCoOptimizer
from dcomm.averaging.flatten import flatten_parameters
from dcomm.averaging.hierarchical import HierarchicalModelAverager
from dcomm.averaging.parameters import (
    DEFAULT_BUCKET_CAP_MB,
    average_parameters,
    average_parameters_or_parameter_groups,
    get_params_to_average,
)
from dcomm.averaging.post_local_sgd_optimizer import PostLocalSGDOptimizer

__all__ = [
    "ModelAverager",
    "PeriodicModelAverager",
    "HierarchicalModelAverager",
    "PostLocalSGDOptimizer",
    "DiLoCoOptimizer",
    "average_parameters",
    "flatten_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
    "DEFAULT_BUCKET_CAP_MB",
    "__version__",
]
