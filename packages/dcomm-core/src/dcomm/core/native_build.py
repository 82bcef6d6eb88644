"""dcomm's C++ modules, built on first use by torch's extension builder and cached.

A module is built once per source, torch installation and Python version (about 10-40 s on 2
cores, by ``ninja``), then loaded from ``TORCH_EXTENSIONS_DIR`` (torch's default cache when
unset). A build killed half-way leaves torch's lock file behind, and torch would wait for it for
good: a lock whose directory has not changed for :data:`STALE_BUILD_S` is removed instead.
:class:`BackgroundBuild` builds in a thread, for code that has a Python path meanwhile.

Example::

    >>> module = load(Path("csrc/call_key.cpp"), "dcomm_averaging_native", "the C++ call key")  # doctest: +SKIP
    >>> build = BackgroundBuild(Path("csrc/call_key.cpp"), "dcomm_averaging_native", "the C++ call key")
    >>> build.module() is None  # not started  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dcomm.core.environment import variable_set

__all__ = ["QUIET_WARNING_S", "STALE_BUILD_S", "BackgroundBuild", "build_name", "clear_stale_lock", "load"]

logger = logging.getLogger(__name__)

STALE_BUILD_S = 180.0
"""A build lock whose directory has not changed for this long was left by a killed build."""
QUIET_WARNING_S = 60.0
"""Waiting on a lock whose directory has not changed for this long warns once (a build takes 10-40 s)."""


def build_name(prefix: str, source: Path) -> str:
    """The module's name, which is also its build directory's: one per source, torch and Python.

    A module binds torch's C++ classes and Python's ABI, so the name hashes the source, the torch
    and Python versions and where torch is installed: two environments with the same versions
    would otherwise rebuild it in turn in one directory (each build links its own torch).

    Example::

        >>> build_name("dcomm_example", Path(__file__)).startswith("dcomm_example_")
        True
    """
    where = Path(torch.__file__).resolve().parent
    version = f"{torch.__version__} {sys.version_info[0]}.{sys.version_info[1]} {where}".encode()
    return f"{prefix}_{hashlib.sha256(source.read_bytes() + version).hexdigest()[:12]}"


def build_root() -> Path:
    """Where modules are built and cached: ``TORCH_EXTENSIONS_DIR``, else torch's default."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def load(source: Path, prefix: str, what: str, stale_after_s: float | None = None) -> Any:
    """The module built from ``source`` (one C++ file), built now unless cached; raises if it cannot be.

    ``what`` names the module in log lines and warnings ("the C++ DDP hooks"); ``stale_after_s``:
    see :func:`clear_stale_lock`. The source names its init function with the
    ``TORCH_EXTENSION_NAME`` macro, which is :func:`build_name`.
    """
    from torch.utils import cpp_extension

    name = build_name(prefix, source)
    build_directory = build_root() / name
    build_directory.mkdir(parents=True, exist_ok=True)
    if not (build_directory / f"{name}.so").exists():
        logger.info("dcomm: building %s in %s (once per torch installation)", what, build_directory)
    clear_stale_lock(build_directory, stale_after_s, what=what)
    with _ninja_on_path():
        return cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=["-O2"],
            build_directory=str(build_directory),
            verbose=False,
        )


class BackgroundBuild:
    """:func:`load` in a daemon thread, started by :meth:`start`; :meth:`module` once it is done.

    A build that fails warns once (naming ``what`` and why) and leaves :meth:`module` None for good.

    Example::

        >>> build = BackgroundBuild(Path("call_key.cpp"), "dcomm_example", "the example")  # doctest: +SKIP
        >>> build.start(); build.wait(); build.module()  # doctest: +SKIP
        <module 'dcomm_example_...'>
    """

    def __init__(self, source: Path, prefix: str, what: str) -> None:
        self.source, self.prefix, self.what = source, prefix, what
        self._thread: threading.Thread | None = None
        self._module: Any = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the build (once; later calls do nothing)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, name=f"build {self.prefix}", daemon=True)
                self._thread.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the build is done (or ``timeout_s`` passed); starts it if needed."""
        self.start()
        assert self._thread is not None
        self._thread.join(timeout_s)

    def module(self) -> Any:
        """The built module, or None while it builds, before :meth:`start`, or after a failed build."""
        return self._module

    def _build(self) -> None:
        try:
            self._module = load(self.source, self.prefix, self.what)
        except Exception as error:  # any build or load failure leaves the caller's Python path
            warnings.warn(
                f"dcomm: {self.what} could not be built ({type(error).__name__}: {error}); the Python "
                "path runs instead (same results, more host time). Install a C++ compiler and ninja",
                RuntimeWarning,
                stacklevel=1,
            )


def clear_stale_lock(
    build_directory: Path,
    stale_after_s: float | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    what: str = "a dcomm C++ module",
) -> None:
    """Wait while another process builds in ``build_directory``; remove the lock of a killed build.

    torch's extension builder waits, for as long as it exists, for the ``lock`` file of whoever
    builds in the directory; a build killed half-way (Ctrl-C during the first import) leaves it
    behind, and every later run would hang. A lock whose directory has not changed for
    ``stale_after_s`` (default :data:`STALE_BUILD_S`) is removed, with a warning, and the build
    starts again; waiting on one quiet for longer than a build takes warns once before that.

    Example::

        >>> clear_stale_lock(Path("~/.cache/torch_extensions/dcomm_ddp_native_ab12").expanduser())  # doctest: +SKIP
    """
    stale_after_s = STALE_BUILD_S if stale_after_s is None else stale_after_s
    lock = build_directory / "lock"
    told = warned = False
    while lock.exists():
        quiet_s = clock() - _last_change(build_directory)
        if quiet_s > stale_after_s:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            warnings.warn(
                f"dcomm: removed {lock}, left by a build of {what} that stopped {quiet_s:.0f} s ago (killed?); "
                "building again",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if not told:
            logger.info("dcomm: waiting for another process building %s (%s)", what, lock)
            told = True
        if not warned and quiet_s > QUIET_WARNING_S:  # longer than a build: say why the run waits
            warnings.warn(
                f"dcomm: waiting for {lock}, unchanged for {quiet_s:.0f} s: a build of {what} in another "
                f"process, or one that was killed (removed after {stale_after_s:.0f} s without progress)",
                RuntimeWarning,
                stacklevel=2,
            )
            warned = True
        sleep(0.5)


def _last_change(directory: Path) -> float:
    """The latest modification time of ``directory`` and the entries in it."""
    latest = directory.stat().st_mtime
    with os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
    return latest


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the ninja of the ``ninja`` package on PATH for the build, when none is there already.

    torch's builder runs ``ninja`` from PATH; a virtual environment used without activating it
    has the package's binary but not on PATH.
    """
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        from ninja import BIN_DIR
    except ImportError:
        yield
        return
    with variable_set("PATH", BIN_DIR + os.pathsep + os.environ.get("PATH", "")):
        yield
