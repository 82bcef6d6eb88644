"""DDP whose gradients travel as int8 codes with error feedback: about a quarter of fp32's bytes.

    torchrun --nproc-per-node 2 examples/ddp_int8_error_feedback.py                  # CPU ranks, gloo
    torchrun --nproc-per-node 2 examples/ddp_int8_error_feedback.py --backend nccl   # one GPU per rank

``int8_compress_hook`` quantizes each bucket in blocks of 256 values (one fp32 scale each),
averages in two shots (an all-to-all, then an all-gather) so that the bytes do not grow with the
world size, and carries what each rounding lost into the next step. ``fp8_compress_hook`` is the
same with fp8 (e4m3) codes. The state, error memories included, is saved with the model.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.ddp import QuantizedState, int8_compress_hook


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
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    target = torch.randn(64, 1, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    state = QuantizedState(None, error_feedback=True)  # None: the whole world
    ddp.register_comm_hook(state, int8_compress_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.005)

    data = torch.Generator(device=device).manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(16, 64, device=device, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    parameters = sum(p.numel() for p in model.parameters())
    fp32_bytes = 2 * (world - 1) / world * 4 * parameters * args.steps  # a ring allreduce of fp32 gradients
    if rank == 0:
        print(f"sent {state.bytes_sent:,} bytes: {state.bytes_sent / fp32_bytes:.3f} of an fp32 allreduce's")
    torch.save({"model": model.state_dict(), "int8": state.state_dict()}, f"int8-rank{rank}.pt")


if __name__ == "__main__":
    main()
