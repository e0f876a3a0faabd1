"""LoRA against full fine-tuning, side by side in one run: memory per rank, SFT tokens/s and
the RL step, on the demo's model; the plan's memory for Llama-2 7B / 70B shapes.

For the demo's tiny Qwen3 (examples/sft_reverse.yaml's model), full fine-tuning against
LoRA rank 16 on every Linear but the head (examples/grpo_reverse_lora.yaml's adapters):

1. memory per rank: the plan's estimate (``shardwise plan --json``: params + grads +
   AdamW), the bytes a rank holds after ``optimizer.step()`` (``_train_worker.py``'s
   ``held_state_bytes``, 2 synthetic steps of the same shape) and the SFT run's peak RSS;
2. SFT tokens/s: ``shardwise train examples/sft_reverse.yaml --nproc 2`` for --sft-steps
   steps, the mean over the steps after --sft-warmup;
3. the RL step: ``shardwise rl examples/grpo_reverse.yaml --nproc 2`` (from the demo's SFT
   model, runs/sft_reverse/hf) for --rl-steps steps, with the HF engine and with vLLM (a
   LoRA actor's weights pushed merged, and as adapters: rl.rollout.vllm.lora_sync, shown as
   not implemented in a shardwise without it): seconds per step and per phase, bytes pushed;
4. plan-only rows: Llama-2-7B and -70B shapes on 8 and 64 ranks (bf16 compute, fp32
   master weights as benchmarks/gpu_throughput.py), full against LoRA r=16 on q,k,v,o
   (fp32 base, and a bf16 base): per-rank params + grads + AdamW.

    python benchmarks/lora.py                     # all of it, ~3-4 minutes on 2 idle CPU cores
    python benchmarks/lora.py --skip-rl           # without the RL jobs (~1 minute)

Writes lora.{md,csv,json,png} to --out (default results/lora) and prints the tables. A run
that fails is shown as `unavailable: <error>`; the others go on. Each run's output is in
--out/logs/, its run folder in --out/runs/. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from _rl_job import run_rl
from harness import machine_info, run_worker, torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SFT_CONFIG = REPO / "examples" / "sft_reverse.yaml"
RL_CONFIG = REPO / "examples" / "grpo_reverse.yaml"
DEMO_MODEL = REPO / "runs" / "sft_reverse" / "hf"
MIB, GIB = 1024**2, 1024**3

VARIANTS = {
    "full": ["model.lora.enabled=false"],
    # examples/grpo_reverse_lora.yaml's adapters, on top of the same configs
    "lora": ["model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32",
             "model.lora.target_modules=[all-linear]"],
}
"""The demo model's two ways of training (everything else in the configs is the same)."""

SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 32000,
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "llama2-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
}
"""Llama-2's 7B (multi-head attention: 32 KV heads) and 70B (grouped-query: 8) shapes."""
PLAN_WORLDS = (8, 64)
QKVO = ["model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
PLAN_VARIANTS = {"full": [], "lora": QKVO, "lora_bf16_base": [*QKVO, "model.dtype=bf16"]}
"""The big shapes' rows: fp32 master weights and bf16 compute (gpu_throughput.py's
settings), LoRA with the frozen base kept in fp32 too, or in bf16 (adapters stay fp32)."""


# -- runs

def plan(config: Path, world: int, overrides: list[str]) -> dict[str, Any]:
    """``shardwise plan CONFIG --world-size N --json overrides...`` (in this process: the model
    is built on the meta device, seconds even for 70B; the imports are paid once): the
    largest rank's params / grads / optimizer / total bytes and the parameter counts, or
    {"error"}."""
    from shardwise.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(["plan", str(config), "--world-size", str(world), "--json", *overrides])
    if rc != 0:
        return {"error": (err.getvalue().strip().splitlines() or [f"status {rc}"])[-1]}
    p = json.loads(out.getvalue())
    mem = max(p["memory_per_rank_bytes"]["by_rank"], key=lambda m: m["total"])
    return {**mem, "num_params": sum(u["num_params"] for u in p["units"]),
            "trainable_params": sum(u["trainable_params"] for u in p["units"])}


def demo_model_overrides() -> list[str]:
    """sft_reverse.yaml's model and batch as overrides of `_train_worker.py` (it takes no file)."""
    cfg = yaml.safe_load(SFT_CONFIG.read_text())
    return [f"model.config={json.dumps(cfg['model']['config'])}", f"model.dtype={cfg['model']['dtype']}",
            "fsdp.mixed_precision.param_dtype=fp32", f"train.micro_batch_size={cfg['train']['micro_batch_size']}",
            f"train.global_batch_size={cfg['train']['global_batch_size']}", "train.max_steps=2", "run.seed=0"]


def held_state(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Bytes of params / grads / AdamW state each rank holds after the 2nd optimizer step of
    `_train_worker.py` (synthetic rows of sft_reverse's shape): the largest rank's, or {"error"}."""
    cfg = yaml.safe_load(SFT_CONFIG.read_text())
    raw = args.out / "raw" / f"state_{variant}.json"
    cmd = [*torchrun(args.nproc, HERE / "_train_worker.py"),
           "--name", variant, "--out", str(raw), "--steps", "1", "--warmup", "1",
           "--seq-len", str(cfg["data"]["max_length"]), "--micro", str(cfg["train"]["micro_batch_size"])]
    for o in [*demo_model_overrides(), *VARIANTS[variant]]:
        cmd += ["--override", o]
    rec, _ = run_worker(cmd, args.nproc, args.timeout, args.out / "logs" / f"state_{variant}.log", raw)
    if "error" in rec:
        return rec
    return max((r["state_bytes"] for r in rec["ranks"]), key=lambda s: s["total"])


def run_train(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """The real ``shardwise train examples/sft_reverse.yaml --nproc N`` for --sft-steps steps,
    every step logged: tokens/s (mean and quartiles of the steps after --sft-warmup), rank 0's
    peak RSS (``peak_memory_bytes`` on CPU), the last loss; or {"error"}."""
    run_dir = args.out / "runs" / f"sft_{variant}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "shardwise.cli", "train", str(SFT_CONFIG), "--nproc", str(args.nproc),
           f"run.dir={run_dir}", f"train.max_steps={args.sft_steps}", "train.log_every=1", "checkpoint.every_steps=0",
           "checkpoint.export_hf=false", "checkpoint.resume=never", *VARIANTS[variant],
           *(["data.num_examples=256"] if args.smoke else [])]  # --smoke: not 32,000 demonstrations to make
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        res = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    (args.out / "logs" / f"sft_{variant}.log").write_text(f"$ {' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1]}
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]  # the training steps (the held-out evaluation has a line of its own)
    tps = [m["tokens_per_s"] for m in steps[args.sft_warmup:]]
    q = statistics.quantiles(tps, n=4, method="inclusive") if len(tps) > 1 else [tps[0]] * 3
    return {"tokens_per_s": statistics.fmean(tps), "tokens_per_s_p25": q[0], "tokens_per_s_p75": q[2],
            "peak_rss_bytes": max(m["peak_memory_bytes"] for m in steps), "final_loss": steps[-1]["loss"],
            "tokens_per_s_steps": [m["tokens_per_s"] for m in steps]}


PHASES = ("generate", "weight_sync", "ref", "update_actor", "other")
RL_ROWS: dict[str, tuple[str, str, str, list[str]]] = {
    # name: engine, variant, what the engine's weights come from, extra overrides
    "hf full": ("hf", "full", "none: the actor's own weights", []),
    "hf lora": ("hf", "lora", "none: the actor's own weights, live adapters", []),
    "vllm full": ("vllm", "full", "full weights, every step", []),
    "vllm lora merged": ("vllm", "lora", "merged (base + B·A), every step", ["rl.rollout.vllm.lora_sync=merged"]),
    "vllm lora adapter": ("vllm", "lora", "adapter ⁶: base once, then the adapters",
                          ["rl.rollout.vllm.lora_sync=adapter"]),
}
RL_ORDER = ("hf full", "hf lora", "vllm lora adapter", "vllm lora merged", "vllm full")
"""The order the jobs run in (the full rows first and last, so drift favours neither way)."""


def adapter_sync_exists() -> bool:
    """Whether this shardwise has ``rl.rollout.vllm.lora_sync`` (before it, only merged)."""
    from shardwise.config.schema import VLLMConfig

    return "lora_sync" in VLLMConfig.model_fields


def run_rl_job(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The real ``shardwise rl examples/grpo_reverse.yaml --nproc N`` (`_rl_job.run_rl`) of row
    `name`, means over the steps after the first: the step without its checkpoint save (the
    last step always saves), generate without the weight push, the push, ref, update_actor, the
    rest, the bytes pushed per step (and at step 1)."""
    engine, variant, _, extra = RL_ROWS[name]
    tag = name.replace(" ", "_")
    job = run_rl(RL_CONFIG, args.out / "runs" / f"rl_{tag}",
                 [f"train.max_steps={args.rl_steps}", "rl.heldout_eval=false", "checkpoint.every_steps=0",
                  "checkpoint.export_hf=false", "checkpoint.resume=never", f"rl.rollout.engine={engine}",
                  *VARIANTS[variant], *(extra if adapter_sync_exists() else [])],
                 nproc=args.nproc, log=args.out / "logs" / f"rl_{tag}.log", timeout=args.timeout,
                 env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
    if "error" in job:
        return {"error": job["error"], "wall_s": job["wall_s"]}
    steps = job["steps"]
    timed = steps[1:] if len(steps) > 1 else steps

    def mean(f) -> float:
        return statistics.fmean(f(m) for m in timed)

    g = lambda m, k: m.get(k, 0.0)  # noqa: E731
    per_step = [g(m, "time/step") - g(m, "time/checkpoint") for m in timed]
    q = statistics.quantiles(per_step, n=4, method="inclusive") if len(per_step) > 1 else per_step * 3
    out = {"step_s": statistics.fmean(per_step), "step_s_p25": q[0], "step_s_p75": q[2],
           "generate": mean(lambda m: g(m, "time/generate") - g(m, "time/weight_sync")),
           "weight_sync": mean(lambda m: g(m, "time/weight_sync")), "ref": mean(lambda m: g(m, "time/ref")),
           "update_actor": mean(lambda m: g(m, "time/update_actor")),
           "sync_bytes": mean(lambda m: g(m, "weight_sync/bytes")),
           "first_sync_bytes": g(steps[0], "weight_sync/bytes"),
           "final_checkpoint_s": g(steps[-1], "time/checkpoint"), "wall_s": job["wall_s"],
           "reward": [m["reward/mean"] for m in steps]}
    out["other"] = out["step_s"] - sum(out[k] for k in PHASES[:-1])
    return out


# -- report

def x(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    mem, state, rl, big = res["demo_plan"], res["state"], res["rl"], res["big_plan"]
    ok = lambda r: r is not None and "error" not in r  # noqa: E731
    lines = [f"### Demo model (examples/sft_reverse.yaml's tiny Qwen3, {args.nproc} ranks): full vs LoRA r=16 "
             "on all-linear", "",
             "| run | trainable params | plan MiB/rank ¹ | x | held MiB/rank ² (params / grads / AdamW) | x | "
             f"SFT tokens/s ³ | p25-p75 | x | peak RSS MiB ⁴ | x | SFT loss after {args.sft_steps} |",
             "|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for v in VARIANTS:
        p, s, t = mem[v], state.get(v), res["sft_runs"].get(v)
        cells = [v, f"{p['trainable_params']:,}" if ok(p) else p.get("error", "-"),
                 f"{p['total'] / MIB:.2f}" if ok(p) else "-", x(p.get("total"), mem["full"].get("total"))]
        cells += ([f"{s['total'] / MIB:.2f} ({s['params'] / MIB:.2f} / {s['grads'] / MIB:.2f} / "
                   f"{s['optimizer'] / MIB:.2f})", x(s["total"], state["full"].get("total"))] if ok(s)
                  else [f"unavailable: {s['error']}" if s else "-", "-"])
        if ok(t):
            f = res["sft_runs"]["full"] if ok(res["sft_runs"].get("full")) else {}
            cells += [f"{t['tokens_per_s']:.0f}", f"{t['tokens_per_s_p25']:.0f}-{t['tokens_per_s_p75']:.0f}",
                      x(t["tokens_per_s"], f.get("tokens_per_s")), f"{t['peak_rss_bytes'] / MIB:.0f}",
                      x(t["peak_rss_bytes"], f.get("peak_rss_bytes")), f"{t['final_loss']:.3f}"]
        else:
            cells += [f"unavailable: {t['error']}" if t else "-"] + ["-"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    adapter_mib = (mem["lora"]["trainable_params"] * 4 / MIB) if ok(mem["lora"]) else float("nan")
    adapter_missing = any(r.get("not_implemented") for r in rl.values())
    if rl:
        lines += ["", f"### RL step (examples/grpo_reverse.yaml from runs/sft_reverse/hf, {args.nproc} ranks, "
                  f"{args.rl_steps} steps, means over steps 2-{args.rl_steps}; seconds)", "",
                  "| engine | run | weights to the engine | s / step ⁵ | p25-p75 | x | generate | weight sync s "
                  "| ref | update_actor | x | other | sync MiB / step | x | step-1 push MiB | final checkpoint s |",
                  "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for name, r in rl.items():
            engine, v, sync, _ = RL_ROWS[name]
            if not ok(r):
                why = "not implemented" if r.get("not_implemented") else f"unavailable: {r['error']}"
                lines.append(f"| {engine} | {v} | {sync} | {why} |" + " |" * 12)
                continue
            f = rl.get(f"{engine} full")
            f = f if ok(f) else {}
            lines.append(
                f"| {engine} | {v} | {sync} | {r['step_s']:.3f} | {r['step_s_p25']:.2f}-{r['step_s_p75']:.2f} | "
                f"{x(r['step_s'], f.get('step_s'))} | "
                f"{r['generate']:.3f} | {r['weight_sync']:.3f} | {r['ref']:.3f} | {r['update_actor']:.3f} | "
                f"{x(r['update_actor'], f.get('update_actor'))} | {r['other']:.3f} | {r['sync_bytes'] / MIB:.2f} | "
                f"{x(r['sync_bytes'], f.get('sync_bytes')) if engine == 'vllm' else '-'} | "
                f"{r['first_sync_bytes'] / MIB:.2f} | {r['final_checkpoint_s']:.3f} |")
    lines += ["", "### Plan only: Llama-2 shapes, bf16 compute, fp32 AdamW (`shardwise plan --json`), largest rank",
              "", "| model | ranks | run | trainable params | params GiB | grads MiB | AdamW MiB | total GiB/rank | "
              "x full | grads / even split ⁷ |", "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for (shape, world, v), p in big.items():
        if not ok(p):
            lines.append(f"| {shape} | {world} | {v} | unavailable: {p['error']} |" + " |" * 6)
            continue
        lines.append(f"| {shape} | {world} | {v} | {p['trainable_params'] / 1e6:,.1f} M | {p['params'] / GIB:.2f} | "
                     f"{p['grads'] / MIB:,.1f} | {p['optimizer'] / MIB:,.1f} | {p['total'] / GIB:.2f} | "
                     f"{x(p['total'], big[(shape, world, 'full')].get('total'))} | "
                     f"{x(p['grads'], p['trainable_params'] * 4 / world)} |")
    notes = ["x = LoRA / full (time: above 1 is slower; tokens/s: below 1 is slower).",
             "¹ `shardwise plan --json`: params + grads + AdamW state of the largest rank (`memory_per_rank_bytes`); "
             "LoRA: the frozen base (params only) plus the fp32 adapters with their grads and AdamW state.",
             "² measured: bytes one rank holds just after `optimizer.step()` of `_train_worker.py` (same model and "
             "batch shape, synthetic rows): DTensor local shards, each storage once at its full padded size.",
             f"³ `shardwise train examples/sft_reverse.yaml --nproc {args.nproc}`, {args.sft_steps} steps: mean of "
             f"rank 0's tokens/s (global batch tokens / step time) over steps {args.sft_warmup + 1}-{args.sft_steps}.",
             "⁴ the SFT run's `peak_memory_bytes` on CPU: rank 0's peak RSS (`ru_maxrss`), mostly the Python / "
             "torch / transformers runtime; on CUDA `max_memory_allocated`. The SFT starts from random weights: "
             "LoRA adapts a random base, so its loss falls less; the loss shows that the adapters train, it does "
             "not compare quality."]
    if rl:
        notes += ["⁵ `time/step` less `time/checkpoint` (the last step always saves; its time is the last column); "
                  "generate excludes the weight push (`time/weight_sync`, a part of it); other = dispatch, reward, "
                  "advantage. `sync MiB / step`: `weight_sync/bytes` per rank.",
                  ("⁶ an adapter-only push to vLLM does not exist in this shardwise (no rl.rollout.vllm.lora_sync): "
                   "a LoRA actor streams merged weights, as many bytes as full fine-tuning. " if adapter_missing else
                   "⁶ `rl.rollout.vllm.lora_sync=adapter`: vLLM serves the adapters as vLLM LoRA (enable_lora); the "
                   "base is pushed once, at step 1, then only the adapters. ")
                  + f"The adapters are {adapter_mib:.2f} MiB in fp32 (the plan's trainable parameters x 4 bytes)."]
    notes += ["⁷ grads held by the largest rank / (trainable parameters x 4 bytes / ranks): FSDP2 shards every "
              "parameter on dim 0 and pads it to ceil(rows / ranks) rows per rank, so a lora_A of r=16 rows on "
              "64 ranks takes 64 rows (4x); AdamW state follows the unpadded rows."]
    return "\n".join([*lines, "", "\n\n".join(notes)]) + "\n"


def write_csv(path: Path, res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for v in VARIANTS:
        rows.append({"table": "demo", "run": v, **{f"plan_{k}": val for k, val in res["demo_plan"][v].items()},
                     **{f"held_{k}": val for k, val in (res["state"].get(v) or {}).items()},
                     **{f"sft_{k}": val for k, val in (res["sft_runs"].get(v) or {}).items()
                        if k != "tokens_per_s_steps"}})
    for name, r in res["rl"].items():
        engine, v, sync, _ = RL_ROWS[name]
        rows.append({"table": "rl", "engine": engine, "run": v, "weight_sync_mode": sync,
                     **{k: val for k, val in r.items() if k != "reward"}})
    for (shape, world, v), p in res["big_plan"].items():
        rows.append({"table": "plan", "model": shape, "ranks": world, "run": v,
                     **{f"plan_{k}": val for k, val in p.items()}})
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
    return rows


def write_plot(path: Path, res: dict[str, Any]) -> None:
    """Left: plan bytes per rank, full vs LoRA, per model and rank count (log scale, LoRA/full
    on top). Right: seconds per RL step, stacked by phase, per engine and run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("demo", 2, {v: res["demo_plan"][v] for v in VARIANTS})]
    groups += [(s, w, {v: res["big_plan"][(s, w, v)] for v in PLAN_VARIANTS})
               for s, w in dict.fromkeys((s, w) for s, w, _ in res["big_plan"])]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.27
    for j, v in enumerate(PLAN_VARIANTS):
        labelled = False
        for i, (_, _, g) in enumerate(groups):
            if "total" not in g.get(v, {}):
                continue
            b = left.bar(i + (j - 1) * width, g[v]["total"] / GIB, width, color=f"C{j}",
                         label=None if labelled else v)[0]
            labelled = True
            if v != "full":
                left.text(b.get_x() + width / 2, b.get_height(), f"{x(g[v]['total'], g['full'].get('total'))}x",
                          ha="center", va="bottom", fontsize=7)
    left.set_xticks(range(len(groups)), [f"{s}\n{w} ranks" for s, w, _ in groups], fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("GiB per rank (params + grads + AdamW)")
    left.set_title("plan: memory per rank, full vs LoRA")
    left.legend(fontsize=8)
    runs = [(k, r) for k, r in res["rl"].items() if "step_s" in r]
    bottom = [0.0] * len(runs)
    for phase in PHASES:
        vals = [max(r[phase], 0.0) for _, r in runs]
        right.bar(range(len(runs)), vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, (k, r) in enumerate(runs):
        full = res["rl"].get(f"{RL_ROWS[k][0]} full", {})
        right.text(i, bottom[i], f"{r['step_s']:.2f} s ({x(r['step_s'], full.get('step_s'))}x)", ha="center",
                   va="bottom", fontsize=8)
    right.set_xticks(range(len(runs)), [k.replace(" ", "\n", 1) for k, _ in runs], fontsize=8)
    right.set_ylabel("seconds per RL step")
    right.set_title("RL step by phase (CPU, 2 ranks)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--sft-warmup", type=int, default=5, help="SFT steps left out of tokens/s")
    p.add_argument("--rl-steps", type=int, default=6)
    p.add_argument("--skip-rl", action="store_true", help="no RL jobs (they need runs/sft_reverse/hf and vllm)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", type=Path, default=REPO / "results" / "lora")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs (make test): 1 process per run, no RL jobs, 2 SFT steps "
                        "(1 left out of tokens/s) run beside the held-state runs, the plan rows of llama2-7b on 8 "
                        "ranks only; its numbers mean nothing")
    args = p.parse_args()
    if args.smoke:
        args.skip_rl, args.sft_steps, args.sft_warmup, args.nproc = True, 2, 1, 1
    shapes = {"llama2-7b": SHAPES["llama2-7b"]} if args.smoke else SHAPES
    worlds = PLAN_WORLDS[:1] if args.smoke else PLAN_WORLDS
    args.out = args.out.resolve()
    for d in ("logs", "raw", "runs"):
        (args.out / d).mkdir(parents=True, exist_ok=True)
    if not args.skip_rl and not (DEMO_MODEL / "config.json").is_file():
        p.error(f"{DEMO_MODEL} is missing: `make demo` (or shardwise train examples/sft_reverse.yaml) makes it; "
                "or --skip-rl")
    t0 = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", flush=True)  # noqa: E731
    res: dict[str, Any] = {"demo_plan": {}, "state": {}, "sft_runs": {}, "rl": {}, "big_plan": {}}

    # Byte counts do not depend on speed: the held-state runs go on in the background while
    # the plans are made; the timed runs below run one at a time.
    say(f"held state: _train_worker.py, full and lora, 2 steps each, in the background ({args.nproc} ranks each)")
    with ThreadPoolExecutor(2 * len(VARIANTS)) as pool:
        held = {v: pool.submit(held_state, v, args) for v in VARIANTS}
        # --smoke times nothing worth reading: its SFT runs go beside the rest, not one at a time
        smoke_sft = {v: pool.submit(run_train, v, args) for v in VARIANTS} if args.smoke else {}
        say(f"plan: demo model on {args.nproc} ranks, {', '.join(shapes)} on {worlds} ranks (meta device)")
        for v in VARIANTS:
            r = res["demo_plan"][v] = plan(SFT_CONFIG, args.nproc, VARIANTS[v])
            say(f"  plan demo x{args.nproc} {v}: "
                + (r["error"] if "error" in r else f"{r['total'] / MIB:.2f} MiB/rank"))
        for shape, cfg in shapes.items():
            for world in worlds:
                common = [f"model.config={json.dumps(cfg)}", "model.dtype=fp32",
                          "fsdp.mixed_precision.param_dtype=bf16", "fsdp.mixed_precision.reduce_dtype=fp32",
                          "train.micro_batch_size=1", f"train.global_batch_size={world}"]
                for v, extra in PLAN_VARIANTS.items():
                    r = res["big_plan"][(shape, world, v)] = plan(SFT_CONFIG, world, [*common, *extra])
                    say(f"  plan {shape} x{world} {v}: "
                        + (r["error"] if "error" in r else f"{r['total'] / GIB:.2f} GiB/rank"))
        for v, fut in held.items():
            r = res["state"][v] = fut.result()
            say(f"  held state {v}: " + (f"unavailable: {r['error']}" if "error" in r else
                                         f"{r['total'] / MIB:.2f} MiB/rank"))

        for v, fut in smoke_sft.items():
            r = res["sft_runs"][v] = fut.result()
            say(f"  SFT {v}, {args.sft_steps} steps: " + (f"unavailable: {r['error']}" if "error" in r else
                                                        f"{r['tokens_per_s']:.0f} tokens/s"))

    jobs = [] if args.smoke else [("sft", v) for v in VARIANTS]
    if not args.skip_rl:
        adapter = adapter_sync_exists()
        jobs += [("rl", name) for name in RL_ORDER if adapter or name != "vllm lora adapter"]
        if not adapter:
            res["rl"]["vllm lora adapter"] = {"not_implemented": True, "error": "no rl.rollout.vllm.lora_sync"}
    for i, (kind, what) in enumerate(jobs, 1):
        s = time.perf_counter()
        if kind == "sft":
            say(f"[{i}/{len(jobs)}] SFT, {what}: shardwise train sft_reverse.yaml, {args.sft_steps} steps")
            r = res["sft_runs"][what] = run_train(what, args)
            detail = "" if "error" in r else f"{r['tokens_per_s']:.0f} tokens/s"
        else:
            say(f"[{i}/{len(jobs)}] RL, {what}: shardwise rl grpo_reverse.yaml, {args.rl_steps} steps")
            try:
                r = res["rl"][what] = run_rl_job(what, args)
            except subprocess.TimeoutExpired:
                r = res["rl"][what] = {"error": f"timed out after {args.timeout:.0f} s"}
            detail = "" if "error" in r else f"{r['step_s']:.3f} s/step, sync {r['sync_bytes'] / MIB:.2f} MiB"
        say(f"    {'unavailable: ' + r['error'] if 'error' in r else detail} ({time.perf_counter() - s:.0f} s)")

    res["rl"] = {k: res["rl"][k] for k in RL_ROWS if k in res["rl"]}  # shown in RL_ROWS' order
    md = markdown(res, args)
    (args.out / "lora.md").write_text(md)
    rows = write_csv(args.out / "lora.csv", res)
    wall = time.perf_counter() - t0
    (args.out / "lora.json").write_text(json.dumps(
        {"machine": machine_info(args.nproc), "args": {k: str(v) for k, v in vars(args).items()}, "variants": VARIANTS,
         "plan_variants": PLAN_VARIANTS, "shapes": shapes, "wall_s": wall, "rows": rows,
         "sft_tokens_per_s_steps": {v: r.get("tokens_per_s_steps") for v, r in res["sft_runs"].items()},
         "rl_reward": {k: r.get("reward") for k, r in res["rl"].items()}}, indent=2) + "\n")
    write_plot(args.out / "lora.png", res)
    print()
    print(md)
    print(f"wrote {args.out}/lora.{{md,csv,json,png}} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
