"""Every private torch member dcomm-core reads exists on the torch under test; a missing one is named."""

from __future__ import annotations

import re
import types

import pytest
import torch

from dcomm.core._torch_private import PRIVATE_MEMBERS
from dcomm.core.torch_private import PrivateMember, TorchChanged, missing_members, private_member


def test_every_private_member_exists() -> None:
    assert PRIVATE_MEMBERS
    assert missing_members(PRIVATE_MEMBERS) == [], f"torch {torch.__version__}"


def test_a_missing_member_names_torch_the_member_and_the_supported_range() -> None:
    fake = types.SimpleNamespace(__name__="torch.distributed")
    expected = rf"^torch {re.escape(torch.__version__)} changed NCCL sums: torch.distributed._gone is gone"
    with pytest.raises(TorchChanged, match=expected):
        private_member(fake, "_gone", distribution="dcomm-core", what="NCCL sums")
    with pytest.raises(TorchChanged, match=r"dcomm-core supports torch(>=|<|,|\d|\.)*"):
        private_member(fake, "_gone", distribution="dcomm-core", what="NCCL sums")
    assert missing_members([PrivateMember(lambda: fake, "_gone", "x")]) == ["torch.distributed._gone (x)"]
