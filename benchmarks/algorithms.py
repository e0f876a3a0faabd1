"""The RL algorithms' recipes on the long task: steps and time to a held-out accuracy, and the final one.

Each recipe is a config in examples/ on ``builtin:count`` (answers of 8 to 98 tokens), all
from the same SFT model (examples/sft_long.yaml's, or --model), each run `--seeds` times
(seeds run.seed, run.seed + 1, ...) with the real command
``python -m shardwise.cli rl <recipe> --nproc N`` in a fresh run folder (`_rl_job.run_rl`):

- ``grpo``: examples/grpo_long.yaml, plain GRPO (PPO's clipped loss, token-mean, the std
  normalisation, a low-variance KL term against the reference): the baseline;
- ``dapo``: examples/dapo.yaml (clip-higher, token-level loss, dynamic sampling, soft
  overlong punishment, no KL);
- ``gspo``: examples/gspo.yaml (one clipped ratio per sequence);
- ``dr_grpo``: examples/dr_grpo.yaml (no std normalisation, seq-mean-token-sum-norm);
- ``cispo``: examples/cispo.yaml (clipped importance weights on REINFORCE).

Every recipe runs as it is written but for ``model.path``, ``run.seed``, ``train.max_steps``
and the evaluation: the greedy accuracy on the task's held-out prompts (``eval.num_prompts``,
``--eval-prompts``; drawn from run.seed, so every recipe of a seed is scored on the same
prompts) at step 0, every ``--eval-every`` steps
and at the end (``eval.n=0``: no sampled pass). The recipes round robin, one seed per round,
every other round in reverse order, so a machine that gets faster or slower favours none.

Figures per recipe (each the mean over seeds [min, max]):

- held-out accuracy at step 0 (the SFT model's), at the end (the final one) and the best;
- steps and train seconds to ``--target`` held-out accuracy: the first evaluation at or above
  it (so steps are a multiple of --eval-every, or the last step) and the sum of ``time/step``
  up to that step (training only: start-up and the evaluations apart); the seeds that never
  reached it are counted;
- s / step (the steps after the first), the final mean training reward (last --window steps),
  the mean response length, start-up and wall seconds.

    python benchmarks/algorithms.py                        # 5 recipes x 3 seeds x 30 steps (make bench)
    python benchmarks/algorithms.py --seeds 1 --steps 20   # one seed each, shorter
    python benchmarks/algorithms.py --only gspo,cispo      # some recipes
    python benchmarks/algorithms.py --smoke --model runs/sft_reverse/hf   # gspo, 1 step, tiny (make test)

Needs the SFT model of the long task (``shardwise train examples/sft_long.yaml --nproc 2``, or
--model). Writes algorithms.{json,md,png} to --out (default results/algorithms), each run's
log to logs/ and run folder to runs/, and prints the table.
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
from harness import REPO, LoadSampler, over_seeds, show, trailing_mean
from rl_vs_trl import installed

from shardwise.config import load_config

RECIPES = {
    "grpo": REPO / "examples" / "grpo_long.yaml",
    "dapo": REPO / "examples" / "dapo.yaml",
    "gspo": REPO / "examples" / "gspo.yaml",
    "dr_grpo": REPO / "examples" / "dr_grpo.yaml",
    "cispo": REPO / "examples" / "cispo.yaml",
}
"""Each algorithm's recipe; grpo (the first) is the baseline."""
SMOKE = ["train.global_batch_size=2", "rl.rollout.n=2", "rl.rollout.max_new_tokens=16"]
"""--smoke's sizes on top of the recipe (with eval.num_prompts 4): its numbers mean nothing."""


def run_recipe(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One recipe's run at `seed`: its steps (``t``: training seconds so far, the sum of
    ``time/step``), its evaluations (step, held-out accuracy) and the figures derived from them."""
    config = RECIPES[name]
    folder = args.out / "runs" / name / f"seed_{seed}"
    overrides = [f"model.path={args.model}", f"run.seed={seed}", f"train.max_steps={args.steps}",
                 "train.log_every=1", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
                 f"eval.every_steps={args.eval_every}", f"eval.num_prompts={args.eval_prompts}", "eval.n=0",
                 *args.sizes, *args.extra]
    with LoadSampler() as load:
        job = run_rl(config, folder, overrides, nproc=args.nproc, log=args.out / "logs" / f"{name}_seed_{seed}.log",
                     timeout=args.timeout)
    r: dict[str, Any] = {"name": name, "seed": seed, "config": str(config.relative_to(REPO)),
                         "overrides": overrides, "wall_s": job["wall_s"], "load": load.mean}
    if "error" in job:
        return {**r, "error": job["error"]}
    lines = job["steps"]
    t = 0.0
    steps = []
    for m in lines:
        t += m["time/step"]
        steps.append({"step": m["step"], "t": t, "reward": m["reward/mean"],
                      "response_length": m.get("response_length/mean"), "metrics": m})
    at = {s["step"]: s["t"] for s in steps} | {0: 0.0}
    evals = [{"step": e["step"], "t": at.get(e["step"]), "accuracy": e["val/accuracy"], "eval_s": e["time/eval"]}
             for e in job["evals"] if "val/accuracy" in e]
    if not evals:
        return {**r, "error": "no held-out evaluation in metrics.jsonl (eval.every_steps / rl.heldout_eval?)"}
    hit = next((e for e in evals if e["accuracy"] >= args.target), None)
    timed = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])] or [steps[0]["t"]]
    lengths = [s["response_length"] for s in steps if s["response_length"] is not None]
    r.update(steps=steps, evals=evals, startup_s=lines[0]["time"] - lines[0]["time/step"] - job["launched"],
             train_s=t, step_s=statistics.fmean(timed), acc_start=evals[0]["accuracy"],
             acc_final=evals[-1]["accuracy"], acc_best=max(e["accuracy"] for e in evals),
             steps_to_target=None if hit is None else hit["step"], s_to_target=None if hit is None else hit["t"],
             final_reward=statistics.fmean(s["reward"] for s in steps[-args.window:]),
             response_length=statistics.fmean(lengths) if lengths else None,
             eval_s=sum(e["eval_s"] for e in evals))
    return r


FIGURES = [  # (key in a run, column, format)
    ("acc_start", "held-out acc, step 0", ".3f"),
    ("acc_final", "held-out acc, final", ".3f"),
    ("acc_best", "held-out acc, best", ".3f"),
    ("steps_to_target", "steps to target", ".0f"),
    ("s_to_target", "train s to target", ".1f"),
    ("final_reward", "final reward (last window)", ".3f"),
    ("step_s", "s / step", ".2f"),
    ("response_length", "response tokens", ".1f"),
    ("startup_s", "start-up s", ".1f"),
    ("wall_s", "wall s", ".1f"),
    ("load", "machine load", ".1f"),
]


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Each recipe's figures over the seeds (`spread`), its errors and the seeds that never reached the target."""
    return {name: {"config": str(RECIPES[name].relative_to(REPO)), **a}
            for name, a in over_seeds(per_seed, names, FIGURES, unreached=lambda r: r["steps_to_target"] is None).items()}


def table(agg: dict[str, dict[str, Any]]) -> str:
    cols = [c for _, c, _ in FIGURES]
    lines = ["| algorithm | recipe | seeds | " + " | ".join(cols) + " |", "|---|---|--:|" + "--:|" * len(cols)]
    for name, a in agg.items():
        failed = f" ({len(a['errors'])} failed)" if a["errors"] else ""
        if len(a["errors"]) == a["seeds"]:
            lines.append(f"| {name} | `{a['config']}` | {a['seeds']}{failed} | unavailable: {a['errors'][0]} |"
                         + " |" * (len(cols) - 1))
            continue
        cells = []
        for key, _, spec in FIGURES:
            cell = show(a[key], spec)
            if key in ("steps_to_target", "s_to_target") and a["unreached"]:
                cell += f" ({a['unreached']} seed(s) never)"
            cells.append(cell)
        lines.append(f"| {name} | `{a['config']}` | {a['seeds']}{failed} | " + " | ".join(cells) + " |")
    for name, a in agg.items():
        lines += [f"\n{name}: a run failed: {e}" for e in a["errors"]]
    return "\n".join(lines)


def plot(per_seed: dict[int, dict[str, dict[str, Any]]], names: list[str], path: Path, target: float,
         smooth: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    palette = ["tab:gray", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    for i, name in enumerate(names):
        runs = [per_seed[s][name] for s in per_seed if "error" not in per_seed[s].get(name, {"error": 1})]
        for k, r in enumerate(runs):  # every seed's curve
            label = f"{name} ({len(runs)} seed(s))" if k == 0 else None
            kw = {"color": palette[i % len(palette)], "alpha": 0.8, "linewidth": 1, "label": label}
            axes[0].plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], marker=".", **kw)
            axes[1].plot([e["t"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], marker=".", **kw)
            axes[2].plot([s["step"] for s in r["steps"]], trailing_mean([s["reward"] for s in r["steps"]], smooth),
                         **kw)
    for ax in axes[:2]:
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:g}")
        ax.set_ylabel("held-out greedy accuracy")
    for ax, title, xlabel in zip(axes, ("held-out accuracy per step", "held-out accuracy per training second",
                                        f"training reward ({smooth}-step mean)"),
                                 ("step", "training seconds (sum of time/step)", "step")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[2].set_ylabel("reward/mean")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, default=3, help="runs per recipe (seeds run.seed, run.seed + 1, ...)")
    p.add_argument("--only", default=",".join(RECIPES), help=f"comma-separated recipes of {', '.join(RECIPES)}")
    p.add_argument("--model", default=None, help="the SFT model folder (default: the recipes' model.path)")
    p.add_argument("--target", type=float, default=0.3,
                   help="the held-out greedy accuracy to reach (the SFT model of examples/sft_long.yaml: 8.5%%)")
    p.add_argument("--eval-every", type=int, default=5, help="eval.every_steps")
    p.add_argument("--eval-prompts", type=int, default=100, help="eval.num_prompts (the first of the 200 held-out)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every recipe (repeatable)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "algorithms")
    p.add_argument("--window", type=int, default=5, help="steps in the final mean reward")
    p.add_argument("--smooth", type=int, default=5, help="steps in the plot's moving average")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs: gspo, 1 seed, 1 step, 2 prompts x 2 samples of at most "
                        "16 tokens, 4 held-out prompts; its numbers mean nothing")
    args = p.parse_args()
    args.sizes = []
    if args.smoke:
        args.only, args.seeds, args.steps, args.window, args.smooth = "gspo", 1, 1, 1, 1
        args.eval_every, args.eval_prompts, args.sizes = 1, 4, SMOKE
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise SystemExit(f"algorithms: --only {args.only}: unknown {unknown}; choose from {', '.join(RECIPES)}")
    if args.seeds < 1 or args.steps < 1:
        raise SystemExit(f"algorithms: --seeds {args.seeds} --steps {args.steps}: each at least 1")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    base = load_config(RECIPES[names[0]], [*args.sizes, *args.extra])
    args.model = Path(args.model).resolve() if args.model else REPO / (base.model.path or "")
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"algorithms: no model folder at {args.model}: run `shardwise train examples/sft_long.yaml "
                         "--nproc 2` or pass --model")
    seeds = [base.run.seed + i for i in range(args.seeds)]

    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for k, seed in enumerate(seeds):
        runs = {}
        for name in names if k % 2 == 0 else names[::-1]:  # every other round in reverse: drift favours none
            r = run_recipe(name, seed, args)
            runs[name] = r
            print(f"seed {seed} {name}: " + (f"unavailable: {r['error']}" if "error" in r else
                                             f"held-out accuracy {r['acc_start']:.3f} -> {r['acc_final']:.3f}, "
                                             f"steps to {args.target:g}: {r['steps_to_target']}, "
                                             f"{r['step_s']:.2f} s/step, wall {r['wall_s']:.1f} s"), flush=True)
        per_seed[seed] = {n: runs[n] for n in names}
    agg = aggregate(per_seed, names)
    head = (f"`shardwise rl <recipe>` on builtin:count from {args.model.name if args.smoke else args.model}, "
            f"{args.steps} steps, {len(seeds)} seed(s) ({', '.join(map(str, seeds))}) per recipe, {args.nproc} CPU "
            f"processes each (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}), {platform.machine()} "
            f"{os.cpu_count()} CPUs. Held-out accuracy: greedy, on the task's first {args.eval_prompts} held-out "
            f"prompts (drawn from the seed: every recipe of a seed sees the same), at step 0, every {args.eval_every} steps and at the end. Target: {args.target:g}; steps to it: "
            "the first evaluation at or above it; train s: the sum of time/step up to that step (start-up and "
            f"evaluations apart). Final reward: the mean training reward of the last {args.window} steps. Each "
            "figure: the mean over seeds [min, max]. Machine load: the 1-minute load average during the run (its "
            f"mean; the run itself makes about 2-3 of it).{' SMOKE: the numbers mean nothing.' if args.smoke else ''}"
            "\n\n")
    versions = {k: installed(k) for k in ("shardwise", "torch", "transformers", "verl")}
    md = head + table(agg) + "\n\nVersions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".\n"
    (args.out / "algorithms.md").write_text(md)
    (args.out / "algorithms.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions, "seeds": seeds,
         "target": args.target, "figures": agg, "runs": {str(s): r for s, r in per_seed.items()}},
        indent=2, default=str) + "\n")
    plot(per_seed, names, args.out / "algorithms.png", args.target, args.smooth)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
