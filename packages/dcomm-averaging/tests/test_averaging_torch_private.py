"""Every private torch member dcomm-averaging reads exists on the torch under test."""

from __future__ import annotations

import torch

from dcomm.averaging._torch_private import PRIVATE_MEMBERS, foreach_copy_, foreach_div_
from dcomm.core.torch_private import missing_members


def test_every_private_member_exists_and_works() -> None:
    assert missing_members(PRIVATE_MEMBERS) == [], f"torch {torch.__version__}"
    tensors = [torch.full((2,), 6.0), torch.full((3,), 9.0)]
    foreach_div_(tensors, 3.0)
    assert [t.tolist() for t in tensors] == [[2.0, 2.0], [3.0, 3.0, 3.0]]
    targets = [torch.zeros(2), torch.zeros(3)]
    foreach_copy_(targets, tensors)
    assert [t.tolist() for t in targets] == [[2.0, 2.0], [3.0, 3.0, 3.0]]
