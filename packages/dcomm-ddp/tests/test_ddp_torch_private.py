"""Every private torch member that dcomm-ddp reads exists on the torch under test.

CI runs this on every torch of its matrix (the oldest supported, the pinned one, the newest): a
torch release that renames a member fails here, and in use with a ``RuntimeError`` naming it,
instead of silently switching a check off.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import dcomm.ddp._torch_private as private
from dcomm.core.torch_private import TorchChanged, supported_torch
from dcomm_testing import run_ranks

DDP_SRC = pathlib.Path(private.__file__).parent


def _missing(rank: int, world: int) -> list[str]:
    ddp = DDP(torch.nn.Linear(2, 2))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    return private.missing_members(ddp, zero)


def test_every_private_member_exists_on_this_torch() -> None:
    assert run_ranks(_missing, 1, timeout=120) == [[]]


def test_a_missing_member_names_the_torch_version_the_member_and_the_support_range() -> None:
    version = re.escape(torch.__version__)
    supported = re.escape(supported_torch("dcomm-ddp"))  # the installed requirement, not a copy of it
    expected = (
        rf"^torch {version} changed .*ZeroRedundancyOptimizer.*: object\._param_to_rank is gone; "
        rf"dcomm-ddp supports {supported}:"
    )
    with pytest.raises(TorchChanged, match=expected):
        private.param_to_rank(object())  # type: ignore[arg-type]


def test_the_zero_code_reads_private_members_only_through_the_accessors() -> None:
    private_access = re.compile(r"(?<![\w.])(zero|ddp|dist|torch)\._[a-z]\w*")
    files = [DDP_SRC / "zero_overlap.py", *sorted((DDP_SRC / "_zero").glob("*.py"))]
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private_access.search(line)
    ]
    assert found == []
