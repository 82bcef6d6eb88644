"""dcomm's C++ modules: built once by torch's extension builder, then loaded from a cache.

A module is built once per source, torch installation and Python version (about 10-40 s on 2
cores, by ``ninja``) into ``TORCH_EXTENSIONS_DIR`` (torch's default cache when unset); later runs
import the built file directly, without a compiler or ninja. :func:`load` checks what a build
needs first (a C++ compiler, Python's headers, a writable cache, ninja) and raises
:class:`NativeBuildError` naming the missing piece and its fix. Processes that build at once
(the ranks of a job on one host) take turns through :class:`BuildLock`, a lock file holding its
owner's pid and host, removed only when that owner is dead.

Example::

    >>> module = load(Path("csrc/average_hook.cpp"), "dcomm_ddp_native", "the C++ DDP hooks")  # doctest: +SKIP
    >>> built_file("dcomm_ddp_native", Path("csrc/average_hook.cpp")).exists()  # built already?  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from dcomm.core.environment import variable_set
from dcomm.core.groups import host_identity
from dcomm.core.log import warn_once

__all__ = ["BuildLock", "NativeBuildError", "build_name", "build_root", "built_file", "load"]

logger = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """A C++ module that cannot be built or loaded here: ``cause`` says why, ``fix`` what to do.

    Example::

        >>> str(NativeBuildError("the C++ DDP hooks", "no C++ compiler", "install g++"))
        'the C++ DDP hooks cannot be built: no C++ compiler; install g++'
    """

    def __init__(self, what: str, cause: str, fix: str) -> None:
        super().__init__(f"{what} cannot be built: {cause}; {fix}")
        self.what, self.cause, self.fix = what, cause, fix


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


def built_file(prefix: str, source: Path) -> Path:
    """The file the module of ``source`` is (or will be) built into.

    Example::

        >>> built_file("dcomm_example", Path(__file__)).suffix
        '.so'
    """
    name = build_name(prefix, source)
    return build_root() / name / f"{name}.so"


def load(
    source: Path, prefix: str, what: str, *, prebuild: str | None = None, ninja_fix: str = "pip install ninja"
) -> ModuleType:
    """The module built from ``source`` (one C++ file): imported from the cache, else built now.

    ``what`` names the module in messages ("the C++ DDP hooks"). A build started here warns once,
    on rank 0, naming ``prebuild`` (the command that builds ahead of time). The source names its
    init function with the ``TORCH_EXTENSION_NAME`` macro, which is :func:`build_name`.

    Raises:
        NativeBuildError: the module cannot be built or loaded here; the message names the cause
            and the fix (``ninja_fix`` where ninja is missing).
    """
    name = build_name(prefix, source)
    directory = build_root() / name
    cached = _import_built(name, directory)
    if cached is not None:
        return cached
    with _ninja_on_path():
        problem = missing_prerequisite(directory, ninja_fix=ninja_fix)
        if problem is not None:
            raise NativeBuildError(what, *problem)
        with BuildLock(directory, what):
            cached = _import_built(name, directory)  # another process built it while we waited
            if cached is not None:
                return cached
            hint = f"; prebuild with `{prebuild}`" if prebuild else ""
            warn_once(
                ("native build", name), f"building dcomm's {_bare(what)} (about 40 s, once per torch/Python){hint}"
            )
            logger.info("dcomm: building %s in %s", what, directory)
            try:
                return _build(name, source, directory)
            except Exception as error:  # a compiler error, a failed import of the result
                raise NativeBuildError(
                    what,
                    f"the build failed ({type(error).__name__}: {_last_lines(str(error))})",
                    f"run `{prebuild or 'the build'}` to see the compiler's output",
                ) from error


def missing_prerequisite(
    directory: Path,
    *,
    compiler: str | None = None,
    python_include: Path | None = None,
    which: Callable[[str], str | None] = shutil.which,
    ninja_fix: str = "pip install ninja",
) -> tuple[str, str] | None:
    """What a build in ``directory`` lacks, as ``(cause, fix)``; None when nothing is missing.

    ``compiler`` (default ``$CXX`` or ``c++``, as torch's builder reads it), ``python_include``
    (this Python's headers) and ``which`` are parameters so that each cause can be shown.

    Example::

        >>> missing_prerequisite(Path("/tmp/x"), compiler="no-such-compiler")[0]
        "no C++ compiler ('no-such-compiler' not found)"
    """
    compiler = compiler or os.environ.get("CXX") or "c++"
    if which(compiler) is None:
        return (f"no C++ compiler ({compiler!r} not found)", "install g++ (apt-get install g++) or set CXX to one")
    include = python_include or Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        return (f"no Python headers ({include / 'Python.h'} is missing)", f"install python3-dev (python{version}-dev)")
    if not _writable(directory):
        return (
            f"the build cache {directory.parent} is not writable",
            "set TORCH_EXTENSIONS_DIR to a writable directory",
        )
    if which("ninja") is None:
        return ("no ninja (torch's extension builder runs it)", ninja_fix)
    return None


class BuildLock:
    """A lock file of dcomm's in a build directory, holding its owner's pid and host.

    Entering waits while a live process holds the lock; a lock whose owner pid is dead on this
    host is removed (a build that was killed), together with the lock torch's builder leaves
    behind, which no one else can hold while this one is held. A lock held from another host is
    waited for. No lock is ever judged by its age.

    Args:
        directory: the build directory.
        what: the module, for the log line said while waiting.
        sleep: how to wait between two looks at the lock (seconds).

    Example::

        >>> with BuildLock(Path("/tmp/dcomm_example"), "an example"):  # doctest: +SKIP
        ...     build()
    """

    NAME = "dcomm.lock"

    def __init__(self, directory: Path, what: str = "a dcomm C++ module", sleep: Callable[[float], None] = time.sleep):
        self.directory, self.what, self.sleep = directory, what, sleep
        self.path = directory / self.NAME

    def __enter__(self) -> BuildLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        told = False
        while not self._try_take():
            owner = self.owner()
            if owner is not None and owner[1] == host_identity() and not _alive(owner[0]):
                logger.info(
                    "dcomm: removing %s, left by pid %d, which died building %s", self.path, owner[0], self.what
                )
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            if not told:
                holder = "a process" if owner is None else f"pid {owner[0]} on {owner[1]}"
                logger.info("dcomm: waiting for %s, which builds %s (%s)", holder, self.what, self.path)
                told = True
            self.sleep(0.5)
        # torch's own lock can only be left by a dead holder of ours: no live build holds it now.
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "lock").unlink()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def owner(self) -> tuple[int, str] | None:
        """``(pid, host)`` written in the lock, or None (no lock, or one still being written)."""
        try:
            pid, host = self.path.read_text().split(" ", 1)
            return int(pid), host
        except (FileNotFoundError, ValueError):
            return None

    def _try_take(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {host_identity()}")
        return True


def _import_built(name: str, directory: Path) -> ModuleType | None:
    """The module built earlier into ``directory``; None when there is none (or it does not load)."""
    path = directory / f"{name}.so"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:  # half written by a killed build, or another torch's: build again
        logger.info("dcomm: %s does not load (%s); building it again", path, error)
        return None
    return module


def _build(name: str, source: Path, directory: Path) -> ModuleType:
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name, sources=[str(source)], extra_cflags=["-O2"], build_directory=str(directory), verbose=False
    )


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except OSError as error:
        return error.errno != errno.ESRCH
    return True


def _bare(what: str) -> str:
    return what.removeprefix("the ")


def _last_lines(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


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
        from ninja import BIN_DIR  # type: ignore[import-not-found,unused-ignore]  # the [native] extra
    except ImportError:
        yield
        return
    with variable_set("PATH", BIN_DIR + os.pathsep + os.environ.get("PATH", "")):
        yield
