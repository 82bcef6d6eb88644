"""average_parameters replayed as a CUDA graph, end to end on 2 GPUs (the values are checked by the
integration suite's ``averaging_replayed_as_graphs`` scenario; here: the process still exits)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

WORKER = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed import destroy_process_group  # before dcomm: the DDP tutorial's form
    from dcomm.averaging import _recipes as recipes, average_parameters

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    params = [torch.full((n,), float(rank), device="cuda") for n in (3, 300_000, 17, 5_000)]
    for _ in range(4):  # the third call is captured, the fourth replayed
        average_parameters(params)
    torch.cuda.synchronize()
    assert all(torch.all(p == 0.5) for p in params), [p[:3] for p in params]
    assert len(recipes._GRAPHS[params[0].device][0]) == 1, "nothing was captured"
    if os.environ["DESTROY"] == "1":
        destroy_process_group()
    print("done", rank, flush=True)
    """
)


@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("destroy", ["1", "0"])
def test_a_process_with_a_replayed_average_exits(tmp_path: Path, destroy: str) -> None:
    """A CUDA graph holding NCCL collectives alive at exit hangs it (pytorch/pytorch#115388); the
    graphs are released at exit, or before the group is destroyed through torch's own
    ``destroy_process_group`` (imported before dcomm), with graphs on by default."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    env = {key: value for key, value in os.environ.items() if key != "DCOMM_CUDA_GRAPHS"}
    env.update(DESTROY=destroy, NCCL_NVLS_ENABLE="0")
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("done") == 2, done.stdout
