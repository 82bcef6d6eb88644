"""DDP whose gradients travel in bf16: half the bytes of fp32, averaged as torch's hook averages them.

    torchrun --nproc-per-node 2 examples/ddp_bf16.py                  # CPU ranks, gloo
    torchrun --nproc-per-node 2 examples/ddp_bf16.py --backend nccl   # one GPU per rank

torch's ``bf16_compress_hook`` refuses gloo; dcomm's runs on both backends. The model and data are
a toy regression: every rank draws its own batches, and DDP averages the gradients.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.ddp import bf16_compress_hook


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
    torch.manual_seed(0)  # the same initial model on every rank
    target = torch.randn(32, 1, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, bf16_compress_hook)  # None: average over the whole world
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.02)

    data = torch.Generator(device=device).manual_seed(1 + rank)  # each rank its own batches
    for step in range(args.steps):
        x = torch.randn(16, 32, device=device, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        optimizer.zero_grad()
        loss.backward()  # gradients averaged over the ranks, sent as bf16
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
