"""DDP's reducer runs dcomm's averaging hooks in C++, as it runs its own built-in allreduce.

DDP calls a Python comm hook once per bucket on the autograd thread, and that call (taking the
GIL, wrapping the bucket, unwrapping the returned future) costs 50-85 us per bucket: on a
backward pass paced by its host, time the GPU waits. torch's built-in hooks avoid it, but
``register_comm_hook`` accepts only Python callables. So importing :mod:`dcomm.ddp` wraps
``torch.distributed._register_comm_hook``, the call that ``DistributedDataParallel.register_comm_hook``
ends with: registering dcomm's :func:`~dcomm.ddp.allreduce_hook`,
:func:`~dcomm.ddp.fp16_compress_hook` or :func:`~dcomm.ddp.bf16_compress_hook` puts a C++ hook with
the same arithmetic on the reducer (bit-identical gradients); any other hook is registered as
before. DDP's checks, its logged hook name and ``ddp._comm_hooks`` are unchanged. A bucket of
sparse gradients is passed to the Python hook (DDP buckets complex gradients as their real view).
ZeRO overlap hooks (:mod:`dcomm.ddp.zero_overlap`) get a C++ hook too, switched on by their
driver once DDP has settled its buckets: it allreduces every bucket (or, with
``reduce_scatter=True``, reduce-scatters every shard) and calls the driver once, at the last bucket.

With ``gradient_as_bucket_view=True`` on CUDA, ``fp16_compress_hook`` and ``bf16_compress_hook``
cast each bucket, send it and cast the sum back into DDP's bucket on a side stream, so the
backward stream does no more work than with DDP's built-in allreduce (1x H200: 0.97-0.98x the
step with the casts on the backward stream with TF32); ``DCOMM_CAST_ASIDE=0`` keeps them there.
Without it DDP converts the low-precision sum into ``.grad`` itself (one copy fewer).

The C++ hook is compiled on first use by torch's extension builder (about 40 s on 2 cores, then
cached in ``TORCH_EXTENSIONS_DIR``, one build per torch installation and Python version; a lock left by a build
that was killed is removed after 3 minutes without progress instead of hanging every later run).
It needs a C++ compiler and ninja (a dependency of dcomm-ddp); where it cannot be built, a warning
says why, once, and the Python hooks run. Set ``DCOMM_NATIVE_HOOKS=0`` to keep the Python hooks.

Example::

    >>> from dcomm.ddp import bf16_compress_hook, native_hooks_available
    >>> ddp_model.register_comm_hook(None, bf16_compress_hook)  # the reducer runs it in C++  # doctest: +SKIP
    >>> native_hooks_available()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dcomm.ddp._torch_private as private
from dcomm.core import native_build, resolve_group
from dcomm.core.environment import switched_on, variable_set
from dcomm.ddp.default_hooks import (
    _cached_plan,
    _in_place_plan,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)

__all__ = ["native_hooks_available"]

logger = logging.getLogger(__name__)

ENV_SWITCH = "DCOMM_NATIVE_HOOKS"
CAST_ASIDE_SWITCH = "DCOMM_CAST_ASIDE"
_SOURCE = Path(__file__).with_name("csrc") / "average_hook.cpp"

# The hooks that have a C++ twin, and the dtype each sends in (None: the bucket's own).
_WIRE_DTYPE: dict[Callable[..., Any], torch.dtype | None] = {
    allreduce_hook: None,
    fp16_compress_hook: torch.float16,
    bf16_compress_hook: torch.bfloat16,
}


def native_hooks_available() -> bool:
    """Whether registering dcomm's averaging hooks gives DDP's reducer a C++ hook.

    False when ``DCOMM_NATIVE_HOOKS=0`` or when the C++ hook cannot be built here (a warning
    said why). The first call builds it, or loads it from torch's extension cache.

    Example::

        >>> native_hooks_available()  # doctest: +SKIP
        True
    """
    return _enabled() and _extension() is not None


def _enabled() -> bool:
    return switched_on(ENV_SWITCH)


def _cast_aside() -> bool:
    return switched_on(CAST_ASIDE_SWITCH)


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """Inside the block, registering dcomm's averaging hooks gives C++ hooks (``on``) or Python hooks.

    Sets ``DCOMM_NATIVE_HOOKS`` and restores it after; for side-by-side runs of the two paths.

    Example::

        >>> with switched(False):  # doctest: +SKIP
        ...     ddp_model.register_comm_hook(None, bf16_compress_hook)  # a Python hook
    """
    with variable_set(ENV_SWITCH, "1" if on else "0"):
        yield


STALE_BUILD_S = native_build.STALE_BUILD_S
"""A build lock whose directory has not changed for this long was left by a killed build (read at each build)."""

_PREFIX = "dcomm_ddp_native"
_WHAT = "the C++ DDP hooks"


def build_name() -> str:
    """The C++ module's name, which is also its build directory's (:func:`dcomm.core.native_build.build_name`)."""
    return native_build.build_name(_PREFIX, _SOURCE)


@functools.cache
def _extension() -> Any | None:
    """The compiled C++ hook module, built on first use; None (with one warning) if it cannot be."""
    try:
        return native_build.load(_SOURCE, _PREFIX, _WHAT, stale_after_s=STALE_BUILD_S)
    except Exception as error:  # any build or load failure leaves the Python hooks, which are correct
        warnings.warn(
            f"dcomm.ddp: {_WHAT} could not be built ({type(error).__name__}: {error}); DDP runs "
            f"dcomm's Python hooks instead (same results, more host time per bucket). Install a C++ "
            f"compiler and ninja, or set {ENV_SWITCH}=0 to silence this",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def clear_stale_lock(build_directory: Path, stale_after_s: float | None = None, **kwargs: Any) -> None:
    """:func:`dcomm.core.native_build.clear_stale_lock` for the C++ DDP hooks' build directory."""
    native_build.clear_stale_lock(build_directory, stale_after_s, what=_WHAT, **kwargs)


def _planner(group: dist.ProcessGroup, wire: torch.dtype | None) -> Callable[..., tuple[float, Any, Any]]:
    """For the C++ hook, once per bucket dtype and device: (divisor before the sum, op, dtype sent).

    The plans are the Python hooks' own, so the two paths do the same arithmetic.
    """

    def plan_for(dtype: torch.dtype, device: torch.device) -> tuple[float, Any, torch.dtype | None]:
        if wire is None or dtype == wire:
            plan = _in_place_plan(group, dtype, device)
            sent = None
        else:
            plan = _cached_plan(group, dtype, device)
            sent = wire
        if plan.post != 1.0:
            raise AssertionError(f"the hooks divide before the sum only, got post={plan.post}")
        return plan.pre, plan.op, sent

    return plan_for


def _as_python_caller(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` called from a Python frame, so that its future follows torch's contract.

    Called straight from the reducer, dcomm's hooks return futures that complete at once and wait
    for every bucket's collective at the last bucket; a bucket the C++ hook passes on must have a
    future of its own instead.
    """

    def python_caller(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    return python_caller


def _zero_driver(hook: object) -> Any | None:
    """The driver of a ZeRO overlap hook whose buckets a C++ hook can communicate, else None."""
    from dcomm.ddp._zero.checks import HOOK_MARK
    from dcomm.ddp._zero.driver import Driver

    driver = getattr(hook, HOOK_MARK, None)
    return driver if isinstance(driver, Driver) and driver.can_run_in_cpp() else None


def _quantized_state(hook: Callable[..., Any], state: object) -> tuple[Any, str] | None:
    """(state, format) of an int8/fp8 hook that may switch to bf16 (see :mod:`dcomm.ddp._wire_choice`), else None."""
    from dcomm.ddp import quantized_hooks

    fmt = quantized_hooks.HOOK_FORMATS.get(hook)
    if fmt is None:
        return None
    if state is not None and not isinstance(state, quantized_hooks.QuantizedState):
        return None  # the hook raises on it
    resolved = quantized_hooks._resolve_state(state, hook.__name__)
    return (resolved, fmt) if resolved.bf16_if_faster else None


def _register_comm_hook(reducer: Any, state: object, comm_hook: Callable[..., Any]) -> None:
    """torch's ``_register_comm_hook``, with a C++ hook on the reducer for dcomm's averaging hooks.

    A ZeRO overlap hook gets a C++ hook that runs the Python hook until the driver switches it on,
    then communicates every bucket itself (an allreduce, or with ``reduce_scatter=True`` the
    reduce-scatters of the shards) and calls the driver once per backward, at the last bucket.
    An int8/fp8 hook gets the bf16 averaging hook, switched off: it runs the Python hook until that
    chooses bf16 (:mod:`dcomm.ddp._wire_choice`).
    """
    driver = _zero_driver(comm_hook)
    averaging = comm_hook in _WIRE_DTYPE and (state is None or isinstance(state, dist.ProcessGroup))
    quantized = _quantized_state(comm_hook, state)
    wanted = driver is not None or averaging or quantized is not None
    extension = _extension() if wanted and _enabled() else None
    if extension is None:
        # Any other hook or state (the Python hook raises on a bad state, as torch's does).
        _TORCH_REGISTER(reducer, state, comm_hook)
        return
    if driver is not None:
        driver.native_switch = driver.register_in_cpp(extension, reducer, state, comm_hook)
        return
    if quantized is not None:
        from dcomm.ddp.quantized_hooks import native_pass_end

        quantized_state, fmt = quantized
        group = resolve_group(quantized_state.process_group)
        # The Python hook itself, not a Python caller of it: while the switch is off it gets every
        # bucket of a backward pass, so its futures may wait at the last bucket. Switched on, the
        # C++ hook calls back at its last bucket, where the next pass's wire is chosen.
        plan = _planner(group, torch.bfloat16)
        switch = extension.register_average_hook(
            reducer, group, plan, state, comm_hook, native_pass_end(quantized_state, fmt)
        )
        switch.set(quantized_state.wire == "bf16")
        quantized_state._wire.switches.append(switch)
        return
    group = resolve_group(state)  # type: ignore[arg-type]
    plan = _planner(group, _WIRE_DTYPE[comm_hook])
    extension.register_average_hook(reducer, group, plan, state, _as_python_caller(comm_hook), None, _cast_aside())


# torch's own binding, from where it is defined (``dist``'s name for it is the one wrapped).
_TORCH_REGISTER: Callable[..., None] = private.register_comm_hook_binding()


def install() -> None:
    """Wrap ``torch.distributed._register_comm_hook`` (once; :mod:`dcomm.ddp` calls this on import)."""
    if private.registered_comm_hook_function() is not _register_comm_hook:
        private.replace_registered_comm_hook_function(_register_comm_hook)
