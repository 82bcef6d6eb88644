"""Post-local SGD with a hierarchical averager: DDP for a warm-up, then local steps and averaging.

    torchrun --nproc-per-node 2 examples/post_local_sgd.py                  # CPU ranks, gloo
    torchrun --nproc-per-node 4 examples/post_local_sgd.py --backend nccl   # one GPU per rank

For ``--warmup`` steps DDP averages every gradient over the world; after that each node averages
its gradients alone (the intra-node subgroups come from ``LOCAL_WORLD_SIZE``, agreed by every
rank), and ``HierarchicalModelAverager`` averages the parameters in groups of half the world
every 2 steps and over the whole world every 4. The hook state and the optimizer (which holds the
averager's step) are saved together.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.averaging import HierarchicalModelAverager, PostLocalSGDOptimizer
from dcomm.ddp import PostLocalSGDState, post_localSGD_hook


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    try:
        train(args)
    finally:  # once train() has freed the model: a live DDP can make gloo hang here
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    target = torch.randn(32, 1, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=args.warmup)
    ddp.register_comm_hook(state, post_localSGD_hook)

    # period -> group size: the sizes divide the world, the last one is the world.
    periods = {2: max(world // 2, 1), 4: world}
    averager = HierarchicalModelAverager(periods, warmup_steps=args.warmup)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.02), averager)

    data = torch.Generator(device=device).manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(16, 32, device=device, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # the local step, then the averager's
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()},
        f"post-local-sgd-rank{rank}.pt",
    )


if __name__ == "__main__":
    main()
