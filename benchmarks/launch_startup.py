"""Start-up of `shardwise train --nproc N` on a machine without a GPU: forked ranks against
fresh interpreters.

Runs the same tiny job (examples/tiny_qwen3.yaml, ``--steps`` steps, no checkpoints) as a
new user would, ``python -m shardwise.cli train ... --nproc N``, alternately in the two
ways the launcher starts its processes:

- ``fresh`` (the baseline, ``SHARDWISE_FRESH_RANKS=1``): torchrun's wrapper and every rank
  are fresh interpreters, each importing torch, transformers and the jobs;
- ``forked`` (the default here): the wrapper is a fork of the `shardwise` process and the
  ranks are the wrapper's forks (`shardwise.distributed.launch.fork_ranks`).

Each run reports the whole command's wall time, the CPU time of all its processes
(``RUSAGE_CHILDREN``: every process of the job is waited for by its parent), and the time
from the command's start to the end of its first step (the ``time`` of step 1 in
metrics.jsonl); the table gives each figure's mean and range over ``--repeats`` and the
ratio forked / fresh. Both ways train the same steps: the final losses must agree.

    python benchmarks/launch_startup.py --out results/launch_startup
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "tiny_qwen3.yaml"
MODES = {"fresh": "1", "forked": "0"}
FIGURES = (("wall_s", "whole command (s)"), ("cpu_s", "CPU of all its processes (s)"),
           ("first_step_s", "start to end of step 1 (s)"))


def run_once(mode: str, nproc: int, steps: int, work: Path, timeout: float) -> dict:
    run_dir = work / f"{mode}-{time.monotonic_ns()}"
    env = {**os.environ, "SHARDWISE_FRESH_RANKS": MODES[mode], "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", str(CONFIG), "--nproc", str(nproc), f"run.dir={run_dir}",
           f"train.max_steps={steps}", "checkpoint.every_steps=0", "checkpoint.export_hf=false"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start, t0 = time.time(), time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        return {"mode": mode, "error": f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1:]}"}
    steps_rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"mode": mode, "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "first_step_s": steps_rows[0]["time"] - start, "final_loss": steps_rows[-1]["loss"]}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        out[mode] = {key: {"mean": statistics.fmean(r[key] for r in ok), "min": min(r[key] for r in ok),
                           "max": max(r[key] for r in ok)} for key, _ in FIGURES} if ok else {}
    return out


def table(summary: dict, rows: list[dict], nproc: int, steps: int) -> str:
    lines = [f"# `shardwise train --nproc {nproc}` start-up: forked ranks vs fresh interpreters", "",
             f"{os.cpu_count()} CPU cores, no GPU; examples/tiny_qwen3.yaml, {steps} steps; "
             f"{sum(r['mode'] == 'fresh' for r in rows)} runs per way, alternating; mean (min-max).", "",
             "| figure | fresh (baseline) | forked | forked / fresh |", "|---|---|---|---|"]
    for key, label in FIGURES:
        fresh, forked = summary["fresh"].get(key), summary["forked"].get(key)
        if not (fresh and forked):
            continue
        cell = lambda f: f"{f['mean']:.1f} ({f['min']:.1f}-{f['max']:.1f})"  # noqa: E731
        lines.append(f"| {label} | {cell(fresh)} | {cell(forked)} | {forked['mean'] / fresh['mean']:.2f} |")
    losses = {r["mode"]: r["final_loss"] for r in rows if "final_loss" in r}
    lines += ["", f"final loss: fresh {losses.get('fresh', float('nan')):.6f}, "
                  f"forked {losses.get('forked', float('nan')):.6f}"]
    errors = [f"- {r['mode']}: {r['error']}" for r in rows if "error" in r]
    return "\n".join(lines + (["", "unavailable runs:", *errors] if errors else [])) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4 * len(FIGURES), 3.2))
    for ax, (key, label) in zip(axes, FIGURES):
        means = [summary[m].get(key, {}).get("mean", 0.0) for m in MODES]
        errs = [[means[i] - summary[m].get(key, {}).get("min", 0.0) for i, m in enumerate(MODES)],
                [summary[m].get(key, {}).get("max", 0.0) - means[i] for i, m in enumerate(MODES)]]
        ax.bar(list(MODES), means, yerr=errs, color=["#999999", "#3b7dd8"], capsize=4)
        ax.set_title(label, fontsize=9)
    fig.suptitle("shardwise train --nproc: fresh interpreters vs forked ranks (mean, min-max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "results" / "launch_startup")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="launch-startup-") as work:
        for i in range(args.repeats):
            for mode in (("fresh", "forked") if i % 2 == 0 else ("forked", "fresh")):
                rows.append(run_once(mode, args.nproc, args.steps, Path(work), args.timeout))
                print(f"[{len(rows)}/{2 * args.repeats}] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    summary = summarize(rows)
    (args.out / "launch_startup.json").write_text(json.dumps({"nproc": args.nproc, "steps": args.steps,
                                                              "runs": rows, "summary": summary}, indent=1))
    (args.out / "launch_startup.md").write_text(table(summary, rows, args.nproc, args.steps))
    if summary["fresh"] and summary["forked"]:
        plot(summary, args.out / "launch_startup.png")
    print((args.out / "launch_startup.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
