"""The RL rollout on HF `generate` against vLLM: the same `shardwise rl` job, both engines.

Each row runs the real command (`python -m shardwise.cli rl <config> --nproc N ...`) in a
fresh run folder, once per engine, and reads its metrics.jsonl:

- seconds per RL step (mean over the steps after the first, which warms up), the generate
  phase's seconds, and the weight push's (``time/weight_sync``, part of generate; vLLM
  only) with its share of the step;
- the reward per step (the learning curves), the held-out accuracy before and after;
- the rollout/actor log-prob mismatch (``rollout/log_prob_diff_abs_mean`` / ``_max``).

    python benchmarks/rollout_engines.py                          # the demo's job, then 256 new tokens
    python benchmarks/rollout_engines.py --only demo --steps 60   # the demo's full run, both engines

Writes rollout_engines.{json,md,png} to --out (default results/rollout_engines) and prints
the table. Needs ray and vllm (make test installs both); the demo's SFT model
(runs/sft_reverse/hf, `make demo`) unless --model-overrides names another; --smoke (make
test) needs neither vllm nor the SFT model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from _rl_job import run_rl
from harness import pyplot

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIG = REPO / "examples" / "grpo_reverse.yaml"

SCENARIOS = {
    # the demo's sizes: 32 prompts x 8 samples, 8 new tokens
    "demo": [],
    # long responses: up to 256 new tokens. The SFT model answers in ~6 tokens and stops,
    # so this row starts from a random model of the same shape, which rarely samples eos:
    # responses run to the limit (rewards stay ~0; only the time is read here)
    "long": ["model.path=null", ("model.config={model_type: qwen3, hidden_size: 128, intermediate_size: 256, "
                                 "num_hidden_layers: 3, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 32, "
                                 "vocab_size: 64, max_position_embeddings: 512, tie_word_embeddings: false}"),
             "rl.rollout.max_new_tokens=256", "train.global_batch_size=16", "rl.rollout.n=4",
             "train.micro_batch_size=16"],
}
ENGINES = ("hf", "vllm")
SMOKE_MODEL = ("model.config={model_type: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, "
               "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 32, vocab_size: 64, "
               "max_position_embeddings: 64, tie_word_embeddings: false}")
SMOKE_OVERRIDES = ["model.path=null", SMOKE_MODEL, "train.global_batch_size=2", "rl.rollout.n=2",
                   "rl.heldout_eval=false"]
"""--smoke's job: a random 1-layer Qwen3 (no SFT model needed), 2 prompts x 2 samples, no
held-out evaluation."""


def run_one(name: str, engine: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    job = run_rl(CONFIG, args.out / "runs" / f"{name}_{engine}",
                 [f"train.max_steps={args.steps}", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
                  f"rl.rollout.engine={engine}", *args.model_overrides, *overrides],
                 nproc=args.nproc, log=args.out / "logs" / f"{name}_{engine}.log", timeout=args.timeout,
                 env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
    wall = job["wall_s"]
    if "error" in job:
        return {"name": name, "engine": engine, "error": job["error"], "wall_s": wall}
    steps = job["steps"]
    timed = steps[1:] if len(steps) > 1 else steps
    accuracy = [ln for ln in job["stdout"].splitlines() if "held-out accuracy" in ln]

    def mean(key: str) -> float:
        return statistics.fmean(m.get(key, 0.0) for m in timed)

    return {
        "name": name, "engine": engine, "wall_s": wall, "steps": len(steps),
        "step_s": mean("time/step"), "generate_s": mean("time/generate"),
        "weight_sync_s": mean("time/weight_sync"), "weight_sync_bytes": max(m.get("weight_sync/bytes", 0) for m in steps),
        "response_length": mean("response_length/mean"),
        "reward": [m["reward/mean"] for m in steps],
        "diff_abs_mean": mean("rollout/log_prob_diff_abs_mean"),
        "diff_abs_max": max(m.get("rollout/log_prob_diff_abs_max", 0.0) for m in steps),
        "accuracy_line": accuracy[0].strip() if accuracy else "",
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [("| job | engine | s / step | x (hf / this) | generate s | weight sync s | sync share of step | "
              "sync MiB | response tokens | reward first 5 -> last 5 steps | log-prob diff mean / max | held-out |"),
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    by = {(r["name"], r["engine"]): r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['engine']} | unavailable: {r['error']} |" + " |" * 10)
            continue
        hf = by.get((r["name"], "hf"))
        ratio = f"{hf['step_s'] / r['step_s']:.2f}" if hf and "error" not in hf else "n/a"
        rw = r["reward"]
        head, tail = statistics.fmean(rw[:5]), statistics.fmean(rw[-5:])
        lines.append(
            f"| {r['name']} | {r['engine']} | {r['step_s']:.2f} | {ratio} | {r['generate_s']:.2f} | "
            f"{r['weight_sync_s']:.3f} | {r['weight_sync_s'] / r['step_s']:.1%} | "
            f"{r['weight_sync_bytes'] / 2**20:.2f} | {r['response_length']:.1f} | {head:.3f} -> {tail:.3f} | "
            f"{r['diff_abs_mean']:.1e} / {r['diff_abs_max']:.1e} | {r['accuracy_line'].replace('held-out accuracy (greedy): ', '')} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = sorted({r["name"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r in rows:
            if r["name"] == name and "reward" in r:
                ax.plot(range(1, len(r["reward"]) + 1), r["reward"], label=f"{r['engine']} ({r['step_s']:.2f} s/step)")
        ax.set_title(f"{name}: reward per step")
        ax.set_xlabel("step")
        ax.set_ylabel("reward/mean")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help="scenarios: " + ", ".join(SCENARIOS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", type=Path, default=REPO / "results" / "rollout_engines")
    p.add_argument("--model-overrides", nargs="*", default=[], help="e.g. model.path=runs/other/hf")
    p.add_argument("--engines", default=None, help="rollout engines, of (default all): " + ", ".join(ENGINES))
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs (make test): the demo job only, HF engine only (unless "
                        "--engines; vLLM's start-up alone is ~10 s per run), 2 steps, 1 process, "
                        "on a random 1-layer Qwen3 (no SFT model needed); its numbers mean nothing")
    args = p.parse_args()
    engines = list(ENGINES if args.engines is None else [e.strip() for e in args.engines.split(",") if e.strip()])
    if not engines or any(e not in ENGINES for e in engines):
        p.error(f"--engines: choose from {', '.join(ENGINES)}")
    if args.smoke:
        args.only, args.steps, args.nproc = "demo", 2, 1
        engines = engines if args.engines is not None else ["hf"]
        args.model_overrides = [*SMOKE_OVERRIDES, *args.model_overrides]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only.split(","):
        for engine in engines:
            r = run_one(name, engine, SCENARIOS[name], args)
            rows.append(r)
            print(f"{name} {engine}: " + (f"unavailable: {r['error']}" if "error" in r else
                                          f"{r['step_s']:.2f} s/step, weight sync {r['weight_sync_s']:.3f} s"),
                  flush=True)
    md = (f"`shardwise rl examples/grpo_reverse.yaml --nproc {args.nproc}`, {args.steps} steps per run, "
          f"{platform.machine()} {os.cpu_count()} CPUs; means over the steps after the first.\n\n" + table(rows))
    (args.out / "rollout_engines.md").write_text(md + "\n")
    (args.out / "rollout_engines.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                               "rows": rows}, indent=2) + "\n")
    plot(rows, args.out / "rollout_engines.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
