"""Asynchronous RL against synchronous: `shardwise rl` with generation and training overlapped.

One run, the same machine, the same job (``--task long``: examples/grpo_long.yaml, builtin:count,
answers of 8 to 98 tokens), each setting `--seeds` times (seeds run.seed, run.seed + 1, ...;
each figure the mean and the range over seeds), every run the real command
``python -m shardwise.cli rl <config> --nproc N`` in a fresh run folder (`rl_vs_trl.run_shardwise`):

- ``sync``: ``rl.async.enabled=false``, the synchronous loop: every rank generates, then
  every rank trains (generate -> score -> update in turn);
- ``async_s<k>`` for each k of ``--staleness`` (default 0, 1, 2): ``rl.async.enabled=true``,
  ``rl.async.generator_ranks=--generator-ranks`` (default 1) ranks only generate and the
  other N - G only train, ``rl.async.max_staleness=k``: a sample trains at most k policy
  versions after the one that generated it. At k = 0 nothing overlaps (the run equals the
  synchronous one on N - G training ranks); at 1 and 2 generation runs ahead.

The settings run in rounds, one seed per round, every other round in reverse order, so that
the machine getting faster or slower during the benchmark favours no setting.

Figures (per-step figures over the steps after the first, which warms up):

- samples / s: the samples of a step (prompts x rl.rollout.n) over the mean step time, and
  its ratio to the same seed's synchronous run (the issue's target: >= 1.3 at staleness 1 or 2);
- time to the synchronous run's final mean reward: wall seconds from the first step's start
  until the trailing `--window`-step mean reward first reaches the same seed's synchronous
  final mean reward (the mean of its last `--window` steps), and the synchronous run's own
  time to it over this one (x faster);
- the final mean reward, and whether it is the synchronous one within noise (the issue's
  target; "noise" is stated under the table);
- idle share of each side: asynchronous, ``time/trainer_wait`` (the trainer waiting for a
  batch) and ``time/generator_wait`` (the generator waiting for work or weights) over the
  step time; synchronous, derived: the training side idles while the ranks generate
  (``time/generate`` / step) and the generating side while they score and train (1 - that);
- ``async/staleness_mean`` / ``_max`` (mean / max over the steps), ``async/dropped``
  (summed), ``time/weight_sync`` (the generator's swap-in, s per step);
- start-up (the command's launch to the first step's start) and whole-run wall time.

Under the measured table, a projection from the plan (`shardwise.fsdp.projection`, as
`shardwise plan --hardware h100` and benchmarks/plan_vs_published.py use it; no GPU) of what
the overlap would give on one 8-GPU H100 node for a 7B model with the seeds' settings
(benchmarks/plan_configs/rl_qwen25_7b.yaml): step time synchronous = generation on 8 GPUs +
training on 8; asynchronous = max(generation on G, training on 8 - G) for each split G.
It is computed, not measured: the assumptions are printed with it.

    python benchmarks/rl_async.py                          # 4 settings x 3 seeds x 60 steps (~20 min on 2 cores)
    python benchmarks/rl_async.py --seeds 2 --steps 20     # a shorter run
    python benchmarks/rl_async.py --projection-only        # the 8-GPU projection alone (seconds)
    python benchmarks/rl_async.py --smoke --model runs/sft_reverse/hf   # sync + async_s1, 2 steps (make test)

Needs the config's SFT model (the long task's: `shardwise train examples/sft_long.yaml --nproc 2`;
or --model). Writes rl_async.{json,md,png} to --out (default results/rl_async), each
run's log in logs/ and run folder in runs/, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import LoadSampler, over_seeds, pyplot, reward_curves, seeds_table, show, time_to_reach, unreached_note
from rl_vs_trl import REPO, TASKS, installed, run_shardwise, summarise

from shardwise.config import load_config
from shardwise.config.validate import check_sft_batch, mesh_spec
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.comm import step_comm
from shardwise.fsdp.plan import build_plan
from shardwise.fsdp.projection import load_hardware, project

TARGET_SAMPLES_X = 1.3
"""The issue's target: at max_staleness 1 or 2, >= 1.3x the synchronous samples / s."""
PLAN_CONFIG = REPO / "benchmarks" / "plan_configs" / "rl_qwen25_7b.yaml"


# ---------------------------------------------------------------------- the settings


def setting_overrides(staleness: list[int], generator_ranks: int) -> dict[str, list[str]]:
    """Each setting's name and its config overrides."""
    out = {"sync": ["rl.async.enabled=false"]}
    for k in staleness:
        out[f"async_s{k}"] = ["rl.async.enabled=true", f"rl.async.generator_ranks={generator_ranks}",
                              f"rl.async.max_staleness={k}"]
    return out


# ---------------------------------------------------------------------- the numbers


def _sum(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def derive(r: dict[str, Any], samples_per_step: int) -> None:
    """Add the asynchronous figures to a summarised run (steps after the first)."""
    later = r["steps"][1:] if len(r["steps"]) > 1 else r["steps"]
    t = [0.0] + [s["t"] for s in r["steps"]]
    durations = [b - a for a, b in zip(t, t[1:])]
    elapsed = sum(durations[1:] if len(durations) > 1 else durations)
    m = [s["metrics"] for s in later]
    r["samples_per_step"] = samples_per_step
    r["samples_per_s"] = samples_per_step / r["step_s"]
    trainer_wait = _sum([x.get("time/trainer_wait") for x in m])
    generator_wait = _sum([x.get("time/generator_wait") for x in m])
    r["asynchronous"] = trainer_wait is not None
    if r["asynchronous"]:
        r["trainer_idle"] = trainer_wait / elapsed if elapsed > 0 else None
        r["generator_idle"] = None if generator_wait is None or elapsed <= 0 else generator_wait / elapsed
    else:  # one set of ranks does both in turn: each side idles while the other works
        gen = sum(x.get("time/generate", 0.0) for x in m)
        step = sum(x.get("time/step", 0.0) for x in m)
        r["trainer_idle"] = gen / step if step > 0 else None
        r["generator_idle"] = 1.0 - gen / step if step > 0 else None
    staleness = [x["async/staleness_mean"] for x in m if "async/staleness_mean" in x]
    r["staleness_mean"] = statistics.fmean(staleness) if staleness else None
    r["staleness_max"] = max((x["async/staleness_max"] for x in m if "async/staleness_max" in x), default=None)
    r["dropped"] = _sum([s["metrics"].get("async/dropped") for s in r["steps"]])  # every step's
    sync = [x["time/weight_sync"] for x in m if "time/weight_sync" in x]
    r["weight_sync_s"] = statistics.fmean(sync) if sync else None


def window_se(r: dict[str, Any], window: int) -> float:
    """The standard error of a run's final mean reward: the sd of its last `window` steps' rewards / sqrt(n)."""
    last = [s["reward"] for s in r["steps"][-window:]]
    return statistics.stdev(last) / math.sqrt(len(last)) if len(last) > 1 else 0.0


def compare_to_sync(per_seed: dict[int, dict[str, dict[str, Any]]], window: int) -> None:
    """Each run's figures against the same seed's synchronous run: samples / s ratio, time
    to the synchronous final mean reward and that time's ratio."""
    for runs in per_seed.values():
        sync = runs.get("sync")
        if not sync or "error" in sync:
            continue
        own = time_to_reach(sync, sync["final_reward"], window)
        for r in runs.values():
            if "error" in r:
                continue
            reach = time_to_reach(r, sync["final_reward"], window)
            r["s_to_sync_final_reward"] = reach
            r["reach_x"] = None if reach is None or own is None or reach <= 0 else own / reach
            r["samples_x"] = r["samples_per_s"] / sync["samples_per_s"]
            r["final_reward_delta"] = r["final_reward"] - sync["final_reward"]


FIGURES = [  # (key in a run, column, format)
    ("samples_per_s", "samples / s", ".1f"),
    ("samples_x", "x sync samples / s", ".2f"),
    ("step_s", "s / step", ".3f"),
    ("s_to_sync_final_reward", "s to sync's final reward", ".1f"),
    ("reach_x", "x sync (time to it)", ".2f"),
    ("first_reward", "reward, first window", ".3f"),
    ("final_reward", "final reward (last window)", ".3f"),
    ("trainer_idle", "trainer idle share", ".1%"),
    ("generator_idle", "generator idle share", ".1%"),
    ("staleness_mean", "staleness mean", ".2f"),
    ("staleness_max", "staleness max", ".0f"),
    ("dropped", "dropped", ".0f"),
    ("weight_sync_s", "time/weight_sync s", ".4f"),
    ("startup_s", "start-up s", ".1f"),
    ("train_s", "train s", ".1f"),
    ("wall_s", "wall s", ".1f"),
    ("load", "machine load", ".1f"),
]


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Each setting's figures over the seeds (`spread`)."""
    return over_seeds(per_seed, names, FIGURES,
                      unreached=lambda r: "samples_x" in r and r["s_to_sync_final_reward"] is None)


def table(agg: dict[str, dict[str, Any]]) -> str:
    lines = seeds_table(agg, FIGURES, "setting",
                        cell=lambda name, key, a, text: unreached_note(text, a) if key == "s_to_sync_final_reward" else text)
    return "\n".join(lines)


def noise(per_seed: dict[int, dict[str, dict[str, Any]]], agg: dict[str, dict[str, Any]], window: int) -> float | None:
    """What "the same final reward within noise" allows: the larger of the synchronous final
    mean reward's range over seeds and twice its standard error within a run (the mean over
    seeds of `window_se`)."""
    sync = [runs["sync"] for runs in per_seed.values() if "error" not in runs.get("sync", {"error": 1})]
    if not sync:
        return None
    fr = agg["sync"]["final_reward"]
    return max(fr["max"] - fr["min"], 2 * statistics.fmean(window_se(r, window) for r in sync))


def verdicts(agg: dict[str, dict[str, Any]], tol: float | None, staleness: list[int]) -> str:
    out = []
    sync = agg.get("sync", {}).get("final_reward")
    if sync is None or tol is None:
        return "No synchronous run finished: nothing to compare against."
    if not any(f"async_s{k}" in agg for k in staleness):
        return "No asynchronous setting ran (--staleness is empty): nothing to compare."
    met_any = False
    for k in staleness:
        a = agg.get(f"async_s{k}")
        if not a or a["samples_x"] is None:
            continue
        x, fr = a["samples_x"], a["final_reward"]
        same = abs(fr["mean"] - sync["mean"]) <= tol
        fast = x["mean"] >= TARGET_SAMPLES_X
        if k in (1, 2):
            met_any |= fast and same
        out.append(f"- async_s{k}: {show(x, '.2f')}x the synchronous samples / s; final mean reward "
                   f"{show(fr)} vs {show(sync)} (difference {fr['mean'] - sync['mean']:+.3f}, noise {tol:.3f}): "
                   f"{'the same within noise' if same else 'NOT the same within noise'}.")
    out.append(f"- Target (at max_staleness 1 or 2: >= {TARGET_SAMPLES_X}x the synchronous samples / s, mean over "
               f"seeds, and the same final reward within noise): **{'met' if met_any else 'not met'}**.")
    return "\n".join(out)


def plot(per_seed: dict[int, dict[str, dict[str, Any]]], agg: dict[str, dict[str, Any]], path: Path,
         smooth: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    palette = ["tab:gray", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    colors = {name: palette[i % len(palette)] for i, name in enumerate(agg)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    reward_curves(axes, per_seed, colors, smooth, seeds_word="seed(s)", fontsizes=(9, 8))
    ax = axes[2]
    names = [n for n in agg if agg[n]["samples_per_s"] is not None]
    means = [agg[n]["samples_per_s"]["mean"] for n in names]
    err = [[m - agg[n]["samples_per_s"]["min"] for n, m in zip(names, means)],
           [agg[n]["samples_per_s"]["max"] - m for n, m in zip(names, means)]]
    ax.bar(names, means, yerr=err, color=[colors[n] for n in names], capsize=4)
    ax.set_title("samples / s (mean over seeds, bars: range)", fontsize=9)
    ax.set_ylabel("samples / s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------- the 8-GPU projection


@dataclass(frozen=True)
class Assumptions:
    """What the projection assumes beyond the plan config (each printed with the table)."""

    gpus: int = 8
    hardware: str = "h100"
    samples: int = 256
    """Sequences per RL step: the seed's 1 row x 32 accumulation steps x 8 GPUs."""
    prompt_tokens: int = 512
    response_tokens: int = 1536
    decode_hbm_efficiency: float = 0.7
    """The share of the HBM bandwidth a decoding step reaches (an assumption: no measured figure here)."""
    prefill_mfu: float = 0.5
    extra_forwards: int = 2
    """No-grad forwards of the whole batch besides the update's: reference and old log-probs."""


def _train_seconds(model, gpus: int, a: Assumptions) -> tuple[float, Any, float]:
    """The update of `a.samples` rows on `gpus` GPUs (the plan's projected optimizer step,
    rows rounded up to a whole number of accumulation steps, then scaled back) plus
    `a.extra_forwards` no-grad forwards (each a third of the update's compute); also the
    plan's projection and the seconds of one of those forwards."""
    acc = -(-a.samples // gpus)
    cfg = load_config(str(PLAN_CONFIG), [f"train.global_batch_size={acc * gpus}",
                                         f"data.max_length={a.prompt_tokens + a.response_tokens}"])
    spec = mesh_spec(cfg.parallel, gpus)
    plan = build_plan(model, cfg, spec)
    hw = load_hardware(a.hardware)
    comm = step_comm(model, plan, spec, accumulation=check_sft_batch(cfg.train, spec.dp_size),
                     micro_batch_size=cfg.train.micro_batch_size, max_length=cfg.data.max_length,
                     gpus_per_node=hw.gpus_per_node)
    proj = project(model, plan, comm, hw)
    scale = a.samples / (acc * gpus)
    # a no-grad forward: 2 of the 6 FLOPs per parameter and token, at the MFU without recompute
    forward = proj.compute_s * proj.mfu / hw.mfu["none"] / 3
    return (proj.step_s + a.extra_forwards * forward) * scale, proj, forward * scale


def _generate_seconds(params: int, cfg, gpus: int, a: Assumptions) -> tuple[float, float]:
    """Generation of `a.samples` sequences on `gpus` GPUs, one engine per GPU holding the whole
    bf16 model, all its sequences decoded together: prefill at `a.prefill_mfu`, then one
    decoding step per response token, each the larger of reading the weights and the mean KV
    cache at `a.decode_hbm_efficiency` of the HBM bandwidth and its FLOPs at the peak.
    Returns (seconds, peak GiB of weights + KV cache per GPU)."""
    hw = load_hardware(a.hardware)
    c = cfg.model.config
    per_gpu = -(-a.samples // gpus)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    kv_per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    weights = 2 * params
    peak = hw.peak_flops["bf16"]
    prefill = 2 * params * per_gpu * a.prompt_tokens / (peak * a.prefill_mfu)
    mean_context = a.prompt_tokens + a.response_tokens / 2
    read = (weights + per_gpu * mean_context * kv_per_token) / (hw.memory_bandwidth * a.decode_hbm_efficiency)
    flops = 2 * params * per_gpu / peak
    decode = a.response_tokens * max(read, flops)
    memory = weights + per_gpu * (a.prompt_tokens + a.response_tokens) * kv_per_token
    return prefill + decode, memory / 2**30


def projection(a: Assumptions = Assumptions()) -> dict[str, Any]:
    """Synchronous and asynchronous RL steps of the 7B plan config on `a.gpus` GPUs."""
    cfg = load_config(str(PLAN_CONFIG), [])
    model, _ = plan_for(cfg, mesh_spec(cfg.parallel, a.gpus))
    params = sum(p.numel() for p in model.parameters())
    hw = load_hardware(a.hardware)
    push = 2 * params / (hw.intra_node_bandwidth * hw.intra_node_efficiency)  # bf16 weights over NVLink
    gen8, gen_mem8 = _generate_seconds(params, cfg, a.gpus, a)
    train8, proj8, _ = _train_seconds(model, a.gpus, a)
    sync = gen8 + train8
    rows = [{"setting": "sync", "generator_gpus": a.gpus, "trainer_gpus": a.gpus, "generate_s": gen8,
             "train_s": train8, "push_s": 0.0, "step_s": sync, "samples_per_s": a.samples / sync, "x_sync": 1.0,
             "generator_gib": gen_mem8, "trainer_fits": proj8.fits, "trainer_gib": proj8.memory_bytes / 2**30}]
    balanced = []
    for g in range(1, a.gpus):
        gen, mem = _generate_seconds(params, cfg, g, a)
        train, proj, ref = _train_seconds(model, a.gpus - g, a)
        # staleness >= 1: each side runs at its own pace, the push overlaps the next batch's generation
        step = max(gen + push, train)
        rows.append({"setting": "async, staleness >= 1", "generator_gpus": g, "trainer_gpus": a.gpus - g,
                     "generate_s": gen, "train_s": train, "push_s": push, "step_s": step,
                     "samples_per_s": a.samples / step, "x_sync": sync / step, "generator_gib": mem,
                     "trainer_fits": proj.fits, "trainer_gib": proj.memory_bytes / 2**30,
                     "fits": proj.fits and mem * 2**30 <= hw.memory_bytes})
        # rl.async.reference_on balanced: the generator GPUs (holding the bf16 reference
        # too) take the share f of the reference's forward that evens the two sides; the
        # same compute on g GPUs instead of 8 - g takes (8 - g) / g as long
        on_gen = ref * (a.gpus - g) / g
        f = min(1.0, max(0.0, (train - gen - push) / (ref + on_gen)))
        step = max(gen + push + f * on_gen, train - f * ref)
        mem_b = mem + 2 * params / 2**30
        balanced.append({**rows[-1], "setting": f"async, staleness >= 1, reference balanced ({f:.0%} on the "
                         "generator)", "generate_s": gen + f * on_gen, "train_s": train - f * ref, "step_s": step,
                         "samples_per_s": a.samples / step, "x_sync": sync / step, "generator_gib": mem_b,
                         "fits": proj.fits and mem_b * 2**30 <= hw.memory_bytes})
    best = max((r for r in rows[1:] if r["fits"]), key=lambda r: r["x_sync"])
    s0 = best["generate_s"] + best["push_s"] + best["train_s"]
    rows.append({**best, "setting": "async, staleness 0", "step_s": s0, "samples_per_s": a.samples / s0,
                 "x_sync": sync / s0})
    rows.append(max((r for r in balanced if r["fits"]), key=lambda r: r["x_sync"]))
    return {"assumptions": a.__dict__, "params": params, "mfu": proj8.mfu, "rows": rows, "best": best}


def projection_md(p: dict[str, Any]) -> str:
    a = p["assumptions"]
    lines = [f"**Projected, not measured**: one node of {a['gpus']} {a['hardware'].upper()} GPUs, a 7B model "
             f"(Qwen2.5-7B's shape, {p['params'] / 1e9:.2f} B parameters) with the seeds' FSDP2 settings "
             f"(`{PLAN_CONFIG.relative_to(REPO)}`: bf16 parameters, fp32 reduce, reshard after forward, "
             "1 row per forward per GPU, every decoder layer recomputed); "
             f"{a['samples']} sequences of {a['prompt_tokens']} prompt + {a['response_tokens']} response tokens per "
             "RL step. Training: the plan's projected optimizer step (`shardwise.fsdp.projection`, MFU "
             f"{p['mfu']:.3f} from the h100 profile) plus {a['extra_forwards']} no-grad forwards (reference and old "
             "log-probs, a third of the update's compute each). Generation (not in the plan; this benchmark's own "
             "estimate): one engine per generating GPU with the whole bf16 model, all its sequences decoded "
             f"together, each decoding step reading the weights and the mean KV cache at "
             f"{a['decode_hbm_efficiency']:.0%} of the HBM bandwidth (an assumption), prefill at "
             f"{a['prefill_mfu']:.0%} MFU, every response at full length. Synchronous: generation on all "
             f"{a['gpus']} GPUs, then training on all {a['gpus']}. Asynchronous at staleness >= 1: G GPUs only "
             f"generate, {a['gpus']} - G only train, step = max(generation + the weight push over NVLink, training); "
             "at staleness 0 nothing overlaps: generation + push + training on the split. With "
             "`rl.async.reference_on: balanced` (the last row, its best split) the generating GPUs also hold the "
             "bf16 reference and run the share of its forward that evens the two sides.", "",
             "| setting | generating GPUs | training GPUs | generate s | train s | push s | step s | samples / s | "
             "x sync | generator GiB (weights + KV) | trainer GiB (plan) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in p["rows"]:
        lines.append(f"| {r['setting']} | {r['generator_gpus']} | {r['trainer_gpus']} | {r['generate_s']:.1f} | "
                     f"{r['train_s']:.1f} | {r['push_s']:.2f} | {r['step_s']:.1f} | {r['samples_per_s']:.1f} | "
                     f"{r['x_sync']:.2f} | {r['generator_gib']:.0f} | {r['trainer_gib']:.0f}"
                     f"{'' if r['trainer_fits'] else ' (does not fit)'} |")
    b, r = p["best"], p["rows"][-1]
    lines += ["", f"Best split: {b['generator_gpus']} generating + {b['trainer_gpus']} training GPUs, "
                  f"{b['x_sync']:.2f}x the synchronous samples / s (projected); with the reference balanced, "
                  f"{r['generator_gpus']} + {r['trainer_gpus']} and {r['x_sync']:.2f}x. The gain is bounded by how evenly "
                  "the split balances the two sides: with generation and training of equal length on the whole "
                  "node it would approach 2x; a fixed split of whole GPUs, and generation that does not speed "
                  "up in proportion to its GPUs (decoding reads the whole weights on every GPU), keep it lower."]
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3, help="runs per setting (seeds run.seed, run.seed + 1, ...)")
    p.add_argument("--task", choices=sorted(TASKS), default="long",
                   help="long: examples/grpo_long.yaml (the issue's task); reverse: the demo's short answers")
    p.add_argument("--config", type=Path, default=None, help="the shardwise RL config (default: --task's)")
    p.add_argument("--model", default=None, help="the SFT model folder (default: the config's model.path)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--generator-ranks", type=int, default=1, help="rl.async.generator_ranks of the async settings")
    p.add_argument("--staleness", default="0,1,2", help="rl.async.max_staleness of each async setting")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the rollout engine of every setting")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every setting (repeatable)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "rl_async")
    p.add_argument("--window", type=int, default=10, help="steps in the final mean reward")
    p.add_argument("--smooth", type=int, default=5, help="steps in the plot's moving average")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--projection-only", action="store_true", help="the 8-GPU projection alone; no runs")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs: sync and async_s1, 1 seed, 2 steps, 2 prompts x 2 "
                        "samples, no held-out evaluation; its numbers mean nothing")
    args = p.parse_args()
    smoke = []
    if args.smoke:
        args.seeds, args.steps, args.window, args.smooth, args.staleness = 1, 2, 1, 1, "1"
        smoke = ["train.global_batch_size=2", "rl.rollout.n=2"]
    if args.seeds < 1 or args.steps < 1:
        raise SystemExit(f"rl_async: --seeds {args.seeds} --steps {args.steps}: each at least 1")
    staleness = [int(k) for k in args.staleness.split(",") if k.strip()]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.heldout_eval = False
    proj = projection()
    proj_md = projection_md(proj)
    if args.projection_only:
        (args.out / "rl_async_projection.md").write_text(proj_md + "\n")
        (args.out / "rl_async_projection.json").write_text(json.dumps(proj, indent=2, default=str) + "\n")
        print(proj_md)
        return 0
    config = (args.config or TASKS[args.task]).resolve()
    model = Path(args.model).resolve() if args.model else REPO / (load_config(config).model.path or "")
    if not (model / "config.json").is_file():
        first = "`make demo`" if args.task == "reverse" else "`shardwise train examples/sft_long.yaml --nproc 2`"
        raise SystemExit(f"rl_async: no model folder at {model}: run {first} or pass --model")
    common = [f"model.path={model}", "train.log_every=1", *smoke, *args.extra]
    base = load_config(config, common)
    samples_per_step = base.train.global_batch_size * base.rl.rollout.n
    seeds = [base.run.seed + i for i in range(args.seeds)]
    settings = setting_overrides(staleness, args.generator_ranks)
    names = list(settings)

    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for k, seed in enumerate(seeds):
        runs: dict[str, dict[str, Any]] = {}
        for name in names if k % 2 == 0 else names[::-1]:  # every other round in reverse: drift favours none
            ns = argparse.Namespace(**{**vars(args), "out": args.out / name / f"seed_{seed}"})
            with LoadSampler() as load:
                r = run_shardwise(config, [*common, f"run.seed={seed}", *settings[name]], ns)
            r["load"] = load.mean
            if "error" not in r:
                summarise(r, args.window)
                derive(r, samples_per_step)
            runs[name] = r
            print(f"seed {seed} {name}: " + (f"unavailable: {r['error']}" if "error" in r else
                                             f"{r['samples_per_s']:.1f} samples/s, {r['step_s']:.3f} s/step, "
                                             f"startup {r['startup_s']:.1f} s, wall {r['wall_s']:.1f} s, final "
                                             f"mean reward {r['final_reward']:.3f}"), flush=True)
        per_seed[seed] = {n: runs[n] for n in names}
    compare_to_sync(per_seed, args.window)
    agg = aggregate(per_seed, names)
    tol = noise(per_seed, agg, args.window)
    shown = config.relative_to(REPO) if config.is_relative_to(REPO) else config
    head = (f"`shardwise rl {shown}` synchronous"
            + (f" vs asynchronous (rl.async: generator_ranks {args.generator_ranks}, max_staleness "
               f"{', '.join(map(str, staleness))})" if staleness else "") + f", {args.steps} steps, "
            f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}) per setting, {args.nproc} CPU processes each "
            f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}), {platform.machine()} {os.cpu_count()} "
            f"CPUs, rollout engine {args.engine}, {samples_per_step} samples per step. Each figure: the mean over "
            f"seeds [min, max]; per-step figures over the steps after the first; final reward: the mean of the "
            f"last {args.window} steps; clocks start when the first step begins (start-up apart). Idle shares: "
            "asynchronous, time/trainer_wait and time/generator_wait over the step time; sync (one set of ranks "
            "does both in turn), derived: trainer idle = time/generate / time/step, generator idle = the rest. "
            f"Machine load: the 1-minute load average during the run (its mean; the run itself makes about 2-3 of it on "
            f"{os.cpu_count()} CPUs, the rest is other work on the machine). "
            f"Noise: the larger of sync's final-reward range over seeds and twice the standard error of a "
            f"{args.window}-step mean ({'n/a' if tol is None else f'{tol:.3f}'}).\n\n")
    versions = {k: installed(k) for k in ("shardwise", "torch", "transformers", "ray", "vllm")}
    md = (head + table(agg) + "\n\n" + verdicts(agg, tol, staleness) + "\n\nVersions: "
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".\n\n## What the overlap would give on 8 GPUs\n\n"
          + proj_md)
    (args.out / "rl_async.md").write_text(md + "\n")
    (args.out / "rl_async.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions, "seeds": seeds,
         "settings": settings, "noise": tol, "figures": agg, "projection": proj,
         "runs": {str(s): r for s, r in per_seed.items()}}, indent=2, default=str) + "\n")
    plot(per_seed, agg, args.out / "rl_async.png", args.smooth)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
