"""One rank of one `gpu_throughput.py` row: train, time, write a JSON file.

Started by `benchmarks/gpu_throughput.py` under `python -m torch.distributed.run`, one fresh
set of processes per row:

    python -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 \
        --master-port 29500 benchmarks/_throughput_worker.py --name hand_written_compile \
        --loop hand --compile --model '{"model_type": "llama", ...}' --compute-dtype bf16 \
        --rows 4 --seq-len 2048 --warmup 5 --steps 20 --lr 3e-4 --out results/.../raw/x.json

Two loops train the same model (same seeded init, same optimizer settings) on the same
uniform random tokens, every position a loss token:

- `--loop hand`: the peer baseline, written here on purpose and not with shardwise code
  (`hand_written_loop`): `fully_shard` per decoder layer then the root, optionally each
  decoder layer `torch.compile`d first, fp32 cross-entropy on shifted logits, clip, AdamW.
- `--loop shardwise`: `shardwise.engine.train.TrainEngine` built from `load_config(None,
  overrides)`, stepped with `TrainEngine.train_step` and its default loss.

`--warmup` steps run first (compilation happens there), then `--steps` timed steps as one
block: synchronise, time, synchronise. On CUDA tokens/s is that of the block, back-to-back
steps (the hand-written loop never waits for the device inside it; shardwise does whatever
its step does); on CPU, where every op is synchronous, it is that of the median step (each
step as long as its slowest rank), which a busy shared machine disturbs less. Peak memory is that of the timed steps only: CUDA
`max_memory_allocated` after `reset_peak_memory_stats`, or on CPU the process's peak RSS
(`VmHWM`, reset through `/proc/self/clear_refs` after the warm-up). Rank 0 gathers every
rank's numbers and writes `--out`. A rank that fails writes `<out>.rank<R>.error` (the
exception's first line) and exits with status 1, so the caller can say why the row is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from shardwise.config import load_config
from shardwise.data.collate import count_loss_tokens
from shardwise.distributed.launch import leave
from shardwise.distributed.runtime import (
    Runtime,
    env_world,
    init_distributed,
    seed_everything,
    teardown,
)
from shardwise.engine.train import TrainEngine

DATA_SEED = 1234
MODEL_SEED = 0
"""shardwise's `run.seed` and the hand-written loop's init seed: the same initial weights."""

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
StepFn = Callable[[torch.Tensor], torch.Tensor | float]
"""One optimizer step on token ids (rows, seq) int64 on CPU; returns the step's loss."""


def token_rows(step: int, rows: int, seq_len: int, vocab: int) -> torch.Tensor:
    """The global batch of step `step`: (rows, seq_len) int64 token ids drawn uniformly from
    [0, vocab), the same on every rank and for every row of the benchmark."""
    g = torch.Generator().manual_seed(DATA_SEED + step)
    return torch.randint(0, vocab, (rows, seq_len), generator=g)


def hand_written_loop(model_cfg: dict[str, Any], compute_dtype: torch.dtype, compile_layers: bool,
                      lr: float, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, StepFn]:
    """The peer baseline: what a user writes with FSDP2 and transformers alone (GPU.md)."""
    fields = dict(model_cfg)
    hf_cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(MODEL_SEED)  # the same draws as shardwise's seeded init on rank 0
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation="sdpa").to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(list(layers)):
        if compile_layers:  # torchtitan's order: compile each block, then shard it
            layer = torch.compile(layer)
            layers.register_module(str(i), layer)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                  fused=fused, foreach=not fused)

    def step(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(device, non_blocking=True)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return model, optimizer, step


def shardwise_loop(overrides: list[str], runtime: Runtime) -> tuple[nn.Module, torch.optim.Optimizer, StepFn]:
    """`TrainEngine` from the overrides; one micro-batch per rank, labels = input ids."""
    engine = TrainEngine(load_config(None, overrides), runtime)

    def step(ids: torch.Tensor) -> float:
        """`ids`: the global batch (rows, seq); this rank trains its contiguous share."""
        share = ids.shape[0] // engine.dp_size
        mine = ids[engine.dp_rank * share:(engine.dp_rank + 1) * share]
        batch = {"input_ids": mine, "labels": mine, "attention_mask": torch.ones_like(mine)}
        tokens = count_loss_tokens({"labels": ids})
        return engine.train_step([batch], tokens).loss

    return engine.model, engine.optimizer, step


class LogitsMeter:
    """Calls of the model's output embedding as a module, and the most token positions one
    call turned into logits (an output whose last dimension is the vocabulary): with the
    full logits, every position of the micro-batch in one call; a chunked loss shows calls
    of fewer tokens, or no logits at all (shardwise's chunked head replaces the head's
    forward with one that returns per-token log-probs)."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        self.max_logit_tokens = 0
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.vocab = getattr(head, "out_features", None)
        self.handle = None if head is None else head.register_forward_hook(self._hook)

    def _hook(self, _mod: nn.Module, _args: Any, out: Any) -> None:
        self.calls += 1
        if torch.is_tensor(out) and out.dim() >= 2 and out.shape[-1] == self.vocab:
            self.max_logit_tokens = max(self.max_logit_tokens, out.shape[:-1].numel())

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()


def optimizer_kernel(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """fused / foreach / for-loop: which AdamW implementation runs (torch's default when
    neither flag is set: foreach on CUDA, a for-loop on CPU)."""
    d = optimizer.defaults
    if d.get("fused"):
        return "fused"
    if d.get("foreach") or (d.get("foreach") is None and device.type == "cuda"):
        return "foreach"
    return "for-loop"


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (0: nothing was compiled)."""
    return int(counters["stats"]["unique_graphs"])


def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (Linux >= 4.0); False where it cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rss_bytes(peak: bool) -> int:
    """Current (VmRSS) or peak (VmHWM) resident set size; `ru_maxrss` where /proc is absent."""
    kib = _status_kib("VmHWM" if peak else "VmRSS")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    model_cfg = json.loads(args.model)
    vocab = int(model_cfg["vocab_size"])
    runtime = init_distributed(timeout_s=args.pg_timeout)
    device, rank, world = runtime.device, runtime.rank, runtime.world_size
    if args.rows % world:
        raise ValueError(f"--rows {args.rows} is not a multiple of the {world} ranks")
    seed_everything(MODEL_SEED)
    start = time.perf_counter()
    if args.loop == "hand":
        model, optimizer, step = hand_written_loop(model_cfg, DTYPES[args.compute_dtype], args.compile, args.lr,
                                                   device)
    else:
        model, optimizer, step = shardwise_loop(args.override, runtime)
    build_s = time.perf_counter() - start
    batches = [token_rows(i, args.rows, args.seq_len, vocab) for i in range(args.warmup + args.steps)]
    if args.loop == "hand":  # this rank's contiguous share (shardwise's step takes its own)
        share = args.rows // world
        batches = [b[rank * share:(rank + 1) * share] for b in batches]

    losses: list[torch.Tensor | float] = []
    logits = LogitsMeter(model)
    start = time.perf_counter()
    for i in range(args.warmup):
        losses.append(step(batches[i]))
        if i == 0:
            logits.remove()
    _sync(device)
    dist.barrier()
    warmup_s = time.perf_counter() - start
    graphs_after_warmup = compiled_graphs()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_reset = reset_peak_rss()
    rss_start = rss_bytes(peak=False)
    start = time.perf_counter()
    ends = []
    for i in range(args.warmup, args.warmup + args.steps):
        losses.append(step(batches[i]))
        ends.append(time.perf_counter() - start)  # not synchronised: on CUDA, when the host got there
    _sync(device)
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss_bytes(peak=True))

    # The hand-written loop kept its per-rank losses on the device; average them over ranks.
    if args.loop == "hand":
        local = torch.stack([torch.as_tensor(x, dtype=torch.float32, device=device) for x in losses])
        dist.all_reduce(local)
        global_losses = (local / world).tolist()
    else:
        global_losses = [float(x) for x in losses]

    mine = {
        "rank": rank,
        "build_s": build_s,
        "warmup_s": warmup_s,
        "timed_s": elapsed,
        "step_ends_s": ends,
        "peak_bytes": peak,
        "rss_at_timed_start_bytes": rss_start,
        "peak_rss_reset": rss_reset,
        "cuda_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "compiled_graphs": compiled_graphs(),
        "compiled_graphs_after_warmup": graphs_after_warmup,
        "optimizer": optimizer_kernel(optimizer, device),
        "lm_head_calls_step0": logits.calls,
        "lm_head_max_logit_tokens_step0": logits.max_logit_tokens,
    }
    gathered: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    teardown()
    if rank != 0:
        return None
    ranks = [r for r in gathered if r is not None]
    timed_s = max(r["timed_s"] for r in ranks)  # the block ends when the slowest rank does
    tokens_per_step = args.rows * args.seq_len
    # Each step as long as its slowest rank. Exact on CPU, where every op is synchronous;
    # on CUDA only the host's progress (the hand-written loop never waits for the device).
    step_s = [max(r["step_ends_s"][i] - (r["step_ends_s"][i - 1] if i else 0.0) for r in ranks)
              for i in range(args.steps)]
    median_s = statistics.median(step_s)
    p25, _, p75 = statistics.quantiles(step_s, n=4, method="inclusive") if len(step_s) > 1 else (median_s,) * 3
    if device.type == "cuda":
        tokens_per_s, how = tokens_per_step * args.steps / timed_s, "timed block"
    else:
        tokens_per_s, how = tokens_per_step / median_s, "median step"
    return {
        "name": args.name,
        "loop": args.loop,
        "compile": args.compile if args.loop == "hand" else None,
        "overrides": args.override,
        "world_size": world,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": runtime.backend,
        "compute_dtype": args.compute_dtype,
        "rows": args.rows,
        "seq_len": args.seq_len,
        "tokens_per_step": tokens_per_step,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "timed_s": timed_s,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_from": how,
        "tokens_per_s_block": tokens_per_step * args.steps / timed_s,
        "tokens_per_s_p25_p75": [tokens_per_step / p75, tokens_per_step / p25],
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "peak_kind": "cuda_max_memory_allocated" if device.type == "cuda" else "peak_rss",
        "build_s": max(r["build_s"] for r in ranks),
        "warmup_s": max(r["warmup_s"] for r in ranks),
        "compiled_graphs": ranks[0]["compiled_graphs"],
        "recompiled_in_timed_steps": any(r["compiled_graphs"] != r["compiled_graphs_after_warmup"] for r in ranks),
        "optimizer": ranks[0]["optimizer"],
        "lm_head_calls_step0": ranks[0]["lm_head_calls_step0"],
        "lm_head_max_logit_tokens_step0": ranks[0]["lm_head_max_logit_tokens_step0"],
        "losses": global_losses,
        "final_loss": global_losses[-1],
        "ranks": ranks,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="row name (recorded, not interpreted)")
    p.add_argument("--loop", required=True, choices=("hand", "shardwise"))
    p.add_argument("--compile", action="store_true", help="hand: torch.compile each decoder layer")
    p.add_argument("--override", action="append", default=[], help="shardwise: a key=value override")
    p.add_argument("--model", required=True, help="the HF config as a JSON object, model_type included")
    p.add_argument("--compute-dtype", choices=tuple(DTYPES), required=True, help="hand: FSDP2 param_dtype")
    p.add_argument("--lr", type=float, required=True, help="hand: AdamW learning rate")
    p.add_argument("--rows", type=int, required=True, help="rows per step over all ranks")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    p.add_argument("--steps", type=int, required=True, help="timed steps")
    p.add_argument("--out", required=True, type=Path, help="JSON file rank 0 writes")
    p.add_argument("--pg-timeout", type=float, default=600.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    try:
        record = run(args)
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the caller, then exit 1
        traceback.print_exc()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        message = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
        Path(f"{args.out}.rank{env_world()[0]}.error").write_text(message + "\n")
        return 1
    if record is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    # Without the interpreter's shutdown: a finished rank was seen to abort there (SIGABRT,
    # "terminate called without an active exception") after its results were written.
    leave(main())
