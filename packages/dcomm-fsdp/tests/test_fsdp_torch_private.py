"""Every private torch member dcomm-fsdp reads exists on the torch under test, on a real fully_shard module."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy, fully_shard

from dcomm.core.torch_private import missing_members
from dcomm.fsdp import use_low_precision_reduction
from dcomm.fsdp._torch_private import (
    PRIVATE_MEMBERS,
    fsdp_param_groups,
    hybrid_zero2_strategy,
    mp_policy,
    reduces_as_fsdp_default,
    shard_group,
)
from dcomm_testing import run_ranks


def test_every_class_member_exists() -> None:
    assert missing_members(PRIVATE_MEMBERS) == [], f"torch {torch.__version__}"
    assert isinstance(hybrid_zero2_strategy(), ShardingStrategy)


def _instance_members(rank: int, world: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    groups = fsdp_param_groups(model)
    assert len(groups) == 1, groups
    assert mp_policy(groups[0]).reduce_dtype == torch.bfloat16
    assert shard_group(groups[0]).size() == world
    assert reduces_as_fsdp_default(groups[0])  # as fully_shard left it
    use_low_precision_reduction(model, torch.float16)  # on gloo: dcomm's reduce-scatter, divide factor 1, SUM
    assert not reduces_as_fsdp_default(groups[0])


@pytest.mark.timeout(300)
def test_instance_members_exist_on_a_fully_shard_module() -> None:
    run_ranks(_instance_members, 1)
