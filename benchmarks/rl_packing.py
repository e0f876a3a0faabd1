"""Padding-free RL forwards (``rl.packing``) and token-budget micro-batches against padded
rows, side by side in one run, on the actor's real passes.

One process (gloo, world size 1) builds the real `ActorWorker` on the demo's model
(examples/sft_reverse.yaml's tiny Qwen3, fp32) and, for rollout batches laid out as the
rollout makes them (left-padded prompts, right-padded responses) with answers of mixed
length, times the old-log-prob forward and the PPO update (one epoch, one mini-batch, the
KL and entropy terms on) under three settings:

- ``padded``: rl.packing=false, train.micro_batch_size rows per micro-batch (today's path);
- ``packed``: rl.packing=true, the same rows per micro-batch, each packed into one row;
- ``packed+budget``: rl.packing=true and rl.actor.max_tokens_per_micro_batch (the
  forward-only passes twice that), micro-batches by tokens.

Lengths: prompts and answers of a reversal task (the answer as long as the prompt), drawn
uniformly so that the mean answer is --means tokens (32 / 64 / 128 / 256 by default), from
a sixth of the mean to 11/6 of it. The settings take turns on the same batch, medians over
--repeats rounds after a warm-up round. Reported per mean length and setting: the padding share of
the computed tokens, update tokens/s (real tokens / update seconds), forward tokens/s, the
ratio to padded, and the activation bytes one micro-batch keeps for backward (measured with
``torch.autograd.graph.saved_tensors_hooks``: the peak over the update's micro-batches),
against the token budget's bound (budget x the bytes per token of the packed run).

    python benchmarks/rl_packing.py                 # ~3 minutes on 2 CPU cores
    python benchmarks/rl_packing.py --means 32 64   # fewer lengths

Writes rl_packing.{json,md,png} to --out (default results/rl_packing) and prints the table.
Speed is never asserted by a test; the numbers are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from harness import pyplot

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = ("model.config={model_type: qwen3, hidden_size: 128, intermediate_size: 256, num_hidden_layers: 3, "
         "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 32, vocab_size: 64, "
         "max_position_embeddings: 1024, tie_word_embeddings: false}")
BASE = [MODEL, "model.dtype=fp32", "fsdp.mixed_precision.param_dtype=fp32", "fsdp.mixed_precision.reduce_dtype=fp32",
        "train.optimizer.lr=1e-5", "train.scheduler.name=constant", "train.scheduler.warmup_steps=0",
        "rl.actor.ppo_epochs=1", "rl.actor.ppo_mini_batches=1", "rl.actor.entropy_coef=0.001",
        "rl.actor.kl_loss.enabled=true", "rl.rollout.temperature=1.0"]


def rollout_batch(rows: int, mean: int, seed: int):
    """Rows of a reversal task: answer length uniform in [mean/6, 11 mean/6] (for a mean of
    54: 9-99, a reversal of 8-100 characters), the prompt as long as the answer plus 2
    (bos, '='), old / reference log-probs and advantages drawn."""
    from shardwise.data.batch import Batch
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(seed)
    low = max(mean // 6, 1)
    resp = torch.randint(low, 2 * mean - low + 1, (rows,), generator=g)
    prompt = resp + 2
    width_p, width_r = int(prompt.max()), int(resp.max())
    ids = torch.randint(3, 60, (rows, width_p + width_r), generator=g)
    attn = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        p, n = int(prompt[r]), int(resp[r])
        attn[r, width_p - p: width_p + n] = 1
        mask[r, width_p: width_p + n] = 1
    ids[attn == 0] = 0
    adv = torch.randn(ids.shape, generator=g) * mask
    noise = 0.05 * torch.randn(ids.shape, generator=g) * mask
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": mask, "advantages": adv}), noise


class SavedBytes:
    """Bytes autograd keeps for backward, peak per forward (one micro-batch's activations)."""

    def __init__(self):
        self.current = self.peak = 0

    def pack(self, t):
        self.current += t.numel() * t.element_size()
        self.peak = max(self.peak, self.current)
        return t

    def unpack(self, t):
        return t


class Setting:
    """One setting's ActorWorker, timed pass by pass (the settings take turns, so a load
    that comes and goes on the machine hits them alike)."""

    def __init__(self, name: str, overrides: list[str]):
        from shardwise.config import load_config
        from shardwise.distributed.runtime import init_distributed
        from shardwise.rl.workers.actor import ActorWorker

        runtime = init_distributed(timeout_s=600)
        self.name = name
        self.actor = ActorWorker(load_config(None, [*BASE, *overrides]), runtime)
        self.fwd: list[float] = []
        self.upd: list[float] = []
        self.peaks: list[int] = []

    def run(self, batch, noise, keep: bool) -> None:
        from shardwise.data.batch import Batch

        actor = self.actor
        mask = batch.tensors["response_mask"].bool()
        t0 = time.perf_counter()
        old = actor.compute_log_prob(batch).tensors["old_log_probs"]
        t1 = time.perf_counter()
        data = batch.union(Batch.from_dict({"old_log_probs": old, "ref_log_probs": (old - noise).masked_fill(~mask, 0)}))
        saved = SavedBytes()
        engine_accumulate = actor.engine.accumulate

        def accumulate(micro, loss_fn, *a, **k):
            def measured(model, mb):
                saved.current = 0
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    return loss_fn(model, mb)
            return engine_accumulate(micro, measured, *a, **k)

        actor.engine.accumulate = accumulate
        t2 = time.perf_counter()
        try:
            actor.update_actor(data)
        finally:
            actor.engine.accumulate = engine_accumulate
        t3 = time.perf_counter()
        if keep:
            self.fwd.append(t1 - t0)
            self.upd.append(t3 - t2)
            self.peaks.append(saved.peak)

    def result(self, batch) -> dict:
        real = int(batch.tensors["attention_mask"].sum())
        fwd, upd = statistics.median(self.fwd), statistics.median(self.upd)
        return {"setting": self.name, "forward_s": fwd, "update_s": upd, "forward_tokens_per_s": real / fwd,
                "update_tokens_per_s": real / upd, "update_s_all": self.upd, "saved_bytes_peak": max(self.peaks),
                "real_tokens": real}


def main() -> None:
    from shardwise.engine import packing

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--means", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--rows", type=int, default=32, help="rollout rows (prompts x samples)")
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch of the fixed settings")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "rl_packing")
    ap.add_argument("--smoke", action="store_true",
                    help="a check that the benchmark runs (make test): --means 12 --rows 4 --micro 2 --repeats 1; "
                         "its numbers mean nothing")
    args = ap.parse_args()
    if args.smoke:
        args.means, args.rows, args.micro, args.repeats = [12], 4, 2, 1
    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    rows_out = []
    for mean in args.means:
        batch, noise = rollout_batch(args.rows, mean, seed=mean)
        lengths = batch.tensors["attention_mask"].sum(-1).tolist()
        width = batch.tensors["input_ids"].shape[1]
        # the budget: as many tokens as the fixed micro-batch holds on average, at least the longest row
        budget = max(int(statistics.mean(lengths) * args.micro), max(lengths))
        settings = {
            "padded": (["rl.packing=false", f"train.micro_batch_size={args.micro}"],
                       packing.padding_share([lengths[i:i + args.micro] for i in range(0, len(lengths), args.micro)],
                                             [width] * len(lengths))),
            "packed": (["rl.packing=true", f"train.micro_batch_size={args.micro}"], 0.0),
            "packed+budget": (["rl.packing=true", f"rl.actor.max_tokens_per_micro_batch={budget}",
                               f"rl.log_prob_max_tokens_per_micro_batch={2 * budget}"], 0.0),
        }
        runs = {name: Setting(name, overrides) for name, (overrides, _) in settings.items()}
        for i in range(args.repeats + 1):  # the first round warms up
            for run in runs.values():
                run.run(batch, noise, keep=i > 0)
        results = {}
        for name, run in runs.items():
            r = run.result(batch)
            pad_share = settings[name][1]
            r.update(mean_answer=mean, padding_share=pad_share, budget=budget if "budget" in name else None,
                     longest_row=max(lengths), width=width)
            results[name] = r
            print(f"mean {mean:4d} {name:14s} update {r['update_tokens_per_s']:9.0f} tok/s  forward "
                  f"{r['forward_tokens_per_s']:9.0f} tok/s  padding {pad_share:.0%}  saved {r['saved_bytes_peak'] / 2**20:.1f} MiB",
                  flush=True)
        for r in results.values():
            r["update_speedup"] = r["update_tokens_per_s"] / results["padded"]["update_tokens_per_s"]
            r["forward_speedup"] = r["forward_tokens_per_s"] / results["padded"]["forward_tokens_per_s"]
        per_token = results["packed"]["saved_bytes_peak"] / (results["packed"]["real_tokens"] / -(-args.rows // args.micro))
        results["packed+budget"]["budget_bound_bytes"] = per_token * budget
        rows_out += results.values()
    write(args.out, rows_out, vars(args))


def write(out: Path, rows: list[dict], args: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "args": {k: str(v) for k, v in args.items()}}
    (out / "rl_packing.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| mean answer | setting | padding share | update tok/s | x padded | forward tok/s | x padded | "
             "update s | saved MiB / micro-batch (bound) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = f" ({r['budget_bound_bytes'] / 2**20:.1f})" if "budget_bound_bytes" in r else ""
        lines.append(f"| {r['mean_answer']} | {r['setting']} | {r['padding_share']:.0%} | {r['update_tokens_per_s']:.0f} "
                     f"| {r['update_speedup']:.2f} | {r['forward_tokens_per_s']:.0f} | {r['forward_speedup']:.2f} "
                     f"| {r['update_s']:.2f} | {r['saved_bytes_peak'] / 2**20:.1f}{bound} |")
    table = "\n".join(lines)
    (out / "rl_packing.md").write_text(f"# rl.packing and token budgets ({meta['machine']}, torch {meta['torch']})\n\n"
                                       f"{table}\n")
    print(table)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for setting in ("padded", "packed", "packed+budget"):
        rs = [r for r in rows if r["setting"] == setting]
        ax[0].plot([r["mean_answer"] for r in rs], [r["update_s"] for r in rs], marker="o", label=setting)
        ax[1].plot([r["mean_answer"] for r in rs], [r["update_tokens_per_s"] for r in rs], marker="o", label=setting)
    ax[0].set(xlabel="mean answer tokens", ylabel="update seconds", title="update time vs answer length")
    ax[1].set(xlabel="mean answer tokens", ylabel="update tokens/s", title="update throughput")
    for a in ax:
        a.legend()
    fig.tight_layout()
    fig.savefig(out / "rl_packing.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
