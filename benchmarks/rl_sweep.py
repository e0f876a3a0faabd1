"""What limits RL learning on a task: one `shardwise rl` job per setting, reward curves side by side.

Each row runs the real command (`python -m shardwise.cli rl <config> --nproc N ...`) in a
fresh run folder with the row's overrides on top of the config, for the same number of
steps, and reads its metrics.jsonl and printed summary:

- the mean reward of the first 5 steps and of the last 5, and their difference;
- the held-out greedy accuracy before and after, and pass@1 / pass@n sampled at the
  rollout temperature (the job's own evaluation);
- the KL to the reference at the end, the entropy, seconds per step.

    python benchmarks/rl_sweep.py                                  # builtin:arithmetic (the old demo task)
    python benchmarks/rl_sweep.py --config examples/grpo_reverse.yaml --rows base,lr3e-5,n4,no_kl

The arithmetic rows start from runs/sft_arithmetic/hf (built with examples/sft_arithmetic.yaml
when missing); `--config` / `--model` choose another job. Writes rl_sweep.{json,md,png} to
--out (default results/rl_sweep[_<task>]) and prints the table. Needs ray.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _rl_job import run_rl
from harness import pyplot, trailing_mean

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIG = REPO / "examples" / "grpo_arithmetic.yaml"

ROWS: dict[str, list[str]] = {
    # the config as written (arithmetic: 64 prompts x 8 samples, lr 1e-4 after 5 warmup
    # steps, low-var KL loss 0.001, token-mean, clip 0.2, T 1, one mini-batch)
    "base": [],
    "lr3e-5": ["train.optimizer.lr=3e-5"],
    "lr1e-3_warmup10": ["train.optimizer.lr=1e-3", "train.scheduler.warmup_steps=10"],
    "n4": ["rl.rollout.n=4"],
    "n16": ["rl.rollout.n=16"],
    "prompts_x2": ["train.global_batch_size=128"],
    "no_kl": ["rl.actor.kl_loss.enabled=false", "rl.reference.enabled=false"],
    "kl0.05": ["rl.actor.kl_loss.coef=0.05"],
    "seq_mean_token_mean": ["rl.actor.loss_agg_mode=seq-mean-token-mean"],
    "clip_high0.28": ["rl.actor.clip_ratio_high=0.28"],
    "temp0.7": ["rl.rollout.temperature=0.7"],
    "mini_batches4": ["rl.actor.ppo_mini_batches=4"],
}


def ensure_model(args: argparse.Namespace) -> None:
    """The arithmetic SFT model, trained once (examples/sft_arithmetic.yaml) when missing."""
    if args.model is not None or args.config != CONFIG or (REPO / "runs" / "sft_arithmetic" / "hf").is_dir():
        return
    print("building runs/sft_arithmetic/hf (examples/sft_arithmetic.yaml)", flush=True)
    subprocess.run([sys.executable, "-m", "shardwise.cli", "train", str(REPO / "examples" / "sft_arithmetic.yaml"),
                    "--nproc", str(args.nproc)], check=True, cwd=REPO)


def run_one(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    model = [f"model.path={args.model}"] if args.model else []
    job = run_rl(args.config, args.out / "runs" / name,
                 [f"train.max_steps={args.steps}", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
                  "train.log_every=1", f"run.seed={args.seed}", *model, *overrides],
                 nproc=args.nproc, log=args.out / "logs" / f"{name}.log", timeout=args.timeout)
    wall = job["wall_s"]
    if "error" in job:
        return {"name": name, "overrides": overrides, "error": job["error"], "wall_s": wall}
    steps = job["steps"]
    greedy = re.search(r"held-out accuracy \(greedy\): before RL ([0-9.]+)%, after RL ([0-9.]+)%", job["stdout"])
    sampled = re.findall(r"(pass@\d+) ([0-9.]+)% -> ([0-9.]+)%", job["stdout"])
    reward = [m["reward/mean"] for m in steps]
    return {
        "name": name, "overrides": overrides, "wall_s": wall, "steps": len(steps),
        "step_s": statistics.fmean(m["time/step"] for m in steps[1:] or steps),
        "reward": reward, "kl": [m.get("kl", 0.0) for m in steps], "entropy": [m.get("entropy", 0.0) for m in steps],
        "reward_first5": statistics.fmean(reward[:5]), "reward_last5": statistics.fmean(reward[-5:]),
        "greedy_before": float(greedy.group(1)) if greedy else None,
        "greedy_after": float(greedy.group(2)) if greedy else None,
        "sampled": {k: (float(a), float(b)) for k, a, b in sampled},
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [("| row | overrides | reward steps 1-5 -> last 5 | change | held-out greedy before -> after | "
              "pass@1 / pass@n after | KL end | entropy end | s / step |"),
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        over = " ".join(f"`{o}`" for o in r["overrides"]) or "(the config)"
        if "error" in r:
            lines.append(f"| {r['name']} | {over} | failed: {r['error']} |" + " |" * 6)
            continue
        passes = " / ".join(f"{b:.1f}%" for _, b in r["sampled"].values())
        lines.append(
            f"| {r['name']} | {over} | {r['reward_first5']:.3f} -> {r['reward_last5']:.3f} | "
            f"{r['reward_last5'] - r['reward_first5']:+.3f} | {r['greedy_before']}% -> {r['greedy_after']}% | "
            f"{passes} | {r['kl'][-1]:.3f} | {r['entropy'][-1]:.3f} | {r['step_s']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(14, 5))
    for r in rows:
        if "reward" not in r:
            continue
        x = range(1, len(r["reward"]) + 1)
        ax_r.plot(x, trailing_mean(r["reward"], 5), label=r["name"])
        ax_k.plot(x, r["kl"], label=r["name"])
    ax_r.set_title(f"{title}: mean reward per step (moving average of 5)")
    ax_k.set_title("KL to the reference (k1, nats/token)")
    for ax in (ax_r, ax_k):
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--model", default=None, help="model.path (default: the config's)")
    p.add_argument("--rows", default=",".join(ROWS), help="rows: " + ", ".join(ROWS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.config = args.config.resolve()
    task = args.config.stem.replace("grpo_", "")
    args.out = args.out or REPO / "results" / ("rl_sweep" if args.config == CONFIG else f"rl_sweep_{task}")
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_model(args)
    rows = []
    for name in args.rows.split(","):
        if name not in ROWS:
            p.error(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
        r = run_one(name, ROWS[name], args)
        rows.append(r)
        print(f"{name}: " + (f"failed: {r['error']}" if "error" in r else
                             f"reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f}, held-out "
                             f"{r['greedy_before']}% -> {r['greedy_after']}%, {r['step_s']:.2f} s/step"), flush=True)
    md = (f"`shardwise rl {args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config} "
          f"--nproc {args.nproc}`, {args.steps} steps per row, seed {args.seed}, {platform.machine()} "
          f"{os.cpu_count()} CPUs.\n\n" + table(rows))
    (args.out / "rl_sweep.md").write_text(md + "\n")
    (args.out / "rl_sweep.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "rows": rows}, indent=2) + "\n")
    plot(rows, args.out / "rl_sweep.png", task)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
