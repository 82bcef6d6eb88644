"""Benchmark dcomm against torch.distributed.algorithms: interleaved A/B over a workload matrix.

Run from the repository root under torchrun, one rank per GPU (NCCL) or CPU process (gloo)::

    torchrun --standalone --nproc-per-node 4 -m tools.bench --json bench-4gpu-fast.json
    torchrun --standalone --nproc-per-node 4 -m tools.bench --workload transformer --precision bf16-autocast
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \\
        torchrun --standalone --nproc-per-node 4 -m tools.bench --link slow --json slow.json
    torchrun --standalone --nproc-per-node 2 -m tools.bench --size small --quick   # gloo, CPU

Every training case (``ddp``, ``post-local-sgd``, ``zero``, ``fsdp``, ``fully_shard``) runs on
every workload (``mlp-wide``, ``mlp-deep``, ``transformer``, ``gpt-deep``, ``llama``, ``cnn``; see
:mod:`tools.bench.workloads`; ``llama``, with its tied LM head, and ``gpt-deep``, 581 tensors, are
the ones no code was tuned on)
and precision (``fp32``, ``tf32``, ``bf16-autocast``); ``averaging`` averages each workload's
parameters; ``diloco`` trains each workload (fp32) with dcomm's ``DiLoCoOptimizer``, torchft's
``DiLoCo`` (where torchft imports) and DDP, reporting bytes per step and the loss too;
``hook-latency`` times hook calls over many small buckets. Each case builds all its
variants once and times them in shuffled rounds (:mod:`tools.bench.ab`); each compared pair is
reported as the median per-round ratio with a 95% bootstrap interval; ``--control`` adds an A/A
pair per case (its reference built twice, timed against itself: what identical code reads, the
resolution of the case's other ratios). Rank 0 prints the table
and writes the JSON (device, world size, link, torch version, date, every sample);
``python -m tools.bench_chart`` draws it. ``--link slow`` labels the run and picks sizes for
~1 GB/s; the slow link itself is the NCCL environment above. NVLink multicast is always off.
``python -m tools.bench.diloco_overlap`` times DiLoCo's sync steps against plain steps (issue
16's overlap goal; its docstring has the command lines).
"""
