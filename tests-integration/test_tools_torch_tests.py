"""tools/torch_tests.py swaps dcomm in, in the main process and in every spawned rank."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A test file written the way torch's tests are: it imports torch's modules by torch's names.
TORCH_STYLE_TEST = textwrap.dedent(
    """
    import unittest

    import torch
    import torch.distributed as dist
    import torch.distributed.algorithms.model_averaging.averagers as averagers
    import torch.distributed.algorithms.model_averaging.utils as model_averaging_utils
    import torch.distributed.optim.post_localSGD_optimizer as post_localSGD_optimizer
    import torch.multiprocessing as mp
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import (
        DDPCommHookType,
        default_hooks as default,
        post_localSGD_hook as post_localSGD,
        powerSGD_hook as powerSGD,
        register_ddp_comm_hook,
    )


    def check_rank(rank, world_size, init_file):
        import dcomm.averaging
        import dcomm.ddp

        assert default.allreduce_hook is dcomm.ddp.allreduce_hook
        assert powerSGD.PowerSGDState is dcomm.ddp.PowerSGDState
        assert post_localSGD.post_localSGD_hook is dcomm.ddp.post_localSGD_hook
        assert averagers.PeriodicModelAverager is dcomm.averaging.PeriodicModelAverager
        assert model_averaging_utils.average_parameters is dcomm.averaging.average_parameters
        opt_class = post_localSGD_optimizer.PostLocalSGDOptimizer
        assert opt_class is dcomm.averaging.PostLocalSGDOptimizer
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, model, None)
        torch.manual_seed(rank)
        model(torch.randn(3, 4)).sum().backward()
        grads = [torch.zeros_like(model.module.weight.grad) for _ in range(world_size)]
        dist.all_gather(grads, model.module.weight.grad)
        assert all(torch.equal(grads[0], grad) for grad in grads)
        del model  # before the group goes: a DDP freed after it can hang the exit on gloo
        dist.destroy_process_group()


    class SwapTest(unittest.TestCase):
        def test_dcomm_in_every_rank(self):
            import tempfile

            with tempfile.TemporaryDirectory() as directory:
                mp.spawn(check_rank, args=(2, f"{directory}/init"), nprocs=2)
    """
)


def run_tool(test_file: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "torch_tests.py"), str(test_file), *options],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_tool_swaps_dcomm_into_spawned_ranks(tmp_path):
    test_file = tmp_path / "test_torch_style_swap.py"
    test_file.write_text(TORCH_STYLE_TEST)

    swapped = run_tool(test_file)
    assert swapped.returncode == 0, swapped.stderr
    assert "Ran 1 test" in swapped.stderr

    # Against torch itself the same file must fail: the identity checks can fail.
    unswapped = run_tool(test_file, "--torch-only")
    assert unswapped.returncode == 1, unswapped.stderr
    assert "AssertionError" in unswapped.stderr


def test_tool_rejects_a_missing_file(tmp_path):
    result = run_tool(tmp_path / "absent.py")
    assert result.returncode == 2
    assert "does not exist" in result.stderr
