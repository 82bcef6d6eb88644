"""DiLoCo with streaming fragments and int8 pseudo-gradients: a sync every H steps, spread and hidden.

    torchrun --nproc-per-node 2 examples/diloco_fragments.py                  # CPU ranks, gloo
    torchrun --nproc-per-node 2 examples/diloco_fragments.py --backend nccl   # one GPU per rank

No DDP: each rank trains its own replica with AdamW. Every ``--sync-every`` (H) steps the change
of the parameters since the last sync, averaged over the ranks, is the gradient of an outer SGD
with Nesterov momentum. With ``fragments=2`` the model syncs in two halves at different steps,
each sent as int8 codes (error feedback keeps what rounding lost) and applied one step later
(``fragment_sync_delay=1``), so the transfer runs behind a step of compute. Each rank sends about
1/(4H) of DDP's fp32 bytes per step. Replicas are equal after every sync.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dcomm.averaging import DiLoCoOptimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sync-every", type=int, default=10)
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
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    optimizer = DiLoCoOptimizer(
        inner, outer, sync_every=args.sync_every, fragments=2, fragment_sync_delay=1, compression="int8"
    )

    data = torch.Generator(device=device).manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(16, 32, device=device, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        optimizer.step()  # the inner step; a fragment's sync where the schedule says
        optimizer.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    parameters = sum(p.numel() for p in model.parameters())
    if rank == 0:
        per_step = optimizer.bytes_sent / args.steps / parameters
        print(f"sent {optimizer.bytes_sent:,} bytes: {per_step:.3f} per parameter per step (DDP in fp32: about 4)")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"diloco-rank{rank}.pt")


if __name__ == "__main__":
    main()
