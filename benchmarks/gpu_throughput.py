"""Training throughput: a hand-written FSDP2 loop against shardwise, one model, one run.

Reproduces the throughput table of GPU.md in one command. Each row trains the same model
(same seeded init, same AdamW settings, same uniform random tokens, every position a loss
token) in its own fresh set of processes (`python -m torch.distributed.run ...
benchmarks/_throughput_worker.py`) and reports tokens/s, MFU, peak memory and the loss
after the last step, with tokens/s and memory as ratios to `hand_written_compile`:

- `hand_written`: `fully_shard` per decoder layer then the root, fp32 cross-entropy on the
  shifted logits, `clip_grad_norm_`, AdamW (fused on CUDA, foreach on CPU); the loop is
  written in the worker (`hand_written_loop`), not with shardwise code;
- `hand_written_compile`: the same with each decoder layer `torch.compile`d before
  `fully_shard` (torchtitan's order): the baseline;
- `shardwise`: `TrainEngine` with its fastest settings (`train.compile=true`,
  `train.chunked_loss.enabled=true`, `train.optimizer.fused=null`), then the same with
  each of them off in turn, to show what each gives.

    python benchmarks/gpu_throughput.py                     # --device auto: the GPU shape on CUDA, else the CPU one
    python benchmarks/gpu_throughput.py --device cpu --only hand_written_compile,shardwise

On CUDA: the Llama-3.2-1B shape, one process, bf16 compute (fp32 master weights, fp32
reduce), 4 rows x 2048 tokens per step, peak memory by `torch.cuda.max_memory_allocated`,
MFU against --peak-flops (989e12, an H100's dense bf16). On CPU: a tiny Llama, 2 gloo
ranks, fp32 compute, peak RSS, MFU n/a unless --peak-flops is given; about 2-4 minutes.

Writes gpu_throughput.{json,md,csv,png} to --out (default results/gpu_throughput) and
prints the markdown table. A row whose run fails is reported as `unavailable: <error>`;
the others go on. See benchmarks/README.md for the columns and the caveats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from harness import clear_stale, parse_only, ratio, run_rounds, run_worker, torchrun, worker_env, write_csv
from harness import machine_info as harness_machine_info

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_throughput_worker.py"
BASELINE = "hand_written_compile"
TARGET_ROW = "shardwise"
TARGET_TOKENS_X = 1.15
"""The issue's target: shardwise's tokens/s at least this times the baseline's ..."""
TARGET_PEAK_X = 1.0
"""... with peak memory no higher than this times the baseline's."""
MIB, GIB = 1024**2, 1024**3

GPU_MODEL: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
"""The Llama-3.2-1B shape (1.24 B parameters; its llama3 RoPE scaling left out: no effect on speed)."""
CPU_MODEL: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
"""A tiny Llama of the same kind (tied embeddings, grouped-query attention)."""


@dataclass(frozen=True)
class Mode:
    """What a device runs by default."""

    model: dict[str, Any]
    nproc: int
    rows: int
    seq_len: int
    compute_dtype: Literal["bf16", "fp32"]
    warmup: int
    steps: int
    peak_flops: float | None
    """Dense peak of one device in FLOP/s at the compute dtype; None: MFU is n/a."""


MODES = {
    "cuda": Mode(GPU_MODEL, nproc=1, rows=4, seq_len=2048, compute_dtype="bf16", warmup=5, steps=20,
                 peak_flops=989e12),
    "cpu": Mode(CPU_MODEL, nproc=2, rows=4, seq_len=256, compute_dtype="fp32", warmup=2, steps=30,
                peak_flops=None),
}


@dataclass(frozen=True)
class Row:
    """A named row: the hand-written loop (with or without per-layer compile), or shardwise
    with these overrides on top of the common ones."""

    name: str
    loop: Literal["hand", "shardwise"]
    about: str
    compile: bool = False
    chunked_loss: bool = False
    fused: bool | None = None
    """shardwise's `train.optimizer.fused` (None: fused on CUDA); the hand-written loop
    always asks for fused on CUDA and foreach on CPU."""

    @property
    def overrides(self) -> tuple[str, ...]:
        if self.loop == "hand":
            return ()
        return (f"train.compile={str(self.compile).lower()}",
                f"train.chunked_loss.enabled={str(self.chunked_loss).lower()}",
                f"train.optimizer.fused={'null' if self.fused is None else str(self.fused).lower()}")


ROWS: tuple[Row, ...] = (
    Row("hand_written", "hand", "fully_shard per decoder layer + root, plain fp32 cross-entropy, fused AdamW (foreach on CPU)"),
    Row(BASELINE, "hand", "the same, each decoder layer torch.compile'd before fully_shard", compile=True),
    Row("shardwise", "shardwise", "TrainEngine: compile, chunked loss, fused AdamW (its fastest settings)",
        compile=True, chunked_loss=True),
    Row("shardwise_no_compile", "shardwise", "shardwise with train.compile=false", chunked_loss=True),
    Row("shardwise_no_chunked_loss", "shardwise", "shardwise with train.chunked_loss.enabled=false", compile=True),
    Row("shardwise_no_fused_adamw", "shardwise", "shardwise with train.optimizer.fused=false",
        compile=True, chunked_loss=True, fused=False),
)


def yaml_value(value: Any) -> str:
    """`value` as the text of a shardwise override (parsed as YAML): PyYAML reads `1e-05`,
    what json and str write, as a string, and `1.0e-05` as the float."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return text.removesuffix("...").strip()


def common_overrides(args: argparse.Namespace) -> list[str]:
    """shardwise's settings of the hand-written loop: the model, fp32 master weights, the
    compute and reduce dtypes, one micro-batch per rank, AdamW (0.9, 0.95), eps 1e-8, no
    weight decay, a constant LR, clip at 1.0, the same init seed."""
    return [
        f"model.config={yaml_value(args.model)}",
        "model.dtype=fp32",
        "model.attn_implementation=sdpa",
        f"fsdp.mixed_precision.param_dtype={args.compute_dtype}",
        "fsdp.mixed_precision.reduce_dtype=fp32",
        f"train.micro_batch_size={args.rows // args.nproc}",
        f"train.global_batch_size={args.rows}",
        f"train.max_steps={args.warmup + args.steps}",
        f"train.optimizer.lr={yaml_value(args.lr)}",
        "train.optimizer.betas=[0.9, 0.95]",
        "train.optimizer.eps=1e-8",
        "train.optimizer.weight_decay=0.0",
        "train.scheduler.name=constant",
        "train.scheduler.warmup_steps=0",
        "train.grad_clip=1.0",
        f"train.chunked_loss.chunk_tokens={args.chunk_tokens}",
        "run.seed=0",
    ]


def model_flops(model: dict[str, Any], seq_len: int) -> dict[str, int]:
    """torchtitan's training FLOPs per token, 6 (N - N_embedding) + 12 L H Q T, from the
    model built on the meta device (N counts tied weights once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in m.parameters())
    n_emb = m.get_input_embeddings().weight.numel()
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"params": n, "embedding_params": n_emb,
            "flops_per_token": 6 * (n - n_emb) + 12 * layers * heads * head_dim * seq_len}


def launch(row: Row, round_no: int, args: argparse.Namespace, raw_dir: Path, log_dir: Path) -> dict[str, Any]:
    """One run of a row in fresh processes: the worker's record, or {"name", "error"} if it
    failed. Either has the run's `wall_s`."""
    tag = f"{row.name}.run{round_no}"
    raw_json = raw_dir / f"{tag}.json"
    clear_stale(raw_json)
    cmd = [
        *torchrun(args.nproc, WORKER), "--name", row.name, "--loop", row.loop, "--out", str(raw_json),
        "--model", json.dumps(args.model), "--compute-dtype", args.compute_dtype, "--lr", str(args.lr),
        "--rows", str(args.rows), "--seq-len", str(args.seq_len),
        "--warmup", str(args.warmup), "--steps", str(args.steps),
    ]
    if row.loop == "hand" and row.compile:
        cmd.append("--compile")
    for override in [*common_overrides(args), *row.overrides] if row.loop == "shardwise" else []:
        cmd += ["--override", override]
    env = worker_env(args.nproc)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even where a GPU exists
    record, wall_s = run_worker(cmd, args.nproc, args.timeout, log_dir / f"{tag}.log", raw_json, env)
    if "error" in record:
        record = {"name": row.name, "error": record["error"]}
    record["wall_s"] = wall_s
    return record


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's record over its runs. tokens/s: on CPU from the median of all runs' steps
    pooled, with their quartiles as the spread; on CUDA the median of the runs' timed blocks,
    with the runs' lowest and highest as the spread. Peak memory: the highest. Losses, build
    and warm-up times: the first run's (every run's own numbers stay under `runs`)."""
    per_run = ("tokens_per_s", "tokens_per_s_block", "tokens_per_s_p25_p75", "step_s", "timed_s", "peak_bytes",
               "build_s", "warmup_s", "wall_s", "final_loss", "losses", "ranks")
    merged = {k: v for k, v in runs[0].items() if k not in per_run}
    if runs[0]["tokens_per_s_from"] == "median step":
        steps = [s for r in runs for s in r["step_s"]]
        median = statistics.median(steps)
        p25, _, p75 = statistics.quantiles(steps, n=4, method="inclusive") if len(steps) > 1 else (median,) * 3
        tokens_per_s, spread = runs[0]["tokens_per_step"] / median, [runs[0]["tokens_per_step"] / s for s in (p75, p25)]
    else:
        values = [r["tokens_per_s"] for r in runs]
        tokens_per_s, spread = statistics.median(values), [min(values), max(values)]
    merged.update(
        tokens_per_s=tokens_per_s, tokens_per_s_spread=spread,
        peak_bytes=max(r["peak_bytes"] for r in runs),
        build_s=runs[0]["build_s"], warmup_s=runs[0]["warmup_s"],
        losses=runs[0]["losses"], final_loss=runs[0]["final_loss"],
        wall_s=sum(r["wall_s"] for r in runs),
        runs=[{k: r[k] for k in per_run} for r in runs],
    )
    return merged


def run_all(selected: list[Row], args: argparse.Namespace, raw_dir: Path, log_dir: Path) -> list[dict[str, Any]]:
    """`args.runs` rounds over the rows (`harness.run_rounds`). One record per row."""
    return run_rounds(
        selected, args.runs, lambda row, round_no: launch(row, round_no, args, raw_dir, log_dir), merge_runs,
        lambda r: (f"{r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_bytes'] / MIB:,.0f} MiB, "
                   f"loss {r['final_loss']:.4f}, warm-up {r['warmup_s']:.0f} s"), 26)


# -- what ran

def in_effect(row: Row, record: dict[str, Any], args: argparse.Namespace) -> tuple[str, list[str]]:
    """What the worker saw (compiled graphs, LM-head calls, the AdamW kernel) in words, and
    the row's settings that were asked for but not seen."""
    micro_tokens = args.rows // args.nproc * args.seq_len
    graphs = record["compiled_graphs"]
    head_calls, head_tokens = record["lm_head_calls_step0"], record["lm_head_max_logit_tokens_step0"]
    chunked = head_tokens < micro_tokens
    if head_tokens == 0:
        loss = f"no (tokens x vocab) logits from the LM head ({head_calls} call(s))"
    elif chunked:
        loss = f"logits in {head_calls} call(s) of <= {head_tokens} tokens"
    else:
        loss = f"full logits ({head_tokens} tokens)"
    seen = f"{'compiled: ' + str(graphs) + ' graph(s)' if graphs else 'eager'}; {loss}; AdamW {record['optimizer']}"
    want_optimizer = "fused" if args.device == "cuda" and row.fused is not False else "foreach"
    missing = []
    if bool(graphs) != row.compile:
        missing.append("compile" if row.compile else "eager")
    if chunked != row.chunked_loss:
        missing.append("chunked loss" if row.chunked_loss else "full logits")
    if record["optimizer"] != want_optimizer:
        missing.append(f"{want_optimizer} AdamW")
    return seen, missing


def table_rows(records: list[dict[str, Any]], rows: list[Row], args: argparse.Namespace,
               flops: dict[str, int]) -> list[dict[str, Any]]:
    """One flat row per benchmark row: absolute values, ratios to the baseline's, MFU."""
    base = next((r for r in records if r["name"] == args.baseline and "error" not in r), None)
    out = []
    for row, r in zip(rows, records, strict=True):
        if "error" in r:
            out.append({"row": row.name, "status": f"unavailable: {r['error']}"})
            continue
        seen, missing = in_effect(row, r, args)
        mfu = (None if args.peak_flops is None else
               r["tokens_per_s"] * flops["flops_per_token"] / (args.peak_flops * r["world_size"]))
        out.append({
            "row": row.name,
            "status": "ok" if not missing else "not as asked: " + ", ".join(f"no {m}" for m in missing),
            "tokens_per_s": r["tokens_per_s"],
            "tokens_per_s_low": r["tokens_per_s_spread"][0],
            "tokens_per_s_high": r["tokens_per_s_spread"][1],
            "tokens_x": ratio(r["tokens_per_s"], base and base["tokens_per_s"]),
            "mfu": mfu,
            "peak_bytes": r["peak_bytes"],
            "peak_x": ratio(r["peak_bytes"], base and base["peak_bytes"]),
            "final_loss": r["final_loss"],
            "loss_delta": None if base is None else r["final_loss"] - base["final_loss"],
            "warmup_s": r["warmup_s"],
            "seen": seen,
        })
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def verdict(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The issue's target, met or not, in one sentence."""
    target = next((r for r in rows if r["row"] == TARGET_ROW), None)
    goal = (f"target: `{TARGET_ROW}` >= {TARGET_TOKENS_X:.2f}x the tokens/s of `{args.baseline}` with peak "
            f"memory <= {TARGET_PEAK_X:.2f}x")
    if target is None:
        return f"{goal}: `{TARGET_ROW}` not run."
    if target.get("tokens_x") is None:
        why = target["status"] if target["status"].startswith("unavailable") else f"`{args.baseline}` unavailable"
        return f"{goal}: cannot tell ({why})."
    met = target["tokens_x"] >= TARGET_TOKENS_X and target["peak_x"] <= TARGET_PEAK_X
    text = (f"{goal}: {target['tokens_x']:.2f}x tokens/s, {target['peak_x']:.2f}x peak memory: "
            f"{'met' if met else 'not met'}")
    if target["status"] != "ok":
        text += f" ({target['status']})"
    if args.device != "cuda":
        text += "; the target is a GPU one, and a tiny model on CPU says nothing about it"
    return text + "."


def markdown(rows: list[dict[str, Any]], selected: list[Row], args: argparse.Namespace, flops: dict[str, int],
             machine: dict[str, Any]) -> str:
    m, cuda = args.model, args.device == "cuda"
    mem_div, mem_name, mem_digits = (GIB, "peak GiB", 1) if cuda else (MIB, "peak RSS MiB", 0)
    lines = [
        (f"{m['model_type']} hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
         f"{m['num_attention_heads']} / {m['num_key_value_heads']} heads of {m.get('head_dim') or m['hidden_size'] // m['num_attention_heads']}, intermediate "
         f"{m['intermediate_size']}, vocab {m['vocab_size']}, tied embeddings: {flops['params'] / 1e6:,.1f} M "
         f"parameters; fp32 master weights, {args.compute_dtype} compute, fp32 reduce; AdamW; uniform random tokens, "
         f"{args.rows} rows x {args.seq_len} tokens per step over {args.nproc} rank(s), every position a loss token; "
         f"{args.warmup} warm-up then {args.steps} timed steps, {args.runs} run(s) per row. "
         f"{machine['device']}, {machine['backend']}, torch {machine['torch']}, {machine['cpu_count']} CPUs. "
         f"x = ratio to `{args.baseline}`."),
        "",
        (f"| row | tokens/s ¹ | {'range of runs' if cuda else 'p25-p75 of steps'} | x | MFU ² | {mem_name} ³ | x "
         f"| loss after {args.warmup + args.steps} steps | Δ loss | warm-up s ⁴ | what ran ⁵ |"),
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for row in rows:
        if row["status"].startswith("unavailable"):
            lines.append(f"| {row['row']} | {row['status']} |" + " |" * 10)
            continue
        flag = "" if row["status"] == "ok" else f" **{row['status']}**"
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        lines.append(
            f"| {row['row']} | {row['tokens_per_s']:,.0f} "
            f"| {row['tokens_per_s_low']:,.0f}-{row['tokens_per_s_high']:,.0f} | {_fmt(row['tokens_x'], '.2f')} "
            f"| {mfu} | {row['peak_bytes'] / mem_div:,.{mem_digits}f} | {_fmt(row['peak_x'], '.2f')} "
            f"| {row['final_loss']:.4f} | {_fmt(row['loss_delta'], '+.1e')} | {row['warmup_s']:.0f} "
            f"| {row['seen']}{flag} |")
    lines += ["", verdict(rows, args), "", "Rows:", ""]
    lines += [f"- `{r.name}`: {r.about}" + (f" (`{' '.join(r.overrides)}`)" if r.overrides else "") for r in selected]
    peak = ("n/a: no --peak-flops given" if args.peak_flops is None else
            f"against {args.peak_flops:.4g} FLOP/s per rank")
    lines += [
        "",
        ("¹ " + ("Tokens of the timed steps / the wall time of the timed block (synchronised before and after); "
                 "`range of runs`: the lowest and highest run." if cuda else
                 "Tokens per step / the median step time (each step as long as its slowest rank; every op is "
                 "synchronous on CPU), the steps of all runs pooled; `p25-p75`: the same from the quartiles. On a "
                 "shared CPU the ratios move by tens of percent from run to run.")),
        (f"² torchtitan's count: 6·(N − N_embedding) + 12·L·H·Q·T = {flops['flops_per_token'] / 1e9:.4g} GFLOP per "
         f"token (N = {flops['params']:,} with the tied embedding once, N_embedding = "
         f"{flops['embedding_params']:,}), x tokens/s, {peak}."),
        ("³ " + ("`torch.cuda.max_memory_allocated` over the timed steps (reset after the warm-up); max over ranks."
                 if cuda else
                 "Peak resident set size of a rank over the timed steps (`VmHWM`, reset after the warm-up through "
                 "`/proc/self/clear_refs`); max over ranks. It includes the Python / torch runtime and, in compiled "
                 "rows, the compiler's own memory, so on a tiny model it mostly measures those.")),
        ("⁴ Wall seconds of the warm-up steps: compilation happens there (the first compile on a machine also "
         "fills the inductor cache, so later ones are faster). Not in tokens/s."),
        ("⁵ What the worker saw: graphs dynamo compiled; what the LM head module returned on step 0: full "
         "logits over every position of a rank's micro-batch, or, with a chunked loss, logits of at most "
         f"{args.chunk_tokens} tokens a call or no logits at all (shardwise's chunked head returns per-token "
         "log-probs from the head's forward); the AdamW kernel. **not as asked**: a setting of the row that did not take "
         "effect, so the row's numbers are not those of its settings."),
    ]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("row", "status", "tokens_per_s", "tokens_per_s_low", "tokens_per_s_high", "tokens_x", "mfu", "peak_bytes", "peak_x", "final_loss", "loss_delta",
              "warmup_s", "seen")


def write_plot(path: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Two panels of horizontal bars, tokens/s and peak memory per row, each labelled with
    its value and its ratio to the baseline (grey); hatched: a row whose settings did not
    all take effect; unavailable rows are labelled so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem_div, mem_title = (GIB, "peak GiB") if args.device == "cuda" else (MIB, "peak RSS MiB")
    rows = rows[::-1]  # the first row on top
    names = [r["row"] for r in rows]
    panels = (("tokens_per_s", "tokens_x", 1.0, "tokens/s", ",.0f"), ("peak_bytes", "peak_x", mem_div, mem_title, ",.1f"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.8), sharey=True)
    for ax, (key, x_key, div, title, spec) in zip(axes, panels, strict=True):
        values = [None if r.get(key) is None else r[key] / div for r in rows]
        bars = ax.barh(names, [v or 0.0 for v in values],
                       color=["tab:gray" if r["row"] == args.baseline else "tab:blue" for r in rows])
        for bar, row, value in zip(bars, rows, values, strict=True):
            if row["status"].startswith("not as asked"):
                bar.set_hatch("//")
                bar.set_edgecolor("white")
            x = row.get(x_key)
            label = "unavailable" if value is None else f"{value:{spec}}" + ("" if x is None else f"  ({x:.2f}x)")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {label}", va="center", fontsize=8)
        ax.set_title(title)
        ax.set_xlim(0, max([v for v in values if v is not None] + [1e-9]) * 1.45)
    m = args.model
    fig.suptitle(f"{m['model_type']} hidden {m['hidden_size']} x {m['num_hidden_layers']} layers, {args.rows} x "
                 f"{args.seq_len} tokens/step, {args.compute_dtype}, {args.nproc} rank(s) on {args.device}; "
                 f"(x {args.baseline}, grey); hatched: a setting not in effect", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    return harness_machine_info(args.nproc, cuda=args.device == "cuda")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [r.name for r in ROWS]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda if available, else cpu; picks the defaults below")
    p.add_argument("--nproc", type=int, help="ranks per row (cuda 1, cpu 2)")
    p.add_argument("--rows", type=int, help="rows per step over all ranks (4)")
    p.add_argument("--seq-len", type=int, help="tokens per row (cuda 2048, cpu 256)")
    p.add_argument("--warmup", type=int, help="untimed steps first (cuda 5, cpu 2)")
    p.add_argument("--steps", type=int, help="timed steps (cuda 20, cpu 30)")
    p.add_argument("--runs", type=int, default=1,
                   help="fresh runs per row, in alternating order; tokens/s is their median (default 1)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate, constant (default 3e-4)")
    p.add_argument("--chunk-tokens", type=int,
                   help="shardwise's train.chunked_loss.chunk_tokens (default: a quarter of a rank's micro-batch: "
                        "2048 on cuda, the schema default; 128 on cpu)")
    p.add_argument("--peak-flops", type=float,
                   help="dense peak FLOP/s of one device at the compute dtype, for MFU (cuda 989e12, an H100's bf16; "
                        "cpu: none, MFU n/a)")
    p.add_argument("--model", type=json.loads, help="the HF config as a JSON object instead of the mode's")
    p.add_argument("--out", type=Path, default=Path("results/gpu_throughput"), help="results folder")
    p.add_argument("--only", help=f"comma-separated subset of: {','.join(names)}")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default 1200)")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs (make test): shardwise_no_compile only (unless --only; "
                        "no compile time), the CPU mode's tiny Llama, 1+1 steps of one 16-token row per rank; "
                        "its numbers mean nothing")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu":
            print("gpu_throughput: torch sees no CUDA device: running the CPU mode (a tiny Llama on gloo ranks, "
                  "fp32), which shows that every row runs and takes its settings, not the GPU target "
                  "(--device cuda on a GPU machine)", flush=True)
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    mode = MODES[args.device]
    if args.smoke:
        args.only = args.only or "shardwise_no_compile"
        args.model = args.model or CPU_MODEL
        args.nproc = args.nproc or mode.nproc
        args.rows, args.seq_len, args.warmup, args.steps = args.nproc, 16, 1, 1
    for key in ("model", "nproc", "rows", "seq_len", "warmup", "steps", "peak_flops"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(mode, key))
    args.compute_dtype = mode.compute_dtype
    if min(args.nproc, args.rows, args.warmup, args.steps, args.runs) < 1 or args.seq_len < 2:
        p.error("--nproc, --rows, --warmup, --steps and --runs must be at least 1, --seq-len at least 2")
    if args.rows % args.nproc:
        p.error(f"--rows {args.rows} must be a multiple of --nproc {args.nproc}")
    if args.chunk_tokens is None:
        args.chunk_tokens = max(1, args.rows // args.nproc * args.seq_len // 4)
    args.only = parse_only(p, args.only, names, "row(s)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = [r for r in ROWS if args.only is None or r.name in args.only]
    args.baseline = BASELINE if any(r.name == BASELINE for r in selected) else selected[0].name
    out: Path = args.out
    raw_dir, log_dir = out / "raw", out / "logs"
    for d in (raw_dir, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    machine = machine_info(args)
    flops = model_flops(args.model, args.seq_len)
    print(f"gpu_throughput: {len(selected)} row(s) on {args.device}, {args.nproc} rank(s), {args.runs} run(s) of "
          f"{args.warmup}+{args.steps} steps of {args.rows} x {args.seq_len} tokens, "
          f"{flops['params'] / 1e6:,.1f} M parameters; logs in {log_dir}", flush=True)
    start = time.perf_counter()
    records = run_all(selected, args, raw_dir, log_dir)
    wall_s = time.perf_counter() - start

    rows = table_rows(records, selected, args, flops)
    table = markdown(rows, selected, args, flops, machine)
    settings = {k: getattr(args, k) for k in ("device", "nproc", "rows", "seq_len", "compute_dtype", "warmup", "steps",
                                              "runs", "lr", "chunk_tokens", "peak_flops", "model")}
    (out / "gpu_throughput.json").write_text(json.dumps(
        {"machine": machine, "settings": settings, "flops": flops, "baseline": args.baseline, "wall_s": wall_s,
         "common_overrides": common_overrides(args),
         "rows": [{**rec, "about": row.about, "row_overrides": list(row.overrides)}
                  for row, rec in zip(selected, records, strict=True)],
         "table": rows}, indent=2) + "\n")
    (out / "gpu_throughput.md").write_text(table)
    write_csv(out / "gpu_throughput.csv", rows, CSV_FIELDS)
    write_plot(out / "gpu_throughput.png", rows, args)
    print()
    print(table)
    print(f"wrote {out}/gpu_throughput.{{json,md,csv,png}} in {wall_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
