"""PowerSGD that resumes from a checkpoint: error feedback, P/Q and the random stream come back.

    torchrun --nproc-per-node 2 examples/powersgd_resume.py --stop-after 20   # stops at step 20
    torchrun --nproc-per-node 2 examples/powersgd_resume.py                   # resumes at step 20
    torchrun --nproc-per-node 2 examples/powersgd_resume.py --backend nccl    # one GPU per rank

Each rank saves its model, optimizer and ``PowerSGDState`` every ``--save-every`` steps into
``--checkpoint-dir`` and, when a checkpoint is there at start, loads it and carries on from its
step. torch's ``PowerSGDState`` has no ``state_dict()``: resuming there restarts the error
feedback and draws new random matrices. (A new DDP model's first step uses DDP's initial
buckets; the error memory of a bucket whose layout DDP then changes restarts, so the resumed run
is close to the one that never stopped, not bit-identical.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dcomm.ddp import PowerSGDState, powerSGD_hook


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stop-after", type=int, default=None, help="stop at this step, as a failed job would")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default="powersgd-checkpoint")
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
    target = torch.randn(64, 8, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=5)
    ddp.register_comm_hook(state, powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)

    checkpoint = Path(args.checkpoint_dir) / f"rank{rank}.pt"
    start = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["powersgd"])  # into the state DDP already holds
        start = saved["step"]
        if rank == 0:
            print(f"resumed at step {start}")

    data = torch.Generator(device=device)
    stop = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
    for step in range(start, stop):
        data.manual_seed(1000 * step + rank)  # the batch depends on the step: a resumed run sees the same data
        x = torch.randn(32, 64, device=device, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        optimizer.zero_grad()
        loss.backward()  # compressed to rank-2 factors after 5 fp32 steps
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
        if (step + 1) % args.save_every == 0 or step + 1 == stop:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            torch.save(saved | {"powersgd": state.state_dict()}, checkpoint)
    if rank == 0:
        print(f"stopped at step {stop}" if stop < args.steps else f"done: {args.steps} steps")


if __name__ == "__main__":
    main()
