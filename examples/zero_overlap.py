"""ZeRO overlap: the sharded optimizer steps inside DDP's backward pass, from the first step.

    torchrun --nproc-per-node 2 examples/zero_overlap.py                  # CPU ranks, gloo
    torchrun --nproc-per-node 2 examples/zero_overlap.py --backend nccl   # one GPU per rank

Each rank keeps the Adam state of its share of the parameters only. ``hook_with_zero_step`` wraps
the gradient hook (here ``allreduce_hook``): once the last bucket is averaged each rank updates
its shard and sends it to the others, so the parameters are updated when ``backward()`` returns
and there is no ``optimizer.step()``. torch's hook skips the first updates and refuses gloo;
dcomm's parameters equal DDP with a non-overlapped ``ZeroRedundancyOptimizer`` after every step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.ddp import allreduce_hook, hook_with_zero_step


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    try:
        train(args)
    finally:  # once train() has freed the model: a live DDP can make gloo hang here
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    target = torch.randn(32, 1, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=1e-2)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))

    data = torch.Generator(device=device).manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(16, 32, device=device, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        zero.zero_grad(set_to_none=True)
        loss.backward()  # averages the gradients and steps the optimizer: no zero.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    zero.consolidate_state_dict(to=0)  # every rank calls it; rank 0 receives the whole state
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": zero.state_dict()}, "zero-checkpoint.pt")


if __name__ == "__main__":
    main()
