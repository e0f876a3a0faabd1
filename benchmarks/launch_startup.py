"""Start-up and end of `shardwise train --nproc N` on a machine without a GPU: forked ranks
against fresh interpreters, and the command's end without the interpreter's teardown.

Runs the same tiny job (examples/tiny_qwen3.yaml, ``--steps`` steps, no checkpoints) as a
new user would, ``python -m shardwise.cli train ... --nproc N``, in turn in three ways:

- ``fresh`` (the baseline, ``SHARDWISE_FRESH_RANKS=1``): torchrun's wrapper and every rank
  are fresh interpreters, each importing torch, transformers and the jobs; the launching
  process ends through the interpreter's exit (``sys.exit(main())``), whose teardown of the
  modules takes 1.4-1.8 s of CPU once torch is imported;
- ``forked_teardown``: the wrapper is a fork of the `shardwise` process and the ranks are
  the wrapper's forks (`shardwise.distributed.launch.fork_ranks`); the launching process
  still ends through the interpreter's exit;
- ``forked`` (the command as shipped): forked, and the launching process ends without that
  teardown (`shardwise.distributed.launch.end_process`: its atexit handlers run, then it exits).

Each run reports the whole command's wall time, the CPU time of all its processes
(``RUSAGE_CHILDREN``: every process of the job is waited for by its parent), the time from
the command's start to the end of its first step (the ``time`` of step 1 in metrics.jsonl),
and the time from rank 0's plot (the job's last file) to the command's exit; the table gives
each figure's mean and range over ``--repeats`` and its ratio to fresh's. Every way trains
the same steps: the final losses must agree.

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
MODES = {"fresh": ("1", True), "forked_teardown": ("0", True), "forked": ("0", False)}
"""mode: (SHARDWISE_FRESH_RANKS, the launching process ends through the interpreter's exit)"""
BY_EXIT = "import sys; from shardwise.cli import main; sys.exit(main(sys.argv[1:]))"
COLORS = ("#999999", "#9dbbe8", "#3b7dd8")
FIGURES = (("wall_s", "whole command (s)"), ("cpu_s", "CPU of all its processes (s)"),
           ("first_step_s", "start to end of step 1 (s)"), ("end_s", "plot written to exit (s)"))


def run_once(mode: str, nproc: int, steps: int, work: Path, timeout: float) -> dict:
    run_dir = work / f"{mode}-{time.monotonic_ns()}"
    fresh_ranks, teardown = MODES[mode]
    env = {**os.environ, "SHARDWISE_FRESH_RANKS": fresh_ranks, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *(["-c", BY_EXIT] if teardown else ["-m", "shardwise.cli"]), "train", str(CONFIG), "--nproc", str(nproc), f"run.dir={run_dir}",
           f"train.max_steps={steps}", "checkpoint.every_steps=0", "checkpoint.export_hf=false"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start, t0 = time.time(), time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout:.0f} s"}
    wall, ended = time.perf_counter() - t0, time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        return {"mode": mode, "error": f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1:]}"}
    steps_rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    plotted = (run_dir / "sft.png").stat().st_mtime  # rank 0's last file: what follows is the processes' ends
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"mode": mode, "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "first_step_s": steps_rows[0]["time"] - start, "end_s": ended - plotted,
            "final_loss": steps_rows[-1]["loss"]}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        out[mode] = {key: {"mean": statistics.fmean(r[key] for r in ok), "min": min(r[key] for r in ok),
                           "max": max(r[key] for r in ok)} for key, _ in FIGURES} if ok else {}
    return out


def table(summary: dict, rows: list[dict], nproc: int, steps: int) -> str:
    lines = [f"# `shardwise train --nproc {nproc}`: forked ranks vs fresh interpreters, and the end without "
             "the interpreter's teardown", "",
             f"{os.cpu_count()} CPU cores, no GPU; examples/tiny_qwen3.yaml, {steps} steps; "
             f"{sum(r['mode'] == 'fresh' for r in rows)} runs per way, in turn; mean (min-max); "
             "x: the mean over fresh's.", "",
             "| figure | fresh (baseline) | forked_teardown | x | forked (shipped) | x |", "|---|---|---|---|---|---|"]
    cell = lambda f: f"{f['mean']:.1f} ({f['min']:.1f}-{f['max']:.1f})"  # noqa: E731
    for key, label in FIGURES:
        got = [summary[m].get(key) for m in MODES]
        if not all(got):
            continue
        base = got[0]["mean"]
        lines.append(f"| {label} | {cell(got[0])} | "
                     + " | ".join(f"{cell(f)} | {f['mean'] / base:.2f}" for f in got[1:]) + " |")
    losses = {r["mode"]: r["final_loss"] for r in rows if "final_loss" in r}
    lines += ["", "final loss: " + ", ".join(f"{m} {losses.get(m, float('nan')):.6f}" for m in MODES)]
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
        ax.bar(list(MODES), means, yerr=errs, color=list(COLORS), capsize=4)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(label, fontsize=9)
    fig.suptitle("shardwise train --nproc: fresh interpreters vs forked ranks, with and without the "
                 "interpreter's teardown (mean, min-max)", fontsize=9)
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
            order = list(MODES)[i % len(MODES):] + list(MODES)[:i % len(MODES)]  # each way first in turn
            for mode in order:
                rows.append(run_once(mode, args.nproc, args.steps, Path(work), args.timeout))
                print(f"[{len(rows)}/{len(MODES) * args.repeats}] {json.dumps(rows[-1])}", file=sys.stderr,
                      flush=True)
    summary = summarize(rows)
    (args.out / "launch_startup.json").write_text(json.dumps({"nproc": args.nproc, "steps": args.steps,
                                                              "runs": rows, "summary": summary}, indent=1))
    (args.out / "launch_startup.md").write_text(table(summary, rows, args.nproc, args.steps))
    if all(summary.values()):
        plot(summary, args.out / "launch_startup.png")
    print((args.out / "launch_startup.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
