"""The benchmark cases, one module per algorithm family, each a builder ``ctx -> Case``.

``TRAINING_CASES`` run on every workload and precision; ``averaging`` and ``diloco`` (fp32) run
once per workload (their bytes do not depend on the precision) and ``hook-latency`` once per run.

Example::

    >>> sorted(CASES)
    ['averaging', 'compression', 'ddp', 'diloco', 'fsdp', 'fully_shard', 'hook-latency', 'post-local-sgd', 'zero']
"""

from __future__ import annotations

from collections.abc import Callable

from tools.bench.ab import Case
from tools.bench.cases.averaging import averaging_case
from tools.bench.cases.common import Context
from tools.bench.cases.compression import compression_case
from tools.bench.cases.ddp import ddp_case
from tools.bench.cases.diloco import diloco_case
from tools.bench.cases.fsdp import fsdp_case
from tools.bench.cases.fully_shard import fully_shard_case
from tools.bench.cases.hook_latency import hook_latency_case
from tools.bench.cases.post_local_sgd import post_local_sgd_case
from tools.bench.cases.zero import zero_case

__all__ = ["CASES", "PER_RUN_CASES", "PER_WORKLOAD_CASES", "TRAINING_CASES", "Context"]

CASES: dict[str, Callable[[Context], Case]] = {
    "averaging": averaging_case,
    "ddp": ddp_case,
    "compression": compression_case,
    "post-local-sgd": post_local_sgd_case,
    "diloco": diloco_case,
    "zero": zero_case,
    "fsdp": fsdp_case,
    "fully_shard": fully_shard_case,
    "hook-latency": hook_latency_case,
}
TRAINING_CASES = ("ddp", "compression", "post-local-sgd", "zero", "fsdp", "fully_shard")
PER_WORKLOAD_CASES = ("averaging", "diloco")
PER_RUN_CASES = ("hook-latency",)
