"""Shared pieces of the distributed tests: tiny model configs, deterministic batches, the
unsharded reference run, and the body each rank runs."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

TINY_QWEN3 = ("model.config={model_type: qwen3, hidden_size: 32, intermediate_size: 64, "
              "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, "
              "vocab_size: 64, max_position_embeddings: 64, tie_word_embeddings: false}")
TINY_LLAMA = ("model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, "
              "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
              "vocab_size: 64, max_position_embeddings: 64, tie_word_embeddings: true}")

TINY_QWEN3_MOE = ("model.config={model_type: qwen3_moe, hidden_size: 32, intermediate_size: 64, "
                  "moe_intermediate_size: 16, num_experts: 8, num_experts_per_tok: 2, num_hidden_layers: 2, "
                  "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, vocab_size: 64, "
                  "max_position_embeddings: 64, tie_word_embeddings: false}")

FP32 = ["fsdp.mixed_precision.param_dtype=fp32"]


def make_global_batch(step: int, size: int, seq: int = 12, vocab: int = 64, seed: int = 1234) -> list[dict]:
    """`size` examples with uneven numbers of loss tokens (prompt lengths differ), as rows."""
    g = torch.Generator().manual_seed(seed + step)
    rows = []
    for _ in range(size):
        ids = torch.randint(1, vocab, (seq,), generator=g)
        prompt = int(torch.randint(1, seq - 2, (1,), generator=g))
        labels = ids.clone()
        labels[:prompt] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def stack(rows: list[dict]) -> dict[str, torch.Tensor]:
    out = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


def loss_tokens(rows: list[dict]) -> int:
    return int(sum((r["labels"][1:] != -100).sum() for r in rows))


def micro_batches_of(rows: list[dict], rank: int, world: int, micro: int) -> list[dict]:
    share = len(rows) // world
    mine = rows[rank * share:(rank + 1) * share]
    return [stack(mine[i:i + micro]) for i in range(0, len(mine), micro)]


def reference_run(overrides: list[str], steps: int, global_batch: int, micro: int) -> dict:
    """The unsharded reference: one process, a plain nn.Module, same init, data and optimizer."""
    from shardwise.config import load_config
    from shardwise.engine.optim import build_optimizer, build_scheduler
    from shardwise.engine.train import lm_loss_sum
    from shardwise.models.loading import build_full_model, freeze

    cfg = load_config(None, overrides)
    model = build_full_model(cfg.model, cfg.run.seed)
    freeze(model, cfg.model.freeze)
    opt = build_optimizer(model, cfg.train.optimizer)
    sched = build_scheduler(opt, cfg.train.scheduler, cfg.train.max_steps)
    losses = []
    for step in range(steps):
        rows = make_global_batch(step, global_batch)
        total = loss_tokens(rows)
        acc = 0.0
        for mb in micro_batches_of(rows, 0, 1, micro):
            loss_sum = lm_loss_sum(model, mb)
            (loss_sum / total).backward()
            acc += float(loss_sum.detach())
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                       cfg.train.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(acc / total)
    return {"losses": losses, "params": {k: v.detach().float().clone() for k, v in model.state_dict().items()}}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict, on every rank, as fp32 CPU tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def eval_loss(engine, micro_batches: list[dict[str, torch.Tensor]], global_loss_tokens: int) -> float:
    """Mean token loss of a global batch under `engine`'s model (eval mode, no grad):
    this rank's `lm_loss_sum` over its micro-batches, summed over ranks (collective)."""
    from shardwise.engine.train import lm_loss_sum

    engine.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=engine.runtime.device)
    with torch.no_grad():
        for mb in micro_batches:
            mb = {k: v.to(engine.runtime.device) for k, v in mb.items()}
            total += lm_loss_sum(engine.model, mb).double()
    dist.all_reduce(total)
    return float(total) / global_loss_tokens


def sharded_run(rank: int, world: int, overrides: list[str], steps: int, global_batch: int, micro: int) -> dict:
    """Body of each rank: the TrainEngine over this rank's share of the same global batches."""
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    engine = TrainEngine(cfg, runtime)
    losses = []
    for step in range(steps):
        rows = make_global_batch(step, global_batch)
        # sequence-parallel peers share rows: the data split is by data-parallel rank
        res = engine.train_step(micro_batches_of(rows, engine.dp_rank, engine.dp_size, micro), loss_tokens(rows))
        losses.append(res.loss)
    params = full_params(engine.model)
    teardown()
    return {"losses": losses, "params": params if rank == 0 else None}


def assert_trained_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                                init: dict[str, torch.Tensor], lr: float, steps: int, atol: float = 2e-6) -> None:
    """Parameters of a sharded fp32 run after `steps` AdamW steps against the unsharded
    reference's, both started from `init`.

    Why not one absolute tolerance on every element: the two runs add the same numbers in
    other orders (reduce-scatter, micro-batch accumulation, other vector kernels), so each
    gradient element differs by a relative rounding error that is ulps for most elements
    but large for an element whose gradient is a cancellation of bigger terms (|g| near
    Adam's eps). AdamW divides by sqrt(v), so a relative error of the gradient becomes a
    relative error of the step: ulps of lr for most elements, up to lr for those few. So:

    - at least 99.9% of all elements within `atol` (observed: at most 1 of 22,688 above
      2e-6, under the AVX512, AVX2 and default kernels);
    - every element within lr x steps, the most a few misrounded steps can move it;
    - the difference's norm below 1e-3 of the norm of the reference's update (observed
      <= 8e-6), so a systematic error (a unit's gradient scaled, a step skipped) fails.
    """
    assert got.keys() == want.keys() == init.keys()
    diff = torch.cat([(got[k].float() - want[k].float()).flatten() for k in want])
    update = torch.cat([(want[k].float() - init[k].float()).flatten() for k in want])
    over = int((diff.abs() > atol).sum())
    worst = max(want, key=lambda k: float((got[k].float() - want[k].float()).abs().max()))
    report = (f"{over} of {diff.numel()} elements differ by more than {atol}; max {float(diff.abs().max()):.3g} "
              f"(in {worst}); |diff| / |update| = {float(diff.norm() / update.norm().clamp_min(1e-30)):.3g}")
    assert over <= diff.numel() // 1000, report
    assert float(diff.abs().max()) <= lr * steps, report
    assert float(diff.norm()) <= 1e-3 * float(update.norm()), report


REQUIRED_ENV = "SHARDWISE_REQUIRED_MODULES"
"""Comma-separated optional modules that must be there: `make test` sets it to the ones it
installs, so their tests fail instead of skipping when an install breaks."""


def import_optional(name: str, install: str):
    """Import the optional module `name` for a test module, or skip that module (saying
    `install`). When `name` is in ``SHARDWISE_REQUIRED_MODULES`` a missing or broken
    install is a failure, not a skip."""
    required = name in os.environ.get(REQUIRED_ENV, "").split(",")
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or a broken install (a CUDA wheel without its libraries)
        message = f"{name} is not importable ({exc!r}); {install}"
        if required:
            pytest.fail(f"{message} ({REQUIRED_ENV} requires it)", pytrace=False)
        pytest.skip(message, allow_module_level=True)
