"""``hatch run demo -- --config ft``: the demo's language model on torchft, with a replica killed twice.

Three replicas (one process each, gloo on the CPU; a torchft lighthouse in this process) train the
demo's small GPT (:mod:`tools.demo_lm`) with DiLoCo at H = 10. Three runs, the same data:

- ``dcomm, no failures``: ``DiLoCoOptimizer(manager=...)``;
- ``dcomm, 2 kills``: the same, with replica 2 killed (SIGKILL) inside sync 6, right after joining
  its quorum, and replica 1 inside sync 16; each is restarted at once and heals from a live peer;
- ``torchft DiLoCo, 2 kills``: torchft's own ``DiLoCo`` under the same failures (the model and the
  inner optimizer registered with the manager so that restarted replicas heal too).

Each replica writes the validation loss after every other sync; the chart ``ft-demo/loss.png``
plots it against the step with the kills marked, and the run prints how far each run ends from the
run without failures (goal for dcomm: within 1%). torchft's survivors throw away the last H inner
steps at each failed sync; dcomm's lose none.

Example::

    python -m tools.demo_ft --steps 600   # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dcomm_testing.torchft_replicas import die_after_quorum, make_manager, start_lighthouse
from tools.demo_lm.config import CONFIGS
from tools.demo_lm.corpus import Corpus
from tools.demo_lm.model import next_byte_loss

REPLICAS = 3
SYNC_EVERY = 10
KILLS = {2: 6, 1: 16}
"""Replica -> the sync inside which it dies (right after joining that sync's quorum)."""
RUNS = ("dcomm, no failures", "dcomm, 2 kills", "torchft DiLoCo, 2 kills")


def replica_main(replica: int, lighthouse: str, folder: str, run: str, steps: int, die: int, barrier: Any) -> None:
    """Train one replica of ``run`` to ``steps``; log ``{step, loss}`` to ``folder/<replica>.jsonl``."""
    torch.set_num_threads(1)
    config = CONFIGS["small"]
    corpus = Corpus.load(config.corpus_bytes)
    val_x, val_y = corpus.validation(config.val_windows, config.context)
    manager = make_manager(replica, lighthouse, init_sync=False, timeout_s=10.0, quorum_timeout_s=120.0)
    model = config.new_model()
    inner = torch.optim.AdamW(model.parameters(), lr=config.lr)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    if barrier is not None:
        barrier.wait(timeout=120)
    if die:  # quorums: the first (dcomm only), then one per sync
        die_after_quorum(manager, die + (0 if run.startswith("torchft") else 1))
    log = (Path(folder) / f"{replica}.jsonl").open("a")

    def evaluate(step: int) -> None:
        with torch.no_grad():
            loss = next_byte_loss(model(val_x), val_y).item()
        log.write(json.dumps({"step": step, "loss": loss, "replica": replica, "time": time.time()}) + "\n")
        log.flush()

    def train_step(step: int) -> None:
        x, y = corpus.batch(step, replica, config.batch_size, config.context)
        next_byte_loss(model(x), y).backward()

    if run.startswith("torchft"):
        _torchft_loop(manager, model, inner, outer, steps, train_step, evaluate)
    else:
        from dcomm.averaging import DiLoCoOptimizer

        opt = DiLoCoOptimizer(inner, outer, SYNC_EVERY, manager=manager)
        while opt.inner_steps < steps:
            step = opt.inner_steps + 1
            opt.zero_grad()
            train_step(step)
            opt.step()
            if opt.inner_steps % (2 * SYNC_EVERY) == 0:
                evaluate(opt.inner_steps)
    manager.shutdown(wait=False)


def _torchft_loop(manager: Any, model: Any, inner: Any, outer: Any, steps: int, train_step: Any, evaluate: Any) -> None:
    """torchft's DiLoCo; the model, inner optimizer and step are registered so that a joiner heals."""
    from torchft.local_sgd import DiLoCo

    progress = {"step": 0}

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict(), "step": progress["step"]}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        progress["step"] = state["step"]

    manager.register_state_dict_fn("demo", load_state_dict, state_dict)
    with DiLoCo(manager, [model], inner, outer, sync_every=SYNC_EVERY, backup_device=torch.device("cpu")):
        while progress["step"] < steps:
            progress["step"] += 1
            inner.zero_grad()
            train_step(progress["step"])
            inner.step()
            if progress["step"] % (2 * SYNC_EVERY) == 0:
                evaluate(progress["step"])


def run_one(run: str, folder: Path, steps: int) -> list[dict[str, Any]]:
    """Run ``run`` with 3 replicas (killing and restarting per ``KILLS`` when it has kills)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.jsonl"):
        stale.unlink()
    lighthouse = start_lighthouse()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(REPLICAS)
    kills = dict(KILLS) if "kills" in run else {}  # popped as the replicas die

    def start(replica: int, die: int, first: bool) -> Any:
        args = (replica, lighthouse.address(), str(folder), run, steps, die, barrier if first else None)
        proc = ctx.Process(target=replica_main, args=args)
        proc.start()
        return proc

    procs = {i: start(i, kills.get(i, 0), True) for i in range(REPLICAS)}
    events = []
    deadline = time.time() + 1200
    try:
        while any(p.is_alive() for p in procs.values()):
            if time.time() > deadline:
                raise RuntimeError(f"{run}: still running after 20 minutes")
            for replica, proc in procs.items():
                if proc.exitcode is not None and proc.exitcode < 0 and replica in kills:
                    events.append({"replica": replica, "sync": kills.pop(replica), "time": time.time()})
                    procs[replica] = start(replica, 0, False)
            time.sleep(0.1)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    records = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    return [{"kills": events}, *sorted(records, key=lambda r: (r["step"], r["replica"]))]


def curve(records: list[dict[str, Any]]) -> dict[int, float]:
    """Validation loss per step: the mean over the replicas that logged it (equal after a sync)."""
    by_step: dict[int, list[float]] = {}
    for r in records:
        if "step" in r:
            by_step.setdefault(r["step"], []).append(r["loss"])
    return {step: sum(v) / len(v) for step, v in sorted(by_step.items())}


def chart(curves: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {RUNS[0]: ("k", "-"), RUNS[1]: ("tab:blue", "--"), RUNS[2]: ("tab:red", ":")}
    for name, points in curves.items():
        color, line = styles[name]
        ax.plot(list(points), list(points.values()), color=color, linestyle=line, marker=".", label=name)
    for i, (replica, sync) in enumerate(sorted(KILLS.items(), key=lambda kv: kv[1])):
        label = "a replica killed (SIGKILL) inside this sync" if i == 0 else None
        ax.axvline(sync * SYNC_EVERY, color="grey", linewidth=1, alpha=0.6, label=label)
        ax.text(sync * SYNC_EVERY, ax.get_ylim()[1], f" replica {replica}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("inner step")
    ax.set_ylabel("validation loss (next byte)")
    ax.set_title(f"DiLoCo on torchft, 3 replicas, H = {SYNC_EVERY}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="ft", help="ignored (tools.demo dispatches --config ft here)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=Path("ft-demo"))
    args, _ = parser.parse_known_args(argv)
    curves, kills = {}, {}
    for run in RUNS:
        started = time.time()
        records = run_one(run, args.out / run.replace(", ", "-").replace(" ", "_"), args.steps)
        kills[run] = records[0]["kills"]
        curves[run] = curve(records[1:])
        print(
            f"{run}: {len(kills[run])} kills, {time.time() - started:.0f} s, "
            f"final loss {list(curves[run].values())[-1]:.4f}"
        )
    chart(curves, args.out / "loss.png")
    (args.out / "curves.json").write_text(json.dumps({r: {str(s): v for s, v in c.items()} for r, c in curves.items()}))
    base = curves[RUNS[0]]
    last = max(base)
    for run in RUNS[1:]:
        gap = curves[run].get(last, float("nan")) / base[last] - 1
        print(f"{run}: ends {gap:+.2%} from the run without failures at step {last} (dcomm's goal: within 1%)")
    print(f"chart: {args.out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
