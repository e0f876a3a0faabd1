"""Shared pieces of the distributed tests: tiny model configs, deterministic batches, the
unsharded reference run, and the body each rank runs."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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

TINY_QWEN25_VL = ("model.config={model_type: qwen2_5_vl, vision_start_token_id: 60, image_token_id: 61, "
                  "video_token_id: 62, vision_end_token_id: 63, bos_token_id: 1, eos_token_id: 2, "
                  "text_config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
                  "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 64, max_position_embeddings: 64, "
                  "rope_scaling: {type: mrope, mrope_section: [1, 1, 2]}, tie_word_embeddings: false, "
                  "bos_token_id: 1, eos_token_id: 2}, "
                  "vision_config: {depth: 2, hidden_size: 32, intermediate_size: 64, num_heads: 2, "
                  "out_hidden_size: 32, patch_size: 14, spatial_merge_size: 2, temporal_patch_size: 2, "
                  "window_size: 56, fullatt_block_indexes: [1]}}")
"""A tiny Qwen2.5-VL (examples/sft_colours.yaml's shape, smaller): its vision tokens sit past
the built-in tokenizer's 57 characters."""

TINY_QWEN3_MOE = ("model.config={model_type: qwen3_moe, hidden_size: 32, intermediate_size: 64, "
                  "moe_intermediate_size: 16, num_experts: 8, num_experts_per_tok: 2, num_hidden_layers: 2, "
                  "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, vocab_size: 64, "
                  "max_position_embeddings: 64, tie_word_embeddings: false}")

TINY_BERT = ("model.config={model_type: bert, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
             "num_attention_heads: 4, vocab_size: 64, max_position_embeddings: 64, num_labels: 3, "
             "hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}")
"""A tiny BERT without dropout (a parity run needs the same forward on every rank); with
model.task=masked_lm (tied decoder) or sequence_classification (3 classes)."""

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


def make_vl_batch(step: int, size: int, hf_config, seq: int = 14, image_size: int = 56, seed: int = 2468) -> list[dict]:
    """`make_global_batch` for a VL model: each row ``bos <vision_start> <image> x n
    <vision_end> text`` with random patches ``(N, D)`` for its image (grid 1 x s x s), and
    random text tokens that are no vision token (ids 4 .. 56)."""
    v = hf_config.vision_config
    side = image_size // v.patch_size
    n = side * side // v.spatial_merge_size ** 2
    dim = 3 * v.temporal_patch_size * v.patch_size ** 2
    g = torch.Generator().manual_seed(seed + step)
    head = [1, hf_config.vision_start_token_id] + [hf_config.image_token_id] * n + [hf_config.vision_end_token_id]
    rows = []
    for _ in range(size):
        ids = torch.cat([torch.tensor(head), torch.randint(4, 57, (seq - len(head),), generator=g)])
        prompt = int(torch.randint(len(head), seq - 2, (1,), generator=g))
        labels = ids.clone()
        labels[:prompt] = -100
        rows.append({"input_ids": ids, "labels": labels,
                     "pixel_values": torch.randn((side * side, dim), generator=g),
                     "image_grid_thw": torch.tensor([1, side, side])})
    return rows


def stack(rows: list[dict]) -> dict[str, torch.Tensor]:
    out = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    out.setdefault("attention_mask", torch.ones_like(out["input_ids"]))
    return out


def loss_tokens(rows: list[dict]) -> int:
    return int(sum((r["labels"][1:] != -100).sum() for r in rows))


ENCODER_SPECIAL = (0, 1, 2, 3)
"""Token ids the encoder batches treat as pad, [CLS], [SEP] and [MASK]."""


def _encoder_rows(step: int, size: int, seq: int = 12, vocab: int = 64, seed: int = 4321) -> list[dict]:
    """`size` rows ``[CLS] tokens [SEP]`` of random lengths, padded with 0 to `seq`."""
    g = torch.Generator().manual_seed(seed + step)
    rows = []
    for _ in range(size):
        n = int(torch.randint(4, seq + 1, (1,), generator=g))
        ids = torch.zeros(seq, dtype=torch.long)
        ids[:n] = torch.randint(len(ENCODER_SPECIAL), vocab, (n,), generator=g)
        ids[0], ids[n - 1] = 1, 2
        mask = (torch.arange(seq) < n).long()
        rows.append({"input_ids": ids, "attention_mask": mask})
    return rows


def make_mlm_batch(step: int, size: int, vocab: int = 64) -> list[dict]:
    """Encoder rows masked by `shardwise.data.encoder.mask_tokens` (seed = step, index = row)."""
    from shardwise.data.encoder import mask_tokens

    rows = _encoder_rows(step, size, vocab=vocab)
    ordinary = torch.arange(len(ENCODER_SPECIAL), vocab)
    for i, r in enumerate(rows):
        inputs, labels = mask_tokens(r["input_ids"].tolist(), set(ENCODER_SPECIAL), 3, ordinary, step, i)
        r["input_ids"], r["labels"] = torch.tensor(inputs), torch.tensor(labels)
    return rows


def make_cls_batch(step: int, size: int, num_labels: int, vocab: int = 64) -> list[dict]:
    """Encoder rows with a class label each: ``labels`` 0-d int64."""
    g = torch.Generator().manual_seed(8765 + step)
    rows = _encoder_rows(step, size, vocab=vocab)
    for r in rows:
        r["labels"] = torch.randint(num_labels, (), generator=g)
    return rows


@dataclass(frozen=True)
class BatchKind:
    """The synthetic global batches of one model.task, their loss and its denominator."""

    rows: Callable[[int, int, dict], list[dict]]
    """(step, size, the inline model config) -> rows"""
    loss_fn: Callable | None
    """`TrainEngine.train_step`'s loss_fn (None: the engine's causal-LM loss)."""
    count: Callable[[list[dict]], int]
    """Global loss tokens of a global batch."""


def batch_kind(task: str) -> BatchKind:
    """causal_lm: `make_global_batch`, next-token loss; masked_lm: `make_mlm_batch`, masked
    positions; sequence_classification: `make_cls_batch`, one loss per row."""
    from shardwise.data import encoder

    if task == "masked_lm":
        return BatchKind(lambda step, size, mc: make_mlm_batch(step, size, mc["vocab_size"]),
                         encoder.masked_lm_loss_sum, lambda rows: int(sum((r["labels"] != -100).sum() for r in rows)))
    if task == "sequence_classification":
        return BatchKind(lambda step, size, mc: make_cls_batch(step, size, mc.get("num_labels", 2), mc["vocab_size"]),
                         encoder.classification_loss_sum, len)
    return BatchKind(_causal_rows, None, loss_tokens)


def _causal_rows(step: int, size: int, mc: dict) -> list[dict]:
    """`make_global_batch`, or `make_vl_batch` for an inline vision-language config."""
    if mc.get("model_type") in ("qwen2_5_vl", "qwen3_vl"):
        from transformers import AutoConfig

        fields = {k: v for k, v in mc.items() if k != "model_type"}
        return make_vl_batch(step, size, AutoConfig.for_model(mc["model_type"], **fields))
    return make_global_batch(step, size)


def micro_batches_of(rows: list[dict], rank: int, world: int, micro: int) -> list[dict]:
    share = len(rows) // world
    mine = rows[rank * share:(rank + 1) * share]
    return [stack(mine[i:i + micro]) for i in range(0, len(mine), micro)]


def reference_run(overrides: list[str], steps: int, global_batch: int, micro: int) -> dict:
    """The unsharded reference: one process, a plain nn.Module, same init, data and optimizer.
    The batches and the loss follow model.task (`batch_kind`)."""
    from shardwise.config import load_config
    from shardwise.engine.optim import build_optimizer, build_scheduler
    from shardwise.engine.train import lm_loss_sum
    from shardwise.models.loading import build_full_model, freeze

    cfg = load_config(None, overrides)
    kind = batch_kind(cfg.model.task)
    loss_fn = kind.loss_fn or lm_loss_sum
    model = build_full_model(cfg.model, cfg.run.seed, cfg.model.task)
    freeze(model, cfg.model.freeze)
    opt = build_optimizer(model, cfg.train.optimizer)
    sched = build_scheduler(opt, cfg.train.scheduler, cfg.train.max_steps)
    losses = []
    for step in range(steps):
        rows = kind.rows(step, global_batch, cfg.model.config or {})
        total = kind.count(rows)
        acc = 0.0
        for mb in micro_batches_of(rows, 0, 1, micro):
            loss_sum = loss_fn(model, mb)
            (loss_sum / total).backward()
            acc += float(loss_sum.detach())
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                       cfg.train.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(acc / total)
    return {"losses": losses, "params": {k: v.detach().float().clone() for k, v in model.state_dict().items()}}


def worker_rows(g: torch.Generator, rows: int, prompt: int, resp: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """RL worker-layout rows drawn from `g`: ``input_ids``, ``attention_mask`` and
    ``response_mask`` ``(rows, prompt + resp)``; row r's prompt is left-padded by r % 3,
    its response has 2 + r % (resp - 1) tokens, right-padded; padding holds token 0."""
    width = prompt + resp
    ids = torch.randint(3, 64, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        n = 2 + r % (resp - 1)
        attn[r, :r % 3] = 0
        attn[r, prompt + n:] = 0
        mask[r, prompt:prompt + n] = 1
    ids[attn == 0] = 0
    return ids, attn, mask


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
    """Body of each rank: the TrainEngine over this rank's share of the same global batches
    (and the loss of model.task, `batch_kind`)."""
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    kind = batch_kind(cfg.model.task)
    engine = TrainEngine(cfg, runtime, task=cfg.model.task)
    losses = []
    for step in range(steps):
        rows = kind.rows(step, global_batch, cfg.model.config or {})
        # sequence-parallel peers share rows: the data split is by data-parallel rank
        res = engine.train_step(micro_batches_of(rows, engine.dp_rank, engine.dp_size, micro), kind.count(rows),
                                loss_fn=kind.loss_fn)
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
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or a broken install (a CUDA wheel without its libraries)
        missing_optional(name, f"{name} is not importable ({exc!r}); {install}")


def missing_optional(name: str, message: str) -> None:
    """Skip the calling test module because the optional module `name` is missing (saying
    `message`), or fail it when `name` is in ``SHARDWISE_REQUIRED_MODULES``."""
    if name in os.environ.get(REQUIRED_ENV, "").split(","):
        pytest.fail(f"{message} ({REQUIRED_ENV} requires it)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def cli_status(argv: list[str]) -> int:
    """`shardwise.cli.main(argv)` in this process, as the real command would end: argparse's
    exit status, or 1 with the traceback on stderr for an error the CLI does not catch."""
    import traceback

    from shardwise.cli import main

    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return int(e.code or 0)
    except Exception:  # what the real CLI would print before dying with status 1
        print(traceback.format_exc(), end="", file=sys.stderr)
        return 1


def assert_clean_rl_console(stderr: str, run_dir: Path) -> None:
    """The console of an rl run holds shardwise's lines only: no warning about its own
    plot (it asks only for the metrics the config logs), no library's warning or log
    line, from the controller or forwarded from a worker; run.dir/logs/ has a file for the
    controller and each rank."""
    lines = [part for line in re.sub(r"\x1b\[[0-9;]*m", "", stderr).splitlines() for part in line.split("\r")]
    assert (run_dir / "rl.png").is_file() and not any("skipping metrics" in x for x in lines), stderr[-3000:]
    forwarded = [x for x in lines if x.startswith("(_RankHost")]
    assert all(re.match(r"\(_RankHost pid=\d+\) \[rank \d node \w+\] \w+ shardwise\.", x) for x in forwarded), \
        forwarded
    assert not [x for x in lines if "Warning" in x or "Token authentication" in x], stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["controller.log", "rl-rank0.log", "rl-rank1.log"]


@contextlib.contextmanager
def tmpfs(mount: Path, options: str):
    """A tmpfs mounted at `mount` with `options` (e.g. ``size=1100k``, ``ro``): a real small
    or read-only filesystem (a full one gives ENOSPC as any disk does). Mounting needs root
    (CAP_SYS_ADMIN): skipped, saying so, where it is refused."""
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here ({res.stderr.strip() or res.returncode}): the test needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
