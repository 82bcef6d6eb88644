"""Every private torch member dcomm-core reads, and the accessors that read them.

Example::

    >>> premul = make_nccl_premul_sum(0.25)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dcomm.core.torch_private import PrivateMember, private_member

PRIVATE_MEMBERS = [
    PrivateMember(lambda: dist, "_make_nccl_premul_sum", "NCCL's pre-multiplied sum (fp16 averaging on NCCL)"),
]


def make_nccl_premul_sum(factor: float) -> Any:
    """NCCL's ``SUM`` of the inputs multiplied by ``factor`` (a reduce op; NCCL only)."""
    member = PRIVATE_MEMBERS[0]
    return private_member(dist, member.name, distribution="dcomm-core", what=member.what)(factor)
