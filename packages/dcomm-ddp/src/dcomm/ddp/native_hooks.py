"""The C++ fast path: dcomm's averaging hooks run in C++ on DDP's reducer, by one explicit call.

DDP calls a Python comm hook once per bucket on the autograd thread, and that call (taking the
GIL, wrapping the bucket, unwrapping the returned future) costs host time per bucket; torch's
built-in hooks avoid it, but ``DistributedDataParallel.register_comm_hook`` takes only Python
callables. :func:`register_comm_hook` puts a C++ hook with the Python hook's arithmetic on the
reducer for :func:`~dcomm.ddp.fp16_compress_hook` and :func:`~dcomm.ddp.bf16_compress_hook`
(bit-identical gradients), and for the ZeRO overlap hooks (:mod:`dcomm.ddp.zero_overlap`: every
bucket communicated in C++, one Python call per backward pass once DDP has settled its buckets).
Any other hook, :func:`~dcomm.ddp.allreduce_hook` included (its C++ twin measured no faster than
the Python hook), is registered as the Python hook it is.
With ``gradient_as_bucket_view=True`` on CUDA, the C++ compress hooks cast, send and cast back
on a side stream, so the backward stream does no more work than with DDP's built-in allreduce.

Every rank of the DDP model's group takes the same path: the ranks agree in one collective at
registration, and rank 0 logs the choice. The C++ hooks are compiled once per torch installation
and Python version (:mod:`dcomm.core.native_build`); ``python -m dcomm.ddp.build`` does it ahead
of time (:mod:`dcomm.ddp.build`). A build needs a C++ compiler, Python's headers and ninja
(``pip install dcomm-ddp[native]``).

Example::

    >>> import dcomm.ddp
    >>> dcomm.ddp.register_comm_hook(ddp_model, None, dcomm.ddp.bf16_compress_hook)  # doctest: +SKIP
    'native'
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dcomm.ddp._torch_private as private
from dcomm.core import get_logger, plan_average, resolve_group
from dcomm.core.native_build import NativeBuildError, built_file, load
from dcomm.ddp.default_hooks import bf16_compress_hook, fp16_compress_hook

__all__ = ["NativeBuildError", "load_native_hooks", "native_hooks_available", "register_comm_hook"]

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "average_hook.cpp"
PREBUILD = "python -m dcomm.ddp.build"
_PREFIX = "dcomm_ddp_native"
_WHAT = "the C++ DDP hooks"
_TURN_OFF = "or pass native=False to register the Python hook"

# The hooks that have a C++ twin, and the dtype each sends in. allreduce_hook has none: its twin
# was level with the Python hook (docs/design/native-hooks.md, "When it stays").
_WIRE_DTYPE: dict[Callable[..., Any], torch.dtype] = {
    fp16_compress_hook: torch.float16,
    bf16_compress_hook: torch.bfloat16,
}

# This process's outcome of loading the C++ hooks: the module, or why it cannot be had.
_LOADED: list[ModuleType | NativeBuildError] = []
_WARNED: set[str] = set()


def load_native_hooks() -> ModuleType:
    """The C++ hooks' module: imported from the cache, else built now (about 40 s), once per process.

    Returns:
        The module.

    Raises:
        NativeBuildError: (a ``RuntimeError``) it cannot be built here; the message names the
            cause (no C++ compiler, no Python headers, an unwritable cache, no ninja, a failed
            compilation) and its fix.

    Example::

        >>> load_native_hooks().register_average_hook  # doctest: +SKIP
        <built-in method register_average_hook ...>
    """
    if not _LOADED:
        try:
            _LOADED.append(load(SOURCE, _PREFIX, _WHAT, prebuild=PREBUILD, ninja_fix="pip install dcomm-ddp[native]"))
        except NativeBuildError as error:
            _LOADED.append(error)
    outcome = _LOADED[0]
    if isinstance(outcome, NativeBuildError):
        raise outcome
    return outcome


def native_hooks_available() -> bool:
    """Whether this process can use the C++ hooks (builds them on the first call where needed).

    Example::

        >>> native_hooks_available()  # doctest: +SKIP
        True
    """
    try:
        load_native_hooks()
    except NativeBuildError:
        return False
    return True


def native_hooks_file() -> Path:
    """Where the C++ hooks are (or will be) cached: one file per torch installation and Python version."""
    return built_file(_PREFIX, SOURCE)


def register_comm_hook(
    ddp_model: DistributedDataParallel,
    state: object,
    hook: Callable[..., Any],
    *,
    native: bool | None = None,
    _load: Callable[[], ModuleType] = load_native_hooks,
) -> str:
    """Register ``hook`` on ``ddp_model``: as a C++ hook where every rank has one, else the Python hook.

    ``ddp_model.register_comm_hook(state, hook)`` with the C++ fast path: for dcomm's
    ``fp16_compress_hook`` and ``bf16_compress_hook`` (with a ProcessGroup or None as the state)
    and the ZeRO overlap hooks, DDP's reducer runs a C++ hook with the same arithmetic
    (bit-identical gradients) instead of calling Python per bucket. Any other hook
    (``allreduce_hook``, PowerSGD, post-local SGD, your own) is registered as the Python hook,
    returning "python", with no build and no collective.
    The ranks of ``ddp_model``'s process group agree in one collective, so every rank takes the
    same path; rank 0 logs it. Call it on every rank, before the first backward, instead of
    ``ddp_model.register_comm_hook``.

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        state: the hook's state, as for ``ddp_model.register_comm_hook``.
        hook: the comm hook.
        native: None (the default): the C++ hook where every rank can build or load it, else the
            Python hook on every rank (a warning names the cause once). False: the Python hook.
            True: the C++ hook, or a ``RuntimeError`` on every rank if some rank cannot.

    Returns:
        ``"native"`` or ``"python"``: the path taken, the same on every rank.

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel, or ``native`` not a bool or None.
        RuntimeError: ``native=True`` and some rank cannot use the C++ hooks (the message names
            the cause and its fix), or a hook was registered on ``ddp_model`` already.

    Example::

        >>> import dcomm.ddp
        >>> dcomm.ddp.register_comm_hook(ddp_model, None, dcomm.ddp.fp16_compress_hook)  # doctest: +SKIP
        'native'
        >>> dcomm.ddp.register_comm_hook(ddp_model, state, dcomm.ddp.powerSGD_hook)  # doctest: +SKIP
        'python'
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"ddp_model: expected a torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}; "
            "wrap the model first: DistributedDataParallel(model)"
        )
    if native is not None and not isinstance(native, bool):
        raise TypeError(
            f"native: expected True, False or None, got {native!r}; pass None (C++ where every rank can), "
            "False (Python) or True (C++ or an error)"
        )
    name = getattr(hook, "__qualname__", type(hook).__name__)
    if native is False or not _has_cpp_twin(hook, state):
        ddp_model.register_comm_hook(state, hook)
        logger.info("dcomm.ddp: %s registered as a Python hook", name)
        return "python"
    extension: ModuleType | None = None
    cause: NativeBuildError | None = None
    try:
        extension = _load()
    except NativeBuildError as error:
        cause = error
    group = ddp_model.process_group
    unable = _ranks_unable(group, _device_of(ddp_model), extension is not None)
    if unable:
        if native is True:
            raise RuntimeError(_refusal(unable, cause))
        _warn_once(unable, cause)
        ddp_model.register_comm_hook(state, hook)
        logger.info("dcomm.ddp: %s registered as a Python hook on every rank (rank(s) %s cannot use C++)", name, unable)
        return "python"
    assert extension is not None
    _register_in_cpp(ddp_model, state, hook, extension)
    logger.info("dcomm.ddp: %s registered as a C++ hook on every rank (DDP's reducer runs it)", name)
    return "native"


def _has_cpp_twin(hook: Callable[..., Any], state: object) -> bool:
    """Whether a C++ hook can stand for ``hook`` (with this ``state``)."""
    if _zero_driver(hook) is not None:
        return True
    try:
        averaging = hook in _WIRE_DTYPE
    except TypeError:  # an unhashable callable
        return False
    # Another state goes to the Python hook, which raises on it with torch's message.
    return averaging and (state is None or isinstance(state, dist.ProcessGroup))


def _register_in_cpp(
    ddp_model: DistributedDataParallel, state: object, hook: Callable[..., Any], extension: ModuleType
) -> None:
    """What ``ddp_model.register_comm_hook`` does, with a C++ hook on the reducer."""
    private.check_comm_hook(ddp_model, hook)
    reducer = private.reducer(ddp_model)
    driver = _zero_driver(hook)
    if driver is not None:
        # Registered switched off: it runs the Python hook until the driver switches it on.
        driver.native_switch = driver.register_in_cpp(extension, reducer, state, hook)
    else:
        group = resolve_group(state)  # type: ignore[arg-type]
        # A bucket the C++ hook does not handle (sparse) goes to ``hook`` itself.
        extension.register_average_hook(reducer, group, _planner(group, _WIRE_DTYPE[hook]), state, hook)
    private.record_comm_hook(ddp_model, state, hook)


def _zero_driver(hook: object) -> Any | None:
    """The driver of a ZeRO overlap hook whose buckets a C++ hook can communicate, else None."""
    from dcomm.ddp._zero.checks import HOOK_MARK
    from dcomm.ddp._zero.driver import Driver

    driver = getattr(hook, HOOK_MARK, None)
    return driver if isinstance(driver, Driver) and driver.can_run_in_cpp() else None


def _planner(group: dist.ProcessGroup, wire: torch.dtype | None) -> Callable[..., tuple[float, Any, Any]]:
    """For the C++ hook, once per bucket dtype and device: (divisor before the sum, op, dtype sent)."""

    def plan_for(dtype: torch.dtype, device: torch.device) -> tuple[float, Any, torch.dtype | None]:
        sent = None if wire is None or dtype == wire else wire
        plan = _plan(group, dtype, device, in_place=sent is None)
        if plan.post != 1.0:
            raise AssertionError(f"the hooks divide before the sum only, got post={plan.post}")
        return plan.pre, plan.op, sent

    return plan_for


@functools.lru_cache(maxsize=64)
def _plan(group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device, in_place: bool) -> Any:
    """torch's arithmetic: divide by the group size, then sum.

    In place, on NCCL, with a world size that is a power of two and an fp16 bucket, the division
    is NCCL's ``PREMUL_SUM`` by ``1 / world`` (:func:`dcomm.core.plan_average` decides; a bf16
    bucket is divided first, as torch does): the product is the exact quotient, so the sum is
    bit-identical to dividing first, and the bucket is not read and written once more.
    """
    return plan_average(group, dtype, device, arithmetic="predivide", nccl_average=False, nccl_premul=in_place)


def _device_of(ddp_model: DistributedDataParallel) -> torch.device:
    """Where the agreement's tensor goes: the device of the model's parameters (their group can reduce there)."""
    for param in ddp_model.parameters():
        return param.device
    return torch.device("cpu")


def _ranks_unable(group: dist.ProcessGroup, device: torch.device, able: bool) -> list[int]:
    """The ranks of ``group`` (global numbers) that cannot use the C++ hooks: one allreduce, every rank alike."""
    flags = torch.zeros(group.size(), dtype=torch.int32, device=device)
    flags[group.rank()] = 0 if able else 1
    dist.all_reduce(flags, group=group)
    ranks = dist.get_process_group_ranks(group)
    return [ranks[index] for index, flag in enumerate(flags.tolist()) if flag]


def _refusal(unable: list[int], cause: NativeBuildError | None) -> str:
    why = f": {cause.cause}; {cause.fix}" if cause is not None else " (their error names the cause and the fix)"
    return (
        f"native=True: {_WHAT} cannot be used on rank(s) {unable}{why}. Prebuild them with `{PREBUILD}` in "
        "the image, or pass native=None to register the Python hook on every rank where some rank cannot, "
        "native=False to always register it"
    )


def _warn_once(unable: list[int], cause: NativeBuildError | None) -> None:
    """Warn with the cause, once per job: on the first rank that cannot (it alone knows why)."""
    if cause is None or dist.get_rank() != unable[0] or cause.cause in _WARNED:
        return
    _WARNED.add(cause.cause)
    warnings.warn(
        f"dcomm.ddp: {cause} ({_TURN_OFF}); DDP runs the Python hooks on every rank (same results, more host "
        "time per bucket)",
        RuntimeWarning,
        stacklevel=3,
    )
