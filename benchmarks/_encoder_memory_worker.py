"""One rank of one `encoder_memory.py` row: train a BERT masked LM a few steps, measure the
bytes this rank holds, write a JSON file (rank 0, every rank's numbers).

Started by `benchmarks/encoder_memory.py` under `python -m torch.distributed.run`, one fresh
set of processes per row:

    python -m torch.distributed.run --nproc-per-node 2 ... benchmarks/_encoder_memory_worker.py \
        --name full_shard --out results/encoder_memory/raw/full_shard.json --model '{...}' \
        --steps 2 --seq-len 128 --global-batch 8 --override parallel.sharding_strategy=full_shard

`--name ddp` is the hand-written baseline of seed 002's comparison (not shardwise code):
`torch.nn.parallel.DistributedDataParallel` over gloo around the HF model, built from the
same config with the same seeded init, `torch.optim.AdamW`, the same loss and clip. Every
other name is shardwise's `TrainEngine` with the given overrides. Both train on the same
masked global batches (`shardwise.data.encoder.mask_tokens`), each rank on its share.

Measured per rank: after the forward of the first micro-batch (before its backward), the
bytes of full (not sharded) parameter storage the rank holds; in an optimizer post-step
hook of the last step, the bytes of parameters, gradients and AdamW state
(`_train_worker.held_state_bytes`: local shards of DTensors, each storage once at its full
size); the peak RSS of the process. A rank that fails writes ``<out>.rank<R>.error``.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _train_worker import held_state_bytes, run_and_record
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForMaskedLM

from shardwise.config import load_config
from shardwise.data.collate import IGNORE_INDEX
from shardwise.data.encoder import mask_tokens, masked_lm_loss_sum
from shardwise.distributed.launch import leave
from shardwise.distributed.runtime import (
    init_distributed,
    seed_everything,
    teardown,
)
from shardwise.engine.train import TrainEngine

SPECIAL = (0, 1, 2, 3)
"""pad, [CLS], [SEP], [MASK] ids of the synthetic rows."""
MASK_ID = 3
SEED = 0
LR = 1e-3


def global_batch(step: int, rows: int, seq_len: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """`rows` rows ``[CLS] tokens [SEP]`` of `seq_len` tokens drawn with Zipf weights (so the
    loss falls), masked BERT-style (15%, 80/10/10) by `mask_tokens` from (step, row)."""
    g = torch.Generator().manual_seed(1234 + step)
    zipf = 1.0 / torch.arange(1, vocab - len(SPECIAL) + 1, dtype=torch.float64)
    ordinary = torch.arange(len(SPECIAL), vocab)
    out = []
    for i in range(rows):
        ids = (torch.multinomial(zipf, seq_len, replacement=True, generator=g) + len(SPECIAL)).tolist()
        ids[0], ids[-1] = 1, 2
        inputs, labels = mask_tokens(ids, set(SPECIAL), MASK_ID, ordinary, step, i)
        out.append({"input_ids": torch.tensor(inputs), "labels": torch.tensor(labels)})
    return out


def my_micro_batches(rows: list[dict], rank: int, world: int, micro: int) -> list[dict[str, torch.Tensor]]:
    share = len(rows) // world
    mine = rows[rank * share:(rank + 1) * share]
    batches = []
    for i in range(0, len(mine), micro):
        b = {k: torch.stack([r[k] for r in mine[i:i + micro]]) for k in mine[0]}
        b["attention_mask"] = torch.ones_like(b["input_ids"])
        batches.append(b)
    return batches


def full_param_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage held whole (not as a DTensor shard), each storage once:
    under FSDP2 the gathered parameters of the units that have not resharded."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        if not isinstance(p, DTensor):
            s = p.untyped_storage()
            seen.setdefault(s.data_ptr(), s.nbytes())
    return sum(seen.values())


def ddp_baseline(model_fields: dict[str, Any], device: torch.device) -> tuple[nn.Module, nn.Module,
                                                                              torch.optim.Optimizer]:
    """The seed's DDP: the HF BERT masked LM from `model_fields` (seeded init, fp32, sdpa),
    `DistributedDataParallel` with gradients as views of its buckets (no second copy of the
    gradients: DDP's leanest setting), AdamW (foreach)."""
    fields = dict(model_fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = AutoModelForMaskedLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
    return ddp, model, opt


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    model_fields = json.loads(args.model)
    runtime = init_distributed(timeout_s=300)
    seed_everything(SEED)
    rank, world = runtime.rank, runtime.world_size
    micro = args.global_batch // world
    after_forward: list[int] = []

    def measured_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = masked_lm_loss_sum(model, batch)
        if not after_forward:
            after_forward.append(full_param_bytes(model))
        return loss

    state: dict[str, int] = {}
    losses: list[float] = []
    plan_estimate = None
    if args.name == "ddp":
        ddp, inner, opt = ddp_baseline(model_fields, runtime.device)
        for step in range(args.steps):
            rows = global_batch(step, args.global_batch, args.seq_len, model_fields["vocab_size"])
            total = sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in rows)
            local = torch.zeros((), dtype=torch.float64)
            for mb in my_micro_batches(rows, rank, world, micro):
                loss = measured_loss(ddp, mb)
                (loss * world / total).backward()  # DDP averages over ranks: the global mean
                local += loss.detach().double()
            nn.utils.clip_grad_norm_(inner.parameters(), 1.0)
            hook = None
            if step == args.steps - 1:
                hook = opt.register_step_post_hook(lambda o, *_: state.update(held_state_bytes(inner, o)))
            opt.step()
            if hook is not None:
                hook.remove()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(local)
            losses.append(float(local) / total)
        del ddp, inner, opt  # DDP's reducer holds the process group: gone before teardown (a rank hung there)
    else:
        overrides = [f"model.config={json.dumps(model_fields)}", "model.task=masked_lm",
                     "fsdp.mixed_precision.param_dtype=fp32", f"train.micro_batch_size={micro}",
                     f"train.global_batch_size={args.global_batch}", f"train.max_steps={args.steps}",
                     f"train.optimizer.lr={LR}", "train.scheduler.name=constant", "train.scheduler.warmup_steps=0",
                     f"run.seed={SEED}", *args.override]
        cfg = load_config(None, overrides)
        engine = TrainEngine(cfg, runtime, task="masked_lm")
        plan_estimate = engine.plan.memory_per_rank_bytes[rank]["total"]
        for step in range(args.steps):
            rows = global_batch(step, args.global_batch, args.seq_len, model_fields["vocab_size"])
            total = sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in rows)
            hook = None
            if step == args.steps - 1:
                hook = engine.optimizer.register_step_post_hook(
                    lambda o, *_: state.update(held_state_bytes(engine.model, o)))
            res = engine.train_step(my_micro_batches(rows, rank, world, micro), total, loss_fn=measured_loss)
            if hook is not None:
                hook.remove()
            losses.append(res.loss)

    mine = {"rank": rank, "state_bytes": state, "full_params_after_forward_bytes": after_forward[0],
            "plan_estimate_bytes": plan_estimate,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    gathered: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    teardown()
    if rank != 0:
        return None
    return {"name": args.name, "overrides": args.override, "world_size": world, "micro_batch": micro,
            "global_batch": args.global_batch, "seq_len": args.seq_len, "steps": args.steps,
            "losses": losses, "final_loss": losses[-1], "ranks": gathered}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="ddp (the baseline) or a shardwise row's name")
    p.add_argument("--out", required=True, type=Path, help="JSON file rank 0 writes")
    p.add_argument("--model", required=True, help="the BERT config fields, JSON")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8, help="rows per step over all ranks")
    p.add_argument("--override", action="append", default=[], help="a shardwise key=value override")
    return p.parse_args(argv)


def main() -> int:
    return run_and_record(run, parse_args())


if __name__ == "__main__":
    leave(main())
