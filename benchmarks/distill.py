"""On-policy distillation against GRPO from the reward alone: steps to the teacher's held-out accuracy.

The demo's two models: its SFT model (examples/sft_reverse.yaml -> runs/sft_reverse/hf, the
student: it mostly copies the word it should reverse) and its RL model (examples/grpo_reverse.yaml
-> runs/grpo_reverse/hf, the teacher: GRPO made it reverse). From the student, per seed (run.seed
= 0, 1, ...), with the real command ``python -m shardwise.cli rl examples/grpo_reverse.yaml
--nproc N`` in a fresh run folder (`_rl_job.run_rl`):

- ``grpo``: examples/grpo_reverse.yaml as it is: GRPO from the task's reward alone (1 for the
  exact reversal, else 0);
- ``distill``: the same recipe, learning from the teacher alone (``rl.reward.function=null``:
  no task reward): ``rl.distill.teacher=<teacher> rl.distill.mode=loss`` (``--mode``; the k2
  loss ``0.5 (log p_student - log p_teacher)^2`` on the student's sampled tokens at
  ``--coef``, a per-token gradient) or ``--mode reward`` (``-coef x (log p_student - log
  p_teacher)`` as each token's reward, turned into advantages by the recipe's estimator: GRPO's
  normalises each sequence's sum within its group; with ``rl.actor.kl_loss.enabled=false``,
  which mode reward needs).

Both with everything else of the recipe (32 prompts x 8 samples, lr 1e-4), ``--steps`` steps, the
greedy accuracy on the task's held-out prompts (``eval.num_prompts``, drawn from run.seed: both
methods of a seed and the teacher are scored on the same prompts) at step 0, every
``--eval-every`` steps and at the end. The teacher's held-out accuracy per seed is the step-0
evaluation of a one-step run from the teacher (its step is not used). The methods alternate
order per seed, so a machine getting faster or slower favours neither.

Figures per method (mean over seeds [min, max]): held-out accuracy at step 0, at each
evaluation and at the end; steps to within ``--within`` of the teacher's accuracy (the first
evaluation at or above teacher - within; seeds that never reach it are counted), the training
seconds to it (the sum of ``time/step``), and s / step.

    python benchmarks/distill.py                   # builds the two demo models if missing; 3 seeds x 20 steps
    python benchmarks/distill.py --seeds 1 --steps 10
    python benchmarks/distill.py --set rl.rollout.n=2 --out results/distill/n2   # 2 samples per prompt
    python benchmarks/distill.py --student runs/sft_reverse/hf --teacher runs/grpo_reverse/hf
    python benchmarks/distill.py --smoke --student runs/sft_reverse/hf --teacher runs/sft_reverse/hf   # 1 step, tiny

Writes distill.{json,md,png} to --out (default results/distill), each run's log to logs/ and
run folder to runs/, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _rl_job import run_rl
from harness import REPO, LoadSampler, over_seeds, pyplot, seeds_table, unreached_note
from rl_vs_trl import installed

RECIPE = REPO / "examples" / "grpo_reverse.yaml"
METHODS = ["grpo", "distill"]
SMOKE = ["train.global_batch_size=2", "rl.rollout.n=2", "rl.rollout.max_new_tokens=8"]
"""--smoke's sizes on top of the recipe (with eval.num_prompts 4): its numbers mean nothing."""


def method_overrides(name: str, args: argparse.Namespace) -> list[str]:
    if name == "grpo":
        return []
    return [f"rl.distill.teacher={args.teacher}", f"rl.distill.mode={args.mode}", f"rl.distill.coef={args.coef}",
            "rl.reward.function=null", *(["rl.actor.kl_loss.enabled=false"] if args.mode == "reward" else []),
            *args.distill_extra]


def common(model: Path, seed: int, steps: int, args: argparse.Namespace) -> list[str]:
    return [f"model.path={model}", f"run.seed={seed}", f"train.max_steps={steps}", "train.log_every=1",
            "checkpoint.every_steps=0", "checkpoint.export_hf=false", f"eval.every_steps={args.eval_every}",
            f"eval.num_prompts={args.eval_prompts}", "eval.n=0", *args.sizes, *args.extra]


def teacher_accuracy(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The teacher's greedy held-out accuracy on seed's prompts: step 0 of a one-step run from it."""
    folder = args.out / "runs" / "teacher" / f"seed_{seed}"
    job = run_rl(RECIPE, folder, common(args.teacher, seed, 1, args), nproc=args.nproc,
                 log=args.out / "logs" / f"teacher_seed_{seed}.log", timeout=args.timeout)
    if "error" in job:
        return {"error": job["error"]}
    first = [e for e in job["evals"] if e.get("step") == 0 and "val/accuracy" in e]
    if not first:
        return {"error": "no step-0 held-out evaluation in the teacher's metrics.jsonl"}
    return {"accuracy": first[0]["val/accuracy"], "wall_s": job["wall_s"]}


def run_method(name: str, seed: int, goal: float, args: argparse.Namespace) -> dict[str, Any]:
    """One method's run at `seed`: its steps, its evaluations (step, accuracy, training seconds
    so far) and the figures derived from them; `goal`: teacher's accuracy - within."""
    folder = args.out / "runs" / name / f"seed_{seed}"
    overrides = [*common(args.student, seed, args.steps, args), *method_overrides(name, args)]
    with LoadSampler() as load:
        job = run_rl(RECIPE, folder, overrides, nproc=args.nproc, log=args.out / "logs" / f"{name}_seed_{seed}.log",
                     timeout=args.timeout)
    r: dict[str, Any] = {"name": name, "seed": seed, "overrides": overrides, "wall_s": job["wall_s"],
                         "load": load.mean}
    if "error" in job:
        return {**r, "error": job["error"]}
    t = 0.0
    steps = []
    for m in job["steps"]:
        t += m["time/step"]
        steps.append({"step": m["step"], "t": t, "reward": m["reward/mean"],
                      "reverse_kl": m.get("distill/reverse_kl"), "time_teacher": m.get("time/teacher")})
    at = {s["step"]: s["t"] for s in steps} | {0: 0.0}
    evals = [{"step": e["step"], "t": at.get(e["step"]), "accuracy": e["val/accuracy"]}
             for e in job["evals"] if "val/accuracy" in e]
    if not evals:
        return {**r, "error": "no held-out evaluation in metrics.jsonl"}
    hit = next((e for e in evals if e["accuracy"] >= goal), None)
    timed = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])] or [steps[0]["t"]]
    r.update(steps=steps, evals=evals, goal=goal, step_s=statistics.fmean(timed), acc_start=evals[0]["accuracy"],
             acc_final=evals[-1]["accuracy"], acc_best=max(e["accuracy"] for e in evals),
             steps_to_goal=None if hit is None else hit["step"], s_to_goal=None if hit is None else hit["t"])
    return r


FIGURES = [
    ("teacher", "teacher held-out acc", ".3f"),
    ("acc_start", "held-out acc, step 0", ".3f"),
    ("acc_final", "held-out acc, final", ".3f"),
    ("acc_best", "held-out acc, best", ".3f"),
    ("steps_to_goal", "steps to teacher - within", ".1f"),
    ("s_to_goal", "train s to it", ".1f"),
    ("step_s", "s / step", ".2f"),
    ("wall_s", "wall s", ".1f"),
    ("load", "machine load", ".1f"),
]


def curves_table(per_seed: dict[int, dict[str, dict[str, Any]]], teachers: dict[int, dict[str, Any]]) -> str:
    """Each run's held-out accuracy at each evaluation (one row per method and seed)."""
    steps = sorted({e["step"] for runs in per_seed.values() for r in runs.values() for e in r.get("evals", [])})
    lines = ["| method | seed | teacher | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|--:|--:|" + "--:|" * len(steps)]
    for seed, runs in per_seed.items():
        for name, r in runs.items():
            acc = {e["step"]: e["accuracy"] for e in r.get("evals", [])}
            cells = [f"{acc[s]:.3f}" if s in acc else "" for s in steps]
            lines.append(f"| {name} | {seed} | {teachers[seed].get('accuracy', float('nan')):.3f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(per_seed: dict[int, dict[str, dict[str, Any]]], teachers: dict[int, dict[str, Any]], path: Path,
         within: float) -> None:
    plt = pyplot()
    if plt is None:
        return
    colours = {"grpo": "tab:gray", "distill": "tab:blue"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for k, (seed, runs) in enumerate(per_seed.items()):
        for name, r in runs.items():
            if "error" in r:
                continue
            kw = {"color": colours[name], "linestyle": styles[k % len(styles)], "marker": ".",
                  "label": f"{name}, seed {seed}"}
            axes[0].plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], **kw)
            axes[1].plot([e["t"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], **kw)
        if "accuracy" in teachers[seed]:
            for ax in axes:
                ax.axhline(teachers[seed]["accuracy"] - within, color="tab:red", linestyle=styles[k % len(styles)],
                           linewidth=0.8, label=f"teacher - {within:g}, seed {seed}" if ax is axes[0] else None)
    for ax, title, xlabel in zip(axes, ("held-out greedy accuracy per step", "per training second"),
                                 ("step", "training seconds (sum of time/step)")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build(config: str, folder: Path, what: str, nproc: int) -> None:
    """Run the demo's `what` job (its config as it is) to make a missing model folder."""
    print(f"distill: no {what} at {folder}: running `shardwise {what} {config} --nproc {nproc}`", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    res = subprocess.run([sys.executable, "-m", "shardwise.cli", what, config, "--nproc", str(nproc)], cwd=REPO,
                         env=env, check=False, timeout=3600)
    if res.returncode != 0 or not (folder / "config.json").is_file():
        raise SystemExit(f"distill: `shardwise {what} {config}` failed (exit {res.returncode}); no model at {folder}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", type=int, default=3, help="runs per method (seeds 0, 1, ...)")
    p.add_argument("--student", default=None, help="the student (default runs/sft_reverse/hf, built if missing)")
    p.add_argument("--teacher", default=None, help="the teacher (default runs/grpo_reverse/hf, built if missing)")
    p.add_argument("--coef", type=float, default=1.0, help="rl.distill.coef")
    p.add_argument("--mode", choices=["reward", "loss"], default="loss", help="rl.distill.mode")
    p.add_argument("--distill-set", dest="distill_extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the distillation runs only (repeatable)")
    p.add_argument("--only", default=",".join(METHODS), help="comma-separated methods of grpo, distill")
    p.add_argument("--within", type=float, default=0.03, help="the goal: the teacher's held-out accuracy less this")
    p.add_argument("--eval-every", type=int, default=2, help="eval.every_steps")
    p.add_argument("--eval-prompts", type=int, default=200, help="eval.num_prompts")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "distill")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs: 1 seed, 1 step, 2 prompts x 2 samples, 4 held-out "
                        "prompts; its numbers mean nothing")
    args = p.parse_args()
    args.sizes = []
    if args.smoke:
        args.seeds, args.steps, args.eval_every, args.eval_prompts, args.sizes = 1, 1, 1, 4, SMOKE
    if args.seeds < 1 or args.steps < 1:
        raise SystemExit(f"distill: --seeds {args.seeds} --steps {args.steps}: each at least 1")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.student = Path(args.student).resolve() if args.student else REPO / "runs" / "sft_reverse" / "hf"
    args.teacher = Path(args.teacher).resolve() if args.teacher else REPO / "runs" / "grpo_reverse" / "hf"
    for folder, config, what in ((args.student, "examples/sft_reverse.yaml", "train"),
                                 (args.teacher, "examples/grpo_reverse.yaml", "rl")):
        if not (folder / "config.json").is_file():
            if folder != REPO / "runs" / Path(config).stem / "hf":
                raise SystemExit(f"distill: no model folder at {folder}")
            build(config, folder, what, args.nproc)
    seeds = list(range(args.seeds))
    args.methods = [m.strip() for m in args.only.split(",") if m.strip()]
    if not args.methods or set(args.methods) - set(METHODS):
        raise SystemExit(f"distill: --only {args.only}: choose from {', '.join(METHODS)}")

    teachers: dict[int, dict[str, Any]] = {}
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for k, seed in enumerate(seeds):
        teachers[seed] = teacher_accuracy(seed, args)
        if "error" in teachers[seed]:
            print(f"seed {seed}: the teacher's evaluation failed: {teachers[seed]['error']}", flush=True)
            continue
        goal = teachers[seed]["accuracy"] - args.within
        print(f"seed {seed}: teacher held-out accuracy {teachers[seed]['accuracy']:.3f}", flush=True)
        runs = {}
        for name in args.methods if k % 2 == 0 else args.methods[::-1]:
            r = run_method(name, seed, goal, args)
            r["teacher"] = teachers[seed]["accuracy"]
            runs[name] = r
            print(f"seed {seed} {name}: " + (f"unavailable: {r['error']}" if "error" in r else
                                             "held-out accuracy " + " ".join(f"{e['step']}:{e['accuracy']:.3f}"
                                                                              for e in r["evals"])
                                             + f", steps to {goal:.3f}: {r['steps_to_goal']}, "
                                               f"{r['step_s']:.2f} s/step, wall {r['wall_s']:.1f} s"), flush=True)
        per_seed[seed] = {n: runs[n] for n in args.methods}
    agg = over_seeds(per_seed, args.methods, FIGURES, unreached=lambda r: r["steps_to_goal"] is None)
    head = (f"`shardwise rl examples/grpo_reverse.yaml` from the student {args.student.name if args.smoke else args.student}"
            f"; teacher {args.teacher.name if args.smoke else args.teacher}; {args.steps} steps, seed(s) "
            f"{', '.join(map(str, seeds))}, {args.nproc} CPU processes each (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', '1')}), {platform.machine()} {os.cpu_count()} CPUs. grpo: the recipe "
            f"as it is (the task's reward alone); distill: rl.distill.mode={args.mode}, coef {args.coef:g}, the "
            "teacher alone (rl.reward.function=null). Held-out accuracy: greedy, on the task's first "
            f"{args.eval_prompts} held-out prompts of the seed, at step 0, every {args.eval_every} steps and at the "
            f"end; the teacher's on the same prompts. Goal: the teacher's accuracy - {args.within:g}; steps to it: "
            "the first evaluation at or above it; train s: the sum of time/step up to it. Each figure: the mean over "
            "seeds [min, max]. Machine load: the mean 1-minute load average during the run."
            f"{' SMOKE: the numbers mean nothing.' if args.smoke else ''}\n\n")
    lines = seeds_table(agg, FIGURES, "method",
                        cell=lambda n, key, a, text: unreached_note(text, a) if key in ("steps_to_goal", "s_to_goal")
                        else text)
    versions = {k: installed(k) for k in ("shardwise", "torch", "transformers", "verl")}
    md = (head + "\n".join(lines) + "\n\nHeld-out accuracy at each evaluation:\n\n" + curves_table(per_seed, teachers)
          + "\n\nVersions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".\n")
    (args.out / "distill.md").write_text(md)
    (args.out / "distill.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions, "seeds": seeds,
         "teachers": {str(s): t for s, t in teachers.items()}, "figures": agg,
         "runs": {str(s): r for s, r in per_seed.items()}}, indent=2, default=str) + "\n")
    plot(per_seed, teachers, args.out / "distill.png", args.within)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
