"""Importing dcomm changes nothing in torch: every attribute of torch's distributed namespaces keeps its identity.

The check runs in a fresh interpreter (the test process has imported dcomm long before), which
snapshots the namespaces dcomm could be tempted to patch, imports every public module of the
four distributions, and compares identities attribute by attribute.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

_PROGRAM = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.optim as dist_optim
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.algorithms.model_averaging import averagers, utils
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    c_module = torch._C._distributed_c10d
    namespaces = {
        "torch.distributed": dist,
        "distributed_c10d": c10d,
        "torch._C._distributed_c10d": c_module,
        "torch.distributed.optim": dist_optim,
        "ProcessGroup": c_module.ProcessGroup,
        "Backend": c_module.Backend,
        "GradBucket": c_module.GradBucket,
        "Reducer": c_module.Reducer,
        "Work": c_module.Work,
        "DistributedDataParallel": DistributedDataParallel,
        "FullyShardedDataParallel": FullyShardedDataParallel,
        "ZeroRedundancyOptimizer": dist_optim.ZeroRedundancyOptimizer,
        "default_hooks": default_hooks,
        "powerSGD_hook": powerSGD_hook,
        "averagers": averagers,
        "model_averaging.utils": utils,
        "torch.Tensor": torch.Tensor,
        "torch.futures.Future": torch.futures.Future,
        "torch.autograd.Variable": torch.autograd.Variable,
        "torch.optim.Optimizer": torch.optim.Optimizer,
    }

    def snapshot():  # the values themselves: an id alone could be reused by a replacement
        return {
            (space, name): value
            for space, obj in namespaces.items()
            for name, value in list(vars(obj).items())
        }

    before = snapshot()
    imported = []
    for dist_name in ("core", "ddp", "fsdp", "averaging"):
        package = importlib.import_module(f"dcomm.{dist_name}")
        imported.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if ".csrc" in info.name:
                continue
            importlib.import_module(info.name)
            imported.append(info.name)
    after = snapshot()
    missing = object()
    changed = sorted(f"{space}.{name}" for key in before.keys() | after.keys()
                     for space, name in [key] if before.get(key, missing) is not after.get(key, missing))
    print(len(imported), "modules imported")
    if changed:
        print("CHANGED:", ", ".join(changed))
        sys.exit(1)
    """
)


def test_importing_every_dcomm_module_changes_nothing_in_torch() -> None:
    result = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "modules imported" in result.stdout
