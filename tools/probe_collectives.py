"""How long one int8 bucket's bytes take through each NCCL collective, on the link under test.

The int8/fp8 hooks' two-shot reduction is an all-to-all then an all-gather of quantized chunks.
This times, for one bucket (25 MiB of fp32 values, about 6.6 MB of codes), the collectives it
could be built from against the fp32 and bf16 allreduces of the same values: each op alone,
barrier-separated, median of ``--repeats``, slowest rank. ``all_to_all 2 comms`` splits the
all-to-all over two communicators running at once; ``rs+ag u8`` is a reduce-scatter and an
all-gather of the same bytes (wrong sums for codes; it times the transport a ring gives).

Example::

    torchrun --nproc-per-node 4 -m tools.probe_collectives --tag fast
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \\
        torchrun --nproc-per-node 4 -m tools.probe_collectives --tag slow
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

BUCKET_VALUES = 25 * 2**20 // 4
BLOCK = 256  # values per float32 scale, as the hooks quantize


def timed(op: Callable[[], None], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``op`` on the current stream, the slowest rank's."""
    times = []
    for _ in range(warmup + repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    slowest = torch.tensor([statistics.median(times[warmup:])], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def collectives(rank: int, world: int) -> dict[str, Callable[[], None]]:
    """The ops to time, on buffers of one bucket's values and codes."""
    codes_bytes = BUCKET_VALUES + BUCKET_VALUES // BLOCK * 4
    codes_bytes -= codes_bytes % (2 * world)
    values = torch.randn(BUCKET_VALUES, device="cuda")
    halves = values.bfloat16()
    codes = torch.randint(0, 255, (codes_bytes,), dtype=torch.uint8, device="cuda")
    received = torch.empty_like(codes)
    chunk = torch.empty(codes_bytes // world, dtype=torch.uint8, device="cuda")
    second = dist.new_group(list(range(world)))
    side = torch.cuda.Stream()

    def pairwise() -> None:
        size = codes_bytes // world
        ops = []
        for peer in (p for p in range(world) if p != rank):
            ops.append(dist.P2POp(dist.isend, codes[peer * size : (peer + 1) * size], peer))
            ops.append(dist.P2POp(dist.irecv, received[peer * size : (peer + 1) * size], peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def two_communicators() -> None:
        rows, out = codes.view(world, -1), received.view(world, -1)
        half = rows.shape[1] // 2
        first, last = rows[:, :half].contiguous(), rows[:, half:].contiguous()
        got_first, got_last = torch.empty_like(first), torch.empty_like(last)
        side.wait_stream(torch.cuda.current_stream())
        work = dist.all_to_all_single(got_first, first, async_op=True)
        with torch.cuda.stream(side):
            other = dist.all_to_all_single(got_last, last, group=second, async_op=True)
        work.wait()
        other.wait()
        torch.cuda.current_stream().wait_stream(side)
        out[:, :half].copy_(got_first)
        out[:, half:].copy_(got_last)

    return {
        "allreduce fp32": lambda: dist.all_reduce(values),
        "allreduce bf16": lambda: dist.all_reduce(halves),
        "all_to_all": lambda: dist.all_to_all_single(received, codes),
        "all_to_all p2p": pairwise,
        "all_to_all 2 comms": two_communicators,
        "all_gather": lambda: dist.all_gather_into_tensor(received, chunk),
        "reduce_scatter u8": lambda: dist.reduce_scatter_tensor(chunk, codes),
        "two-shot a2a+ag": lambda: (
            dist.all_to_all_single(received, codes),
            dist.all_gather_into_tensor(received, chunk),
        ),
        "rs+ag u8": lambda: (dist.reduce_scatter_tensor(chunk, codes), dist.all_gather_into_tensor(received, chunk)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="", help="printed before every line (the link, say)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per op")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    results = {name: timed(op, args.repeats) for name, op in collectives(rank, world).items()}
    if rank == 0:
        base = results["allreduce fp32"]
        for name, ms in results.items():
            print(f"[probe {args.tag}] {name:22s} {ms:8.3f} ms  {ms / base:6.3f} of fp32 allreduce", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
