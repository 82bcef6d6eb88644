"""Write the docs' benchmarks page (docs/benchmarks.md) and its charts from the runs in tools/results/.

Every figure on the page comes from a JSON file kept in ``tools/results/`` (written by
``python -m tools.bench --json`` or ``python -m tools.demo``): the page is generated, never edited by
hand, and a test checks that it matches the files. To add a run, keep its JSON file, add a
:class:`Section` to :data:`SECTIONS` and run this module; delete the files the page stops showing.

Example::

    python -m tools.bench_page           # rewrites docs/benchmarks.md and docs/images/bench-*.png
    python -m tools.bench_page --check   # exit 1 when docs/benchmarks.md is not what the files give
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.bench_results import load, rows_of, setup_of
from tools.bench_table import table

__all__ = ["PAGE", "SECTIONS", "Section", "demo_table", "main", "render"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "tools" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
IMAGES = ROOT / "docs" / "images"
REPO = "https://github.com/dcomm-dev/dcomm/blob/main"
DEMO = "demo-gpu-4xh200.json"


@dataclass(frozen=True)
class Section:
    """One run on the page: its JSON file in tools/results/, a title and what to read in it."""

    file: str
    title: str
    text: str

    @property
    def chart(self) -> str:
        return f"bench-{Path(self.file).stem.removeprefix('bench-')}.png"


SECTIONS = (
    Section(
        "bench-2gpu-h200.json",
        "The current code on two GPUs over NVLink",
        "One lease's runs of the current code, merged (`python -m tools.bench_results merge`). DDP "
        "training steps (SGD, TF32 and bf16 autocast) with each hook against DDP's built-in allreduce "
        "(`dcomm/reference`) and torch's hook of the same name (`dcomm/torch`); `C++ vs python`: the "
        "fp16/bf16 hook registered with `native=True` against `native=False`, `python`: that Python hook "
        "against torch's. `average_parameters` (five calls per round, once per workload: precision `-`) "
        "against torch's and against a raw allreduce of the same bytes, `flattened` after "
        "`flatten_parameters`. ZeRO's `hook_with_zero_step` (`step`) against torch's and against "
        "non-overlapped ZeRO; `zero/step C++ vs python` measured its C++ twin, level with Python and since "
        "deleted. int8 and fp8 codes against the built-in and dcomm's bf16 hook, int8 "
        "against torch's uint8 hook, PowerSGD (rank 4) against torch's; `floor` sends nothing. Post-local "
        "SGD, DiLoCo (H = 8) against torchft 0.2.0's and `fully_shard` reducing in fp16/bf16 against "
        "torch's `reduce_dtype`: the last run was cut by its time limit, so DiLoCo and `fully_shard` "
        "ran on the transformer only. torchft's fp8 DiLoCo failed its quantized allreduce (NCCL error 7, "
        "the sync skipped) and ended at loss 10.6: `diloco/fp8` is not a like-for-like time. The DDP "
        "cases ran 5-6 rounds: under bf16 autocast and on `gpt-deep` their A/A intervals are wide.",
    ),
    Section(
        "bench-2gpu-h200-slow-link.json",
        "The current code on two GPUs over a slow link",
        "The same two GPUs with NCCL over sockets only (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "
        "NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo`) and the `large-slow` models, TF32. The fp16/bf16 "
        "hooks halve the bytes and take 0.57-0.61x of the built-in allreduce's step, level with "
        "torch's; `C++ vs python` as above. int8 and fp8 take 0.49-0.58x of the built-in, 0.84-0.96x "
        "of dcomm's bf16 hook. `average_parameters` (five calls a step, about 0.3 s) measures "
        "1.03-1.06x torch's, inside the A/A interval, and 1.05-1.06x a raw allreduce of the same "
        "bytes, over 5 rounds only.",
    ),
    Section(
        "bench-4gpu-h200-zero.json",
        "ZeRO overlap",
        "`hook_with_zero_step` (`step`), `hook_with_zero_step_interleaved` (`interleaved`) and "
        "`reduce_scatter=True` (`+rs`) over `allreduce_hook`, Adam, against torch's "
        "`hook_with_zero_step` and against DDP followed by a non-overlapped `ZeroRedundancyOptimizer` "
        "(`no overlap`). `zero/bound` is the same training with no optimizer step at all: no overlap "
        "can go below it. dcomm's parameters equal non-overlapped ZeRO's after every step, from the "
        "first; torch's hook skips the first updates.",
    ),
    Section(
        "bench-4gpu-h200-averaging.json",
        "Parameter averaging",
        "`average_parameters` over the whole model, five calls per round, against torch's and against "
        "a raw allreduce of the same bytes (one flat buffer). `flattened`: the model after "
        "`flatten_parameters`. Measured before `average_parameters` became one plain in-place path "
        "(it replayed CUDA graphs then, and `eager` is that path without them); the current path, "
        "described in [the design note](design/averaging.md), is measured on two GPUs in the first section. Memory: "
        "torch's flattened copy is the model's size, dcomm's staging at most one bucket.",
    ),
    Section(
        "bench-1gpu-h200-averaging.json",
        "Parameter averaging, the current path, one GPU",
        "The current `average_parameters` (one plain in-place path: large parameters reduced in their "
        "own storage, the others staged through at most `bucket_cap_mb`) at world size 1, five calls "
        "per round. With one rank NCCL moves no bytes (`raw allreduce` is about 0.02 ms a call), so "
        "the `dcomm/reference` ratios here are the host time of a call, not a communication cost; "
        "`dcomm/torch` is meaningful: torch's `average_parameters` copies the whole model twice.",
    ),
    Section(
        "bench-cpu-gloo-averaging.json",
        "Parameter averaging, the current path, gloo on CPU",
        "The current `average_parameters` on 2 gloo ranks sharing one 2-core machine (loopback TCP: "
        "sockets only, hence `slow`), the `large-slow` models (153-177 MiB; the CNN 20 MiB), five calls "
        "per round (ten for the CNN). Against torch's `average_parameters`: 0.63-0.79x on the three "
        "language models, level on the CNN. Against a raw allreduce of the same bytes (which skips the "
        "division): 1.27-1.56x, because on gloo every parameter of 1 MiB or more is an allreduce of its "
        "own and the others are copied through the staging buckets, and two shared cores make the "
        "division and the copies cost time; after `flatten_parameters`, 1.03-1.16x.",
    ),
    Section(
        "bench-1gpu-h200-ddp.json",
        "DDP hooks: C++ against Python, one GPU",
        "DDP training steps (SGD, TF32) at world size 1 with each hook against DDP's built-in "
        "allreduce (`dcomm/reference`) and torch's hook of the same name (`dcomm/torch`). "
        "`C++ vs python`: the same dcomm hook registered with `dcomm.ddp.register_comm_hook(..., "
        "native=True)` against `native=False`; `python`: dcomm's Python hook against torch's. With one "
        "rank no bytes move, so this measures what each path adds to the step. `allreduce_hook`'s C++ "
        "twin, level with its Python hook here, has since been removed.",
    ),
    Section(
        "bench-cpu-gloo-ddp-native.json",
        "DDP hooks: C++ against Python, gloo on CPU",
        "The same C++-against-Python rows at 2 gloo ranks sharing one 2-core machine (small models, "
        "fp32, about 200 rounds each). Measured while `allreduce_hook` still had a C++ twin: it was "
        "level with the Python hook here and on the GPU (slower on the 581-tensor GPT), so it was "
        "removed; the fp16 and bf16 twins are level here, where the step is compute, and stay for "
        "their gain on the GPU above.",
    ),
    Section(
        "bench-4gpu-h200-slow-link-llama.json",
        "Compression hooks on a slow link",
        "A Llama-shaped model (86 tensors, tied head) with bf16 autocast over an emulated slow link: "
        "NCCL over sockets only (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 "
        "NCCL_SOCKET_IFNAME=lo`). The fp16/bf16 hooks halve the bytes and nearly halve the step.",
    ),
    Section(
        "bench-4gpu-h200-slow-link-compression.json",
        "int8, fp8 and PowerSGD on a slow link",
        "The same model and link as above, the day before: `int8_compress_hook` and "
        "`fp8_compress_hook` sending their codes (0.254 of fp32's bytes) with error feedback, "
        "PowerSGD at rank 4 against torch's, and the allreduce and fp16/bf16 hooks against torch's "
        "(`C++ vs python`: the same hook registered on DDP's reducer in C++ and in Python).",
    ),
    Section(
        "bench-cpu-gloo-diloco-ft.json",
        "Fault-tolerant DiLoCo: the cost of torchft's manager, gloo on CPU",
        "The demo's model (`demo-lm`: its small byte-level GPT) at H = 10 on 2 gloo ranks sharing one "
        "2-core machine, fp32, each replica a torchft replica group of one: `DiLoCoOptimizer(manager=...)` "
        "(`dcomm diloco ft`: a quorum and a commit per sync) against `DiLoCoOptimizer(process_group=...)` "
        "and against torchft 0.2.0's `DiLoCo` on the same managers, 351 rounds of one period each. No "
        "failures: all three end on the same loss with the same bytes.",
    ),
    Section(
        "bench-2gpu-h100-diloco.json",
        "DiLoCo against torchft",
        "`DiLoCoOptimizer` and torchft 0.2.0's `DiLoCo` (AdamW inner, SGD Nesterov outer, H = 8) "
        "against DDP with AdamW, fp32 and fp8 pseudo-gradients. Both DiLoCos send 1/8 of DDP's bytes "
        "per inner step in fp32; with fp8, torchft's run diverged (its loss below), dcomm's did not.",
    ),
)

METHOD = """\
Every ratio is measured by `python -m tools.bench`: each case builds all its variants in the same
processes and times them in shuffled rounds (a few steps of each variant per round). The ratio of
two variants is the median over rounds of their per-round ratio, each round's time taken on its
slowest rank, with a 95% bootstrap interval (2,000 draws). Below 1.0 the first variant is faster.
An **A/A control** (the reference built twice and timed against itself) shows the noise floor of
each case: a difference inside the A/A interval is not a difference. `dcomm ms` and `torch ms` are
median step times, `MiB` the peak memory a variant adds. Models: a 16-layer MLP (`mlp-deep`), a
GPT-shaped transformer (149 tensors), a ResNet-shaped CNN (110 tensors), the demo's byte-level GPT
(`demo-lm`), and two models no code was tuned on: a Llama-shaped model (86 tensors, tied head) and
a 48-layer GPT (`gpt-deep`, 581 tensors). NVLink multicast (NVLS) is off; `fast` is NVLink, `slow` sockets only."""


def _aa_controls(run: dict[str, Any]) -> str:
    several = len({case["case"] for case in run["results"]}) > 1  # a merged run: name each control's case
    controls = [
        (f"{row.label.removesuffix('/A-A')} " if several else "")
        + f"{row.workload} {row.precision}: {ratio.ratio:.2f} ({ratio.low:.2f}-{ratio.high:.2f})".replace(" -:", ":")
        for row in rows_of(run)
        for ratio in row.vs_reference
        if row.label.endswith("A-A") and ratio.ratio is not None and ratio.low is not None and ratio.high is not None
    ]
    if not controls:
        return "A/A control: none in this run."
    return "A/A control: " + "; ".join(controls) + "."


def _diloco_runs(run: dict[str, Any]) -> str:
    lines = [
        "| workload | variant | ms per inner step | bytes per inner step | final loss |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in run["results"]:
        for name, variant in case["variants"].items():
            details = variant.get("details", {})
            if "loss" in details:
                lines.append(
                    f"| {case['workload']} | {name} | {variant['median_ms']:.1f} | "
                    f"{details['bytes/inner step']:,} | {details['loss']:.4g} |"
                )
    return "\n".join(lines)


def demo_table(report: dict[str, Any]) -> str:
    """The demo's runs as a Markdown table: final validation loss and bytes against the baseline."""
    runs = [r for r in report["runs"] if not r["error"] and not r["skipped"]]
    baseline = runs[0]
    lines = [
        "| algorithm | impl | final loss | vs baseline | sent per step per rank |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        loss, base = r["val_loss"][-1], baseline["val_loss"][-1]
        per_step = r["bytes_sent"][-1] / max(r["steps"][-1], 1) / 2**20
        lines.append(
            f"| {r['algorithm']} | {r['impl']} | {loss:.4f} | {100 * (loss / base - 1):+.2f}% | {per_step:.1f} MiB |"
        )
    return "\n".join(lines)


def _section(section: Section) -> str:
    run = load(RESULTS / section.file)
    parts = [
        f"## {section.title}",
        "",
        section.text,
        "",
        f"File: [`tools/results/{section.file}`]({REPO}/tools/results/{section.file}).",
        "",
        f"![{section.title}: {setup_of(run)}](images/{section.chart})",
        "",
        table(run),
        "",
        _aa_controls(run),
    ]
    if any(case["case"] == "diloco" for case in run["results"]):
        parts += ["", _diloco_runs(run)]
    return "\n".join(parts)


def render() -> str:
    """The page's Markdown, from the files in tools/results/."""
    demo = load(RESULTS / DEMO)
    header = demo["header"]
    parts = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python -m tools.bench_page` from tools/results/; do not edit by hand. -->",
        "",
        "What dcomm costs and saves against torch, measured on GPUs and, where a section says so, on gloo "
        "ranks on a CPU. Each section names its device, "
        "world size, torch and date; figures are never compared across machines.",
        "",
        "## Method",
        "",
        METHOD,
        "",
        *["\n".join([_section(section), ""]) for section in SECTIONS],
        "## The demo on GPUs",
        "",
        f"`python -m tools.demo --config large --backend nccl --steps 250` on {header['world size']}, "
        f"{header['device']}, torch {header['torch']}, {header['date']}: {header['model']}; {header['data']}. "
        "Each algorithm trains the same model from the same seed; the table shows the final "
        "validation loss against DDP's built-in allreduce and the bytes each rank sent per step. "
        "GPU runs are not deterministic (dcomm's and torch's `allreduce_hook`, the same arithmetic, "
        "end about 1% apart), and 250 steps is short: read differences of a few percent as noise. "
        f"Report: [`tools/results/{DEMO}`]({REPO}/tools/results/{DEMO}).",
        "",
        "![validation loss against bytes sent per rank, 4x H200](images/demo-gpu-loss-vs-bytes.png)",
        "",
        demo_table(demo),
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from what the files give")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python -m tools.bench_page", file=sys.stderr)
            return 1
        print(f"{PAGE.relative_to(ROOT)} matches tools/results/")
        return 0
    from tools.bench_chart import write_chart

    PAGE.write_text(text)
    for section in SECTIONS:
        write_chart([load(RESULTS / section.file)], str(IMAGES / section.chart))
    print(f"wrote {PAGE.relative_to(ROOT)} and {len(SECTIONS)} charts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
