"""Developer tools of the dcomm monorepo, run from the repository root as modules.

Example::

    torchrun --standalone --nproc-per-node 2 -m tools.bench --size small --quick
    python -m tools.demo --world-size 2 --steps 10
    python -m tools.bench_chart tools/results/bench-4gpu-h200-zero.json --out chart.png
"""
