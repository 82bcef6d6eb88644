"""The call key of :func:`dcomm.averaging.average_parameters` read in C++: built in the background on first use.

A kept recipe holds while every parameter keeps its address, size and dtype, so every call reads
those three of every parameter: in Python, three method calls per parameter, 0.13-0.23 ms per
call on a GPU host for a model of 581 tensors, the largest piece of a replayed call's host time.
The C++ ``where`` (``csrc/call_key.cpp``) reads them in one pass, in about 13 us. It is built by
torch's extension builder in a background thread once a call averages CUDA parameters (about
10-40 s, once per torch installation; CPU-only runs never build it), and used once it is there;
until then, where it cannot be built (a warning says why, once) or with ``DCOMM_NATIVE_KEY=0``,
the key is read in Python. The two keys hold the same facts.

Example::

    >>> where_function([torch.zeros(2)]) is None or callable(where_function([torch.zeros(2)]))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dcomm.core.environment import switched_on
from dcomm.core.native_build import BackgroundBuild

__all__ = ["BUILD", "SWITCH", "where_function"]

SWITCH = "DCOMM_NATIVE_KEY"
"""``0`` reads the call key in Python and builds nothing (unset: the C++ key once it is built)."""

BUILD = BackgroundBuild(
    Path(__file__).with_name("csrc") / "call_key.cpp", "dcomm_averaging_native", "the C++ key of average_parameters"
)
"""The background build of the C++ key (``BUILD.wait()`` builds it now)."""


def where_function(params: Sequence[torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], bytes | None] | None:
    """The C++ ``where`` when it is built, else None; a call with CUDA parameters starts its build.

    ``where(params)`` is each parameter's address, element count and dtype as int64 bytes, or None
    where one has no storage address (sparse).
    """
    if not switched_on(SWITCH):
        return None
    module = BUILD.module()
    if module is not None:
        return module.where
    if params and isinstance(params[0], torch.Tensor) and params[0].is_cuda:
        BUILD.start()
    return None
