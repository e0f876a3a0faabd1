"""Seed 002's "DDP vs FSDP" memory table, measured: a BERT masked LM under torch DDP and
under shardwise's four sharding strategies, bytes per rank side by side in one run.

Each row trains the same BERT (same seeded init, same masked batches, AdamW, fp32) for a
few steps in its own fresh set of processes (`python -m torch.distributed.run ...
benchmarks/_encoder_memory_worker.py`, one rank) and reports what one rank holds:
parameters, gradients and AdamW state after an optimizer step, the whole (gathered)
parameters it holds between forward and backward, the sharding plan's estimate and the
peak RSS of every rank, with ratios to DDP.

    python benchmarks/encoder_memory.py                  # 5 rows, about 2 minutes on 2 CPU cores
    python benchmarks/encoder_memory.py --only ddp,full_shard --layers 4 --hidden 256

Writes encoder_memory.{json,md,csv,png} to --out (default results/encoder_memory) and
prints the markdown tables. A row whose run fails is reported as `unavailable: <error>`.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import MIB, clear_stale, machine_info, parse_only, run_worker, torchrun, write_csv

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_encoder_memory_worker.py"
BASELINE = "ddp"


@dataclass(frozen=True)
class Row:
    """A named configuration: its ranks, and shardwise overrides (none for the DDP baseline)."""

    name: str
    seed_name: str
    """How seed 002 (FSDP1) names it."""
    nproc: int
    overrides: tuple[str, ...]


ROWS: tuple[Row, ...] = (
    Row(BASELINE, "DDP", 2, ()),
    Row("no_shard", "NO_SHARD", 2, ("parallel.sharding_strategy=NO_SHARD",)),
    Row("shard_grad_op", "SHARD_GRAD_OP", 2, ("parallel.sharding_strategy=SHARD_GRAD_OP",)),
    Row("full_shard", "FULL_SHARD", 2, ("parallel.sharding_strategy=FULL_SHARD",)),
    Row("hybrid_shard", "HYBRID_SHARD", 4, ("parallel.sharding_strategy=HYBRID_SHARD", "parallel.fsdp_size=2")),
)


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The BERT config (no dropout: every row computes the same losses)."""
    return {"model_type": "bert", "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64, "vocab_size": args.vocab,
            "max_position_embeddings": max(512, args.seq_len), "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}


def launch(row: Row, args: argparse.Namespace, raw_dir: Path, log_dir: Path) -> dict[str, Any]:
    """One run of `row` in fresh processes: the worker's record, or {"name", "error"}."""
    raw_json = raw_dir / f"{row.name}.json"
    clear_stale(raw_json)
    cmd = [*torchrun(row.nproc, WORKER),
           "--name", row.name, "--out", str(raw_json), "--model", json.dumps(model_fields(args)),
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch)]
    for override in row.overrides:
        cmd += ["--override", override]
    record, wall_s = run_worker(cmd, row.nproc, args.timeout, log_dir / f"{row.name}.log", raw_json)
    if "error" in record:
        record["name"] = row.name
    record.update(wall_s=wall_s, seed_name=row.seed_name, nproc=row.nproc, overrides=list(row.overrides))
    return record


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per configuration: the largest rank's bytes and the ratios to DDP's."""
    rows = []
    for r in records:
        if "error" in r:
            rows.append({"config": r["name"], "seed_name": r["seed_name"], "status": f"unavailable: {r['error']}"})
            continue
        ranks = r["ranks"]
        rows.append({
            "config": r["name"], "seed_name": r["seed_name"], "status": "ok", "ranks": r["world_size"],
            **{k: max(x["state_bytes"][k] for x in ranks) for k in ("params", "grads", "optimizer", "total")},
            "full_params_after_forward": max(x["full_params_after_forward_bytes"] for x in ranks),
            "plan_estimate": (max(x["plan_estimate_bytes"] for x in ranks)
                              if ranks[0]["plan_estimate_bytes"] is not None else None),
            "peak_rss": [x["peak_rss_bytes"] for x in ranks],
            "final_loss": r["final_loss"],
        })
    base = next((x for x in rows if x["config"] == BASELINE and x["status"] == "ok"), None)
    for x in rows:
        if x["status"] == "ok" and base is not None:
            x["total_x"] = x["total"] / base["total"]
            x["after_forward_x"] = x["full_params_after_forward"] / base["full_params_after_forward"]
            x["rss_x"] = max(x["peak_rss"]) / max(base["peak_rss"])
            x["loss_delta"] = x["final_loss"] - base["final_loss"]
    return rows


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / MIB:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(rows: list[dict[str, Any]], records: list[dict[str, Any]], args: argparse.Namespace,
             machine: dict[str, Any]) -> str:
    f = model_fields(args)
    lines = [
        (f"BERT masked LM (hidden {f['hidden_size']}, {f['num_hidden_layers']} layers, {f['num_attention_heads']} "
         f"heads, vocab {f['vocab_size']}, tied decoder; fp32 weights, compute and AdamW), global batch "
         f"{args.global_batch} x {args.seq_len} tokens, {args.steps} steps; {machine['device']}, "
         f"{machine['backend']}, torch {machine['torch']}, {machine['cpu_count']} CPUs. x = ratio to DDP."),
        "",
        "Seed 002's table (DDP vs FSDP, memory use high / low), measured: MiB one rank holds.",
        "",
        "| | " + " | ".join(f"{r['seed_name']}" for r in rows) + " |",
        "|---|" + "--:|" * len(rows),
        "| ranks | " + " | ".join(str(r.get("ranks", "-")) for r in rows) + " |",
        "| params + grads + AdamW, MiB/rank | " + " | ".join(_mib(r.get("total")) for r in rows) + " |",
        "| x DDP | " + " | ".join(_x(r.get("total_x")) for r in rows) + " |",
        "| whole params between forward and backward, MiB | "
        + " | ".join(_mib(r.get("full_params_after_forward")) for r in rows) + " |",
        "| peak RSS, MiB (largest rank) | " + " | ".join(_mib(max(r["peak_rss"])) if r["status"] == "ok" else "-"
                                                       for r in rows) + " |",
        "",
        "Per rank, in detail:",
        "",
        ("| config | ranks | params MiB ¹ | grads MiB ¹ | AdamW MiB ¹ | total MiB ¹ | x DDP | plan est. MiB ² "
         "| whole params after forward MiB ³ | x DDP | peak RSS MiB per rank ⁴ | final loss | Δ loss |"),
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['status']} |" + " |" * 11)
            continue
        rss = " / ".join(f"{b / MIB:.0f}" for b in r["peak_rss"])
        lines.append(
            f"| {r['config']} | {r['ranks']} | {_mib(r['params'])} | {_mib(r['grads'])} | {_mib(r['optimizer'])} "
            f"| {_mib(r['total'])} | {_x(r.get('total_x'))} | {_mib(r['plan_estimate'])} "
            f"| {_mib(r['full_params_after_forward'])} | {_x(r.get('after_forward_x'))} | {rss} "
            f"| {r['final_loss']:.4f} | {'-' if r.get('loss_delta') is None else format(r['loss_delta'], '+.1e')} |")
    lines += [
        "",
        ("¹ In an optimizer post-step hook of the last step (gradients still there): local shards of "
         "DTensor parameters and gradients and every tensor of the AdamW state, each storage counted "
         "once at its full size (FSDP2 pads shards to equal rows); largest rank. DDP runs with "
         "`gradient_as_bucket_view=True` (its default keeps a second copy of the gradients in its buckets)."),
        "² shardwise's own estimate before any weight exists: `plan.memory_per_rank_bytes[rank][\"total\"]`.",
        ("³ Right after the first micro-batch's forward, before its backward: the bytes of parameters held "
         "whole (not as DTensor shards), each storage once. full_shard reshards every layer after its "
         "forward and keeps only the root unit (embeddings, tied decoder, head) gathered; shard_grad_op keeps "
         "every unit gathered until backward (FSDP1's SHARD_GRAD_OP: parameters are not resharded between "
         "forward and backward); no_shard and DDP hold everything whole all the time."),
        ("⁴ `ru_maxrss` of each rank process, rank 0 first: coarse, it includes the Python / torch / "
         "transformers runtime (most of it) and, for shardwise, rank 0's full model that it loads the "
         "shards from."),
        ("Every row trains the same model on the same tokens: the final losses agree to rounding (Δ loss), "
         "so the memory is compared at equal work."),
    ]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("config", "seed_name", "status", "ranks", "params", "grads", "optimizer", "total", "total_x",
              "plan_estimate", "full_params_after_forward", "after_forward_x", "peak_rss", "rss_x",
              "final_loss", "loss_delta")


def write_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """Stacked bars of params / grads / AdamW MiB per rank, with the ratio to DDP on top, and
    bars of the whole parameters held between forward and backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    names = [r["seed_name"] for r in ok]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    bottom = [0.0] * len(ok)
    for key, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        vals = [r[key] / MIB for r in ok]
        left.bar(names, vals, bottom=bottom, color=color, label=key if key != "optimizer" else "AdamW state")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(ok):
        left.text(i, bottom[i], f"{_x(r.get('total_x'))}x", ha="center", va="bottom", fontsize=9)
    left.set_ylabel("MiB per rank")
    left.set_title("params + grads + AdamW per rank (x DDP)")
    left.legend(fontsize=8)
    vals = [r["full_params_after_forward"] / MIB for r in ok]
    right.bar(names, vals, color="tab:purple")
    for i, r in enumerate(ok):
        right.text(i, vals[i], f"{_x(r.get('after_forward_x'))}x", ha="center", va="bottom", fontsize=9)
    right.set_ylabel("MiB per rank")
    right.set_title("whole parameters held between forward and backward")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [r.name for r in ROWS]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6, help="BERT layers (default 6)")
    p.add_argument("--hidden", type=int, default=384, help="hidden size, a multiple of 64 (default 384)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    p.add_argument("--global-batch", type=int, default=8, help="rows per step over all ranks (default 8)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2; the last is measured)")
    p.add_argument("--out", type=Path, default=Path("results/encoder_memory"), help="results folder")
    p.add_argument("--only", type=str, default=None, help=f"comma-separated subset of: {','.join(names)}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs (make test): full_shard only (unless --only), a 1-layer "
                        "BERT of hidden 64, vocab 128, 4 rows of 8 tokens, 1 step; its numbers mean nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.only = args.only or "full_shard"
        args.layers, args.hidden, args.vocab, args.seq_len, args.global_batch, args.steps = 1, 64, 128, 8, 4, 1
    if args.hidden % 64 or min(args.layers, args.steps, args.seq_len, args.vocab) < 1:
        p.error("--hidden must be a multiple of 64; --layers, --steps, --seq-len, --vocab at least 1")
    if args.global_batch % 4:
        p.error("--global-batch must divide over 2 and 4 ranks (a multiple of 4)")
    args.only = parse_only(p, args.only, names, "row(s)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = [r for r in ROWS if args.only is None or r.name in args.only]
    out: Path = args.out
    raw_dir, log_dir = out / "raw", out / "logs"
    for d in (raw_dir, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    args.nproc = max(r.nproc for r in selected)  # machine_info reports the threads of the largest row
    machine = machine_info(args.nproc)
    print(f"encoder_memory: {len(selected)} row(s); logs in {log_dir}", flush=True)
    records = []
    for i, row in enumerate(selected, 1):
        rec = launch(row, args, raw_dir, log_dir)
        records.append(rec)
        detail = (f"unavailable: {rec['error']}" if "error" in rec else
                  f"{max(x['state_bytes']['total'] for x in rec['ranks']) / MIB:.1f} MiB/rank, "
                  f"final loss {rec['final_loss']:.4f}")
        print(f"[{i}/{len(selected)}] {row.name:<14} {detail}  ({rec['wall_s']:.0f} s)", flush=True)
    rows = table_rows(records)
    table = markdown(rows, records, args, machine)
    (out / "encoder_memory.json").write_text(json.dumps(
        {"machine": machine, "baseline": BASELINE, "model": model_fields(args), "rows": records}, indent=2) + "\n")
    (out / "encoder_memory.md").write_text(table)
    write_csv(out / "encoder_memory.csv", rows, CSV_FIELDS,
              lambda v: " ".join(map(str, v)) if isinstance(v, list) else v)
    write_plot(out / "encoder_memory.png", rows)
    print()
    print(table)
    print(f"wrote {out}/encoder_memory.{{json,md,csv,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
