"""One rank of one `train_configs.py` configuration: train, measure, write a JSON file.

Started by `benchmarks/train_configs.py` under `python -m torch.distributed.run`, one fresh
set of processes per configuration:

    python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
        --master-port 29500 benchmarks/_train_worker.py --name full_shard \
        --out results/bench/raw/full_shard.json --steps 6 --warmup 2 --seq-len 1024 \
        --micro 1 --override "fsdp.mixed_precision.param_dtype=fp32" ...

Each rank trains the same model (`shardwise.engine.train.TrainEngine`) on its share of the
same synthetic global batches. Step 0 (a warm-up step) counts the activations its first
micro-batch saves for backward; the last step counts the parameter, gradient and AdamW
bytes the rank holds just after `optimizer.step()`. Rank 0 gathers every rank's numbers
and writes `--out`. A rank that fails writes `<out>.rank<R>.error` (the exception's first
line) and exits with status 1, so the caller can say why the configuration is missing.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config import load_config
from shardwise.data.collate import IGNORE_INDEX, count_loss_tokens
from shardwise.distributed.launch import leave
from shardwise.distributed.runtime import (
    env_world,
    init_distributed,
    seed_everything,
    teardown,
)
from shardwise.engine.train import Batch, TrainEngine

DATA_SEED = 1234


def synthetic_rows(step: int, size: int, seq_len: int, vocab: int) -> list[Batch]:
    """`size` rows of token ids for global step `step`, the same on every rank.

    Tokens 1..vocab-1 are drawn with Zipf weights (1/id), so a model can learn something
    in a few steps (the unigram distribution) and the loss falls. Each row is a prompt of
    random length (labels -100) followed by a response whose tokens are the targets, so
    rows carry uneven numbers of loss tokens, as in SFT.
    """
    g = torch.Generator().manual_seed(DATA_SEED + step)
    zipf = 1.0 / torch.arange(1, vocab, dtype=torch.float64)
    rows = []
    for _ in range(size):
        ids = torch.multinomial(zipf, seq_len, replacement=True, generator=g) + 1
        prompt = int(torch.randint(1, seq_len - 2, (1,), generator=g))
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def collate(rows: list[Batch]) -> Batch:
    """Stack rows into one micro-batch (all rows are full length: the mask is all ones)."""
    batch = {key: torch.stack([r[key] for r in rows]) for key in rows[0]}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def rank_micro_batches(rows: list[Batch], rank: int, world: int, micro: int) -> list[Batch]:
    """This rank's contiguous share of the global batch, cut into micro-batches of `micro`."""
    share = len(rows) // world
    mine = rows[rank * share:(rank + 1) * share]
    return [collate(mine[i:i + micro]) for i in range(0, len(mine), micro)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class SavedActivationMeter:
    """Bytes autograd saves for backward while the meter is active.

    Every tensor packed by `torch.autograd.graph.saved_tensors_hooks` is counted once per
    storage (`untyped_storage().data_ptr()`), at the storage's full size: the memory the
    saved tensor keeps alive. `nn.Parameter` objects and tensors sharing a storage with a
    current parameter of the model (e.g. the transposed weight a linear saves; under FSDP2
    the unsharded parameters of the unit that is running) are not counted: they are
    parameter memory, not activations. The parameter storages are looked up at each pack,
    because FSDP2 swaps unsharded parameters in and out around every unit.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.storages: dict[int, int] = {}
        self.packed = 0
        self.skipped_params = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())

    def _param_storages(self) -> set[int]:
        return {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if isinstance(t, nn.Parameter) or ptr in self._param_storages():
            self.skipped_params += 1
        elif ptr not in self.storages:
            self.storages[ptr] = storage.nbytes()
        return t

    @contextmanager
    def active(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


def held_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state, by storage.

    DTensors count their local shard. Each storage is counted once, at its full size
    (FSDP2 keeps a padded shard; views into one buffer count that buffer once).
    """
    seen: set[int] = set()

    def nbytes(t: torch.Tensor) -> int:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = list(model.parameters())
    out = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(nbytes(v) for state in optimizer.state.values() for v in state.values()
                         if torch.is_tensor(v)),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train `args.warmup + args.steps` steps; rank 0 returns the gathered record."""
    cfg = load_config(None, args.override)
    vocab = int((cfg.model.config or {})["vocab_size"])
    runtime = init_distributed(timeout_s=args.pg_timeout)
    seed_everything(cfg.run.seed)
    engine = TrainEngine(cfg, runtime)
    rank, world = runtime.rank, runtime.world_size
    global_rows = args.micro * world

    meter = SavedActivationMeter(engine.model)
    calls = 0

    def measured_once(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`loss` with the meter on during its first call (one micro-batch's forward and loss)."""
        def wrapped(model: nn.Module, batch: Batch, **kwargs) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls > 1:
                return loss(model, batch, **kwargs)
            with meter.active():
                return loss(model, batch, **kwargs)
        return wrapped

    measured_loss = measured_once(engine.lm_loss)  # the loss the config selects (chunked or not)
    if engine.sp_group is not None:
        # Ulysses: the engine computes the loss of each rank's sequence slice itself
        # (`ulysses.loss_sum`, looked up per call); measure its first call instead.
        from shardwise.distributed import ulysses

        ulysses.loss_sum = measured_once(ulysses.loss_sum)

    state: dict[str, int] = {}
    total_steps = args.warmup + args.steps
    losses: list[float] = []
    step_s: list[float] = []
    for step in range(total_steps):
        rows = synthetic_rows(step, global_rows, args.seq_len, vocab)
        # sequence-parallel peers share rows: split by data-parallel rank
        micro_batches = rank_micro_batches(rows, engine.dp_rank, engine.dp_size, args.micro)
        tokens = count_loss_tokens(collate(rows))
        hook = None
        if step == total_steps - 1:
            hook = engine.optimizer.register_step_post_hook(
                lambda opt, *_: state.update(held_state_bytes(engine.model, opt)))
        _sync(runtime.device)
        start = time.perf_counter()
        result = engine.train_step(micro_batches, tokens,
                                   loss_fn=measured_loss if step == 0 and engine.sp_group is None else None)
        _sync(runtime.device)
        elapsed = time.perf_counter() - start
        if hook is not None:
            hook.remove()
        losses.append(result.loss)
        if step >= args.warmup:
            step_s.append(elapsed)

    mine = {
        "rank": rank,
        "step_s": step_s,
        "activation_bytes": meter.total_bytes,
        "activation_storages": len(meter.storages),
        "saved_tensors_packed": meter.packed,
        "saved_param_tensors_skipped": meter.skipped_params,
        "state_bytes": state,
        "plan_estimate_bytes": engine.plan.memory_per_rank_bytes[rank],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    gathered: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    teardown()
    if rank != 0:
        return None
    ranks = [r for r in gathered if r is not None]
    # A step is as slow as its slowest rank.
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
    median_s = statistics.median(per_step)
    tokens_per_step = global_rows * args.seq_len
    return {
        "name": args.name,
        "overrides": args.override,
        "world_size": world,
        "device": str(runtime.device),
        "backend": runtime.backend,
        "seq_len": args.seq_len,
        "micro_batch": args.micro,
        "global_batch": global_rows,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "step_s": per_step,
        "median_step_s": median_s,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / median_s,
        "activation_bytes": max(r["activation_bytes"] for r in ranks),
        "state_bytes": max(r["state_bytes"]["total"] for r in ranks),
        "plan_estimate_bytes": max(r["plan_estimate_bytes"]["total"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "losses": losses,
        "final_loss": losses[-1],
        "ranks": ranks,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="configuration name (recorded, not interpreted)")
    p.add_argument("--out", required=True, type=Path, help="JSON file rank 0 writes")
    p.add_argument("--steps", type=int, required=True, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro", type=int, required=True, help="rows per rank per step (one micro-batch)")
    p.add_argument("--override", action="append", default=[], help="a shardwise key=value override")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1 (step 0 measures activations)")
    return args


def run_and_record(run_fn: Callable[[argparse.Namespace], dict[str, Any] | None], args: argparse.Namespace) -> int:
    """A worker's body: `run_fn(args)`; its record (rank 0's) written to ``args.out``, or the
    first line of its exception to ``<out>.rank<r>.error`` for the launcher. Exit status."""
    try:
        record = run_fn(args)
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the caller, then exit 1
        rank = env_world()[0]
        traceback.print_exc()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        message = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
        Path(f"{args.out}.rank{rank}.error").write_text(message + "\n")
        return 1
    if record is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def main() -> int:
    return run_and_record(run, parse_args())


if __name__ == "__main__":
    # Without the interpreter's shutdown: a finished rank was seen to abort there (SIGABRT,
    # "terminate called without an active exception") after its results were written.
    leave(main())
