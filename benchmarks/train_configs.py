"""Sharding and memory configurations side by side: one tiny Qwen3, same data, one run.

Each configuration trains the same model (same init, same synthetic batches) in its own
fresh set of processes (`python -m torch.distributed.run ... benchmarks/_train_worker.py`)
and reports step time, tokens/s, activation bytes saved for backward, per-rank bytes of
parameters + gradients + AdamW state (held, and the sharding plan's estimate), peak RSS
and the final loss, with ratios to the `full_shard` baseline.

    python benchmarks/train_configs.py                       # every configuration, ~4-5 min on 2 CPU cores
    python benchmarks/train_configs.py --only full_shard,recompute_layers --steps 3 --runs 1

Writes train_configs.{json,md,csv,png} to --out (default results/bench) and prints the
markdown table. A configuration whose run fails is reported as `unavailable: <error>`;
the others go on. See benchmarks/README.md for the columns and the caveats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import MIB, clear_stale, machine_info, parse_only, ratio, run_rounds, run_worker, torchrun, write_csv

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_train_worker.py"
BASELINE = "full_shard"

MODEL = ("model.config={model_type: qwen3, hidden_size: 256, intermediate_size: 1024, "
         "num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 64, "
         "vocab_size: 512, max_position_embeddings: 4096, tie_word_embeddings: false}")
MAX_SEQ_LEN = 4096
"""The model's max_position_embeddings."""


@dataclass(frozen=True)
class BenchConfig:
    """A named configuration: shardwise overrides applied on top of the common ones."""

    name: str
    overrides: tuple[str, ...]


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig(BASELINE, ()),
    BenchConfig("shard_grad_op", ("parallel.sharding_strategy=shard_grad_op",)),
    BenchConfig("no_shard", ("parallel.sharding_strategy=no_shard",)),
    BenchConfig("offload", ("fsdp.offload.enabled=true", "fsdp.offload.pin_memory=false")),
    BenchConfig("recompute_layers", ("fsdp.recompute.modules=[Qwen3DecoderLayer]",)),
    BenchConfig("recompute_mlp", ("fsdp.recompute.modules=[model.layers.{*}.mlp]",)),
    BenchConfig("tiled_mlp", ("fsdp.tiled_mlp.enabled=true", "fsdp.tiled_mlp.shards=4")),
    BenchConfig("prefetch", ("fsdp.prefetch.forward=1", "fsdp.prefetch.backward=2")),
    BenchConfig("bf16", ("fsdp.mixed_precision.param_dtype=bf16",)),
    BenchConfig("ulysses_sp2", ("parallel.ulysses_size=2",)),
)


def common_overrides(args: argparse.Namespace) -> list[str]:
    """What every configuration shares: the model, fp32 compute, the batch and the optimizer
    (constant LR, no warm-up, so a few steps visibly lower the loss)."""
    return [
        MODEL,
        "fsdp.mixed_precision.param_dtype=fp32",
        f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={args.micro * args.nproc}",
        f"train.max_steps={args.warmup + args.steps}",
        "train.optimizer.lr=1e-3",
        "train.scheduler.name=constant",
        "train.scheduler.warmup_steps=0",
        "run.seed=0",
    ]


def launch(config: BenchConfig, round_no: int, args: argparse.Namespace, raw_dir: Path,
           log_dir: Path) -> dict[str, Any]:
    """One run of a configuration in fresh processes: the worker's record, or
    {"name", "overrides", "error"} if it failed. Either has the run's `wall_s`."""
    tag = f"{config.name}.run{round_no}"
    raw_json = raw_dir / f"{tag}.json"
    clear_stale(raw_json)
    cmd = [
        *torchrun(args.nproc, WORKER),
        "--name", config.name, "--out", str(raw_json),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--seq-len", str(args.seq_len), "--micro", str(args.micro),
    ]
    for override in [*common_overrides(args), *config.overrides]:
        cmd += ["--override", override]
    record, wall_s = run_worker(cmd, args.nproc, args.timeout, log_dir / f"{tag}.log", raw_json)
    if "error" in record:
        record = {"name": config.name, "overrides": list(config.overrides), "error": record["error"]}
    record["wall_s"] = wall_s
    return record


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's record over its runs: the measured steps of all runs pooled
    (median and quartiles); memory and losses from the first run (they are deterministic;
    every run's own numbers stay under `runs`)."""
    steps = [s for run in runs for s in run["step_s"]]
    median = statistics.median(steps)
    p25, _, p75 = statistics.quantiles(steps, n=4, method="inclusive") if len(steps) > 1 else (median,) * 3
    per_run_keys = ("step_s", "median_step_s", "tokens_per_s", "wall_s", "activation_bytes", "state_bytes",
                    "final_loss", "ranks")
    merged = {k: v for k, v in runs[0].items() if k not in per_run_keys}
    merged.update(
        step_s=steps, median_step_s=median, step_s_p25=p25, step_s_p75=p75,
        tokens_per_s=runs[0]["tokens_per_step"] / median,
        activation_bytes=runs[0]["activation_bytes"], state_bytes=runs[0]["state_bytes"],
        final_loss=runs[0]["final_loss"], wall_s=sum(run["wall_s"] for run in runs),
        runs=[{k: run[k] for k in per_run_keys} for run in runs],
    )
    return merged


def run_all(selected: list[BenchConfig], args: argparse.Namespace, raw_dir: Path,
            log_dir: Path) -> list[dict[str, Any]]:
    """`args.runs` rounds over the configurations (`harness.run_rounds`). One record per configuration."""
    return run_rounds(
        selected, args.runs, lambda config, round_no: launch(config, round_no, args, raw_dir, log_dir), merge_runs,
        lambda r: (f"{r['median_step_s']:.3f} s/step, activations {r['activation_bytes'] / MIB:.1f} MiB, "
                   f"state {r['state_bytes'] / MIB:.1f} MiB/rank, final loss {r['final_loss']:.4f}"), 17)


# -- report

def table_rows(records: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """One flat row per configuration: absolute values and ratios to the baseline's."""
    base = next((r for r in records if r["name"] == baseline and "error" not in r), None)
    rows = []
    for r in records:
        if "error" in r:
            rows.append({"config": r["name"], "status": f"unavailable: {r['error']}"})
            continue
        rows.append({
            "config": r["name"],
            "status": "ok",
            "step_s": r["median_step_s"],
            "step_s_p25": r["step_s_p25"],
            "step_s_p75": r["step_s_p75"],
            "step_x": ratio(r["median_step_s"], base and base["median_step_s"]),
            "tokens_per_s": r["tokens_per_s"],
            "activation_bytes": r["activation_bytes"],
            "activation_x": ratio(r["activation_bytes"], base and base["activation_bytes"]),
            "state_bytes": r["state_bytes"],
            "state_x": ratio(r["state_bytes"], base and base["state_bytes"]),
            "plan_estimate_bytes": r["plan_estimate_bytes"],
            "peak_rss_bytes": r["peak_rss_bytes"],
            "final_loss": r["final_loss"],
            "loss_delta": None if base is None else r["final_loss"] - base["final_loss"],
        })
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], baseline: str, records: list[dict[str, Any]],
             machine: dict[str, Any]) -> str:
    ok = next((r for r in records if "error" not in r), None)
    setup = ("" if ok is None else
             f"{ok['world_size']} ranks x micro-batch {ok['micro_batch']} x {ok['seq_len']} tokens "
             f"({ok['tokens_per_step']} tokens per step); step time: median of {len(ok['step_s'])} steps "
             f"({len(ok['runs'])} runs x {ok['measured_steps']} steps after {ok['warmup_steps']} warm-up); ")
    lines = [
        (f"Tiny Qwen3 (hidden 256, 4 layers, vocab 512), {setup}"
         f"{machine['device']}, {machine['backend']}, torch {machine['torch']}, {machine['cpu_count']} CPUs. "
         f"x = ratio to `{baseline}`."),
        "",
        ("| config | step s | p25-p75 | x | tokens/s | activations MiB ¹ | x | state MiB/rank ² | x "
         "| plan est. MiB ² | peak RSS MiB ³ | final loss | Δ loss |"),
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['config']} | {row['status']} |" + " |" * 11)
            continue
        lines.append(
            f"| {row['config']} | {row['step_s']:.3f} | {row['step_s_p25']:.3f}-{row['step_s_p75']:.3f} "
            f"| {_fmt(row['step_x'], '.2f')} "
            f"| {row['tokens_per_s']:.0f} "
            f"| {row['activation_bytes'] / MIB:.1f} | {_fmt(row['activation_x'], '.2f')} "
            f"| {row['state_bytes'] / MIB:.1f} | {_fmt(row['state_x'], '.2f')} "
            f"| {row['plan_estimate_bytes'] / MIB:.1f} | {row['peak_rss_bytes'] / MIB:.0f} "
            f"| {row['final_loss']:.4f} | {_fmt(row['loss_delta'], '+.1e')} |")
    lines += [
        "",
        ("¹ Bytes autograd saves for backward during the forward (and loss) of one micro-batch on "
         "one rank, seen by `torch.autograd.graph.saved_tensors_hooks`: each saved tensor's whole "
         "storage, counted once per storage (`untyped_storage().data_ptr()`); `nn.Parameter` objects "
         "and tensors sharing a storage with a parameter (e.g. a linear's transposed weight, FSDP2's "
         "unsharded parameters) are not counted. Recomputed modules count the inputs checkpointing "
         "saves, not what they recompute; tiled MLPs count the input they keep. Max over ranks."),
        ("² Parameters + gradients + AdamW state (exp_avg, exp_avg_sq, step) one rank holds just after "
         "`optimizer.step()` of the last step: local shards of DTensors, each storage counted once at "
         "its full (padded) size; max over ranks. `plan est.` is "
         "`plan.memory_per_rank_bytes[rank][\"total\"]`, max over ranks."),
        ("³ Peak resident set size of a rank process (`ru_maxrss`), max over ranks: coarse; it "
         "includes the Python / torch / transformers runtime and rank 0's full-model init."),
    ]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("config", "status", "step_s", "step_s_p25", "step_s_p75", "step_x", "tokens_per_s",
              "activation_bytes", "activation_x", "state_bytes", "state_x", "plan_estimate_bytes",
              "peak_rss_bytes", "final_loss", "loss_delta")


def write_plot(path: Path, rows: list[dict[str, Any]], baseline: str) -> None:
    """Horizontal bars of the step-time, activation and state ratios; a dashed line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows][::-1]
    panels = (("step_x", "step time"), ("activation_x", "activation bytes"), ("state_x", "state bytes / rank"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.45 * len(rows) + 1.6), sharey=True)
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [r.get(key) for r in rows][::-1]
        bars = ax.barh(names, [v or 0.0 for v in values], color="tab:blue")
        for bar, value in zip(bars, values, strict=True):
            label = "n/a" if value is None else f"{value:.2f}"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {label}", va="center", fontsize=8)
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{title} (x {baseline})")
        ax.set_xlim(0, max([v for v in values if v is not None] + [1.0]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [c.name for c in CONFIGS]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per configuration (default 2)")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps per run (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
    p.add_argument("--runs", type=int, default=2,
                   help="fresh runs per configuration, in alternating order; their steps are pooled (default 2)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row (default 1024)")
    p.add_argument("--micro", type=int, default=1, help="rows per rank per step (default 1)")
    p.add_argument("--out", type=Path, default=Path("results/bench"), help="results folder")
    p.add_argument("--only", type=str, default=None, help=f"comma-separated subset of: {','.join(names)}")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs (make test): the baseline only (unless --only), "
                        "1 run of 1+1 steps of 16 tokens; its numbers mean nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.only = args.only or BASELINE
        args.runs, args.warmup, args.steps, args.seq_len = 1, 1, 1, 16
    if min(args.nproc, args.steps, args.warmup, args.runs, args.micro) < 1:
        p.error("--nproc, --steps, --warmup, --runs and --micro must be at least 1")
    if not 4 <= args.seq_len <= MAX_SEQ_LEN:
        p.error(f"--seq-len must be between 4 and {MAX_SEQ_LEN}")
    args.only = parse_only(p, args.only, names, "configuration(s)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = [c for c in CONFIGS if args.only is None or c.name in args.only]
    baseline = BASELINE if any(c.name == BASELINE for c in selected) else selected[0].name
    out: Path = args.out
    raw_dir, log_dir = out / "raw", out / "logs"
    for d in (raw_dir, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    machine = machine_info(args.nproc)
    print(f"train_configs: {len(selected)} configuration(s), {args.nproc} ranks each, "
          f"{args.runs} runs of {args.warmup}+{args.steps} steps of {args.micro * args.nproc} x {args.seq_len} "
          f"tokens; logs in {log_dir}", flush=True)
    records = run_all(selected, args, raw_dir, log_dir)

    rows = table_rows(records, baseline)
    table = markdown(rows, baseline, records, machine)
    (out / "train_configs.json").write_text(json.dumps(
        {"machine": machine, "baseline": baseline, "common_overrides": common_overrides(args),
         "configs": records}, indent=2) + "\n")
    (out / "train_configs.md").write_text(table)
    write_csv(out / "train_configs.csv", rows, CSV_FIELDS)
    write_plot(out / "train_configs.png", rows, baseline)
    print()
    print(table)
    print(f"wrote {out}/train_configs.{{json,md,csv,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
