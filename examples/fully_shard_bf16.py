"""fully_shard (FSDP2) with gradients reduce-scattered in bf16, divided before and after the sum.

    torchrun --nproc-per-node 2 examples/fully_shard_bf16.py                  # CPU ranks, gloo
    torchrun --nproc-per-node 2 examples/fully_shard_bf16.py --backend nccl   # one GPU per rank

``low_precision_mp_policy`` is the ``MixedPrecisionPolicy`` to give ``fully_shard``;
``use_low_precision_reduction`` then installs a reduce-scatter that divides by the pre factor,
sums and divides by the post factor (never ``ReduceOp.AVG``, which gloo lacks), so the same
code runs on both backends. Parameters, gradients and optimizer state stay sharded.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcomm.fsdp import low_precision_mp_policy, use_low_precision_reduction


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
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    target = torch.randn(32, 1, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    policy = low_precision_mp_policy(torch.bfloat16)  # reduce_dtype=torch.bfloat16
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    use_low_precision_reduction(model, torch.bfloat16)  # after fully_shard, before the first backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    data = torch.Generator(device=device).manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(16, 32, device=device, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()  # each rank receives its shard of the averaged gradient, reduced in bf16
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
