"""Run one of torch's own test files with dcomm in place of torch's algorithms.

The test file is given on the command line (nothing is downloaded). Inside this process, and
inside every rank process the test spawns, the torch modules that dcomm replaces are swapped
for shims holding dcomm's objects under torch's names, so the test exercises dcomm exactly as
a user who changed one import line would. dcomm itself never patches torch; only this test
tool does, and only in its own processes.

A name the test reads from a swapped module that dcomm does not define (a torch-private helper
such as ``_allreduce_fut``) falls through to torch's module and is reported on stderr, so a
run shows what it did not replace.

Usage::

    python tools/torch_tests.py .scratch/test_ddp_hooks.py
    python tools/torch_tests.py \\
        /path/to/site-packages/torch/testing/_internal/distributed/distributed_test.py \\
        -k test_periodic_model_averager -k test_ddp_hook_parity
    python tools/torch_tests.py --torch-only FILE ...   # the same run against torch itself

For torch's ``distributed_test.py`` the runner builds the gloo spawn test class that torch's
``test/distributed/test_distributed_spawn.py`` builds (``BACKEND=gloo``, ``WORLD_SIZE=2``
unless set, a fresh ``TEMP_DIR``). Options after the file go to ``unittest`` (``-k``, ``-v``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import types
import unittest
from pathlib import Path

TEST_FILE_ENV = "DCOMM_TORCH_TESTS_FILE"
TORCH_ONLY_ENV = "DCOMM_TORCH_TESTS_TORCH_ONLY"

# torch module -> dcomm module that replaces its public names.
SWAPS = {
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks": "dcomm.ddp",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook": "dcomm.ddp",
    "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook": "dcomm.ddp",
    "torch.distributed.algorithms.model_averaging.utils": "dcomm.averaging",
    "torch.distributed.algorithms.model_averaging.averagers": "dcomm.averaging",
    "torch.distributed.algorithms.model_averaging.hierarchical_model_averager": "dcomm.averaging",
    "torch.distributed.optim.post_localSGD_optimizer": "dcomm.averaging",
}
# Packages whose import-time bindings of the swapped modules are re-made after the swap.
RELOADED = ("torch.distributed.algorithms.ddp_comm_hooks",)


def make_shim(torch_name: str, dcomm_name: str) -> tuple[types.ModuleType, list[str]]:
    """Build a module named ``torch_name`` whose public names come from ``dcomm_name``.

    Returns the shim and the public names of torch's module that dcomm lacks (those, and
    every private name, are looked up in torch's module and reported when read).
    """
    torch_module = importlib.import_module(torch_name)
    dcomm_module = importlib.import_module(dcomm_name)
    shim = types.ModuleType(torch_name, f"dcomm shim of {torch_name}")
    public = getattr(torch_module, "__all__", None) or [name for name in vars(torch_module) if not name.startswith("_")]
    missing = []
    for name in public:
        if hasattr(dcomm_module, name):
            setattr(shim, name, getattr(dcomm_module, name))
        elif getattr(getattr(torch_module, name), "__module__", None) == torch_name:
            missing.append(name)  # defined by torch's module, not merely imported there

    def fall_through(name: str) -> object:
        value = getattr(torch_module, name)
        if not name.startswith("__"):
            print(f"[torch_tests] {torch_name}.{name} read from torch", file=sys.stderr)
        return value

    shim.__getattr__ = fall_through  # type: ignore[method-assign]
    return shim, missing


def install_swaps() -> None:
    """Put the dcomm shims in ``sys.modules`` and on their parent packages."""
    for torch_name, dcomm_name in SWAPS.items():
        shim, missing = make_shim(torch_name, dcomm_name)
        if missing and os.environ.get(TEST_FILE_ENV + "_QUIET") is None:
            print(f"[torch_tests] {torch_name}: torch names dcomm lacks: {missing}", file=sys.stderr)
        parent_name, _, child = torch_name.rpartition(".")
        sys.modules[torch_name] = shim
        setattr(sys.modules[parent_name], child, shim)
    for package in RELOADED:
        importlib.reload(sys.modules[package])
    check_swaps()
    os.environ[TEST_FILE_ENV + "_QUIET"] = "1"  # rank processes do not repeat the list


def check_swaps() -> None:
    """Fail unless torch's names, and the hook enum torch binds at import, lead to dcomm."""
    from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.model_averaging import averagers

    import dcomm.averaging
    import dcomm.ddp

    bound = DDPCommHookType.FP16_COMPRESS.value.keywords["comm_hook"]
    if not (
        default.fp16_compress_hook is dcomm.ddp.fp16_compress_hook
        and bound is dcomm.ddp.fp16_compress_hook
        and averagers.PeriodicModelAverager is dcomm.averaging.PeriodicModelAverager
    ):
        raise RuntimeError("torch_tests: the dcomm swap did not take effect")


def load_test_module(path: Path) -> types.ModuleType:
    """Import the test file under a module name that spawned ranks can import again."""
    if path.name == "distributed_test.py" and "torch" in path.parts:
        return importlib.import_module("torch.testing._internal.distributed.distributed_test")
    sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.stem)


def prepare_distributed_test_env() -> None:
    """The environment torch's ``test_distributed_spawn.py`` expects."""
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "2")
    if "TEMP_DIR" not in os.environ:
        temp_dir = tempfile.mkdtemp(prefix="dcomm_torch_tests_")
        Path(temp_dir, "barrier").touch()
        os.environ["TEMP_DIR"] = temp_dir


def spawn_test_class(module: types.ModuleType) -> type:
    """The ``TestDistBackendWithSpawn`` class of torch's ``test_distributed_spawn.py``."""
    import torch

    class TestDistBackendWithSpawn(module.TestDistBackend, module.DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    name = f"TestDistBackendWithSpawn{os.environ['BACKEND'].upper()}"
    TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = name
    return TestDistBackendWithSpawn


def setup_process() -> types.ModuleType | None:
    """Swap modules and import the test file; runs in the main process and in every rank."""
    test_file = os.environ.get(TEST_FILE_ENV)
    if test_file is None:
        return None
    path = Path(test_file)
    if path.name == "distributed_test.py":
        prepare_distributed_test_env()
    import torch.distributed
    import torch.distributed.algorithms.ddp_comm_hooks
    import torch.distributed.optim  # noqa: F401

    if os.environ.get(TORCH_ONLY_ENV) is None:
        install_swaps()
    module = load_test_module(path)
    if hasattr(module, "DistributedTest"):
        spawn_class = spawn_test_class(module)
        # Rank processes unpickle the class from __main__ (this file re-imported), as in torch.
        globals()[spawn_class.__name__] = spawn_class
    return module


def main(argv: list[str]) -> int:
    """Run the test file given in ``argv`` with unittest; return the exit status."""
    torch_only = "--torch-only" in argv
    argv = [arg for arg in argv if arg != "--torch-only"]
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0]).resolve()
    if not path.is_file():
        print(f"test file {str(path)!r} does not exist; pass the path of a torch test file", file=sys.stderr)
        return 2
    os.environ[TEST_FILE_ENV] = str(path)
    if torch_only:
        os.environ[TORCH_ONLY_ENV] = "1"
    module = setup_process()
    assert module is not None
    if hasattr(module, "DistributedTest"):
        spawn_name = f"TestDistBackendWithSpawn{os.environ['BACKEND'].upper()}"
        suite_module: types.ModuleType = sys.modules[__name__]
        unittest_argv = [sys.argv[0], spawn_name, *argv[1:]]
    else:
        suite_module = module
        unittest_argv = [sys.argv[0], *argv[1:]]
    program = unittest.main(module=suite_module, argv=unittest_argv, exit=False)
    return 0 if program.result.wasSuccessful() else 1


if __name__ in ("__main__", "__mp_main__"):
    # Rank processes re-run this file as __mp_main__: the swap must happen there too.
    if __name__ == "__mp_main__":
        setup_process()
    else:
        sys.exit(main(sys.argv[1:]))
