"""Where dcomm's Triton kernels run: switched off by ``DCOMM_TRITON=0``, launched on their tensors' GPU.

Every rank must take the same path, so the switch is an environment variable that a launcher sets
alike on every rank (e.g. where Triton imports but cannot compile).

Example::

    >>> import os
    >>> os.environ["DCOMM_TRITON"] = "0"
    >>> triton_enabled()
    False
    >>> del os.environ["DCOMM_TRITON"]
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dcomm.core.environment import switched_on

__all__ = ["ENV_SWITCH", "launch_device", "triton_enabled"]

ENV_SWITCH = "DCOMM_TRITON"


def triton_enabled() -> bool:
    """``DCOMM_TRITON`` is not ``0``/``false``/``no``/``off`` (read on every call: a test may set it)."""
    return switched_on(ENV_SWITCH)


def launch_device(tensor: torch.Tensor) -> Any:
    """A context in which a Triton launch runs on ``tensor``'s GPU (Triton uses the current device).

    Nothing to switch, the common case, costs no device query beyond one comparison.
    """
    if tensor.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)
