"""Sharded training equals the unsharded reference run.

Each row is one named configuration: it trains a tiny HF model for 5 optimizer steps in 2
(or 4) real gloo processes with the TrainEngine, and one plain unsharded process trains the
same initial weights on the same global batches (tests/dist/common.py:reference_run). The
per-step losses and the final parameters must agree.

fp32 tolerance: 1e-5 relative on losses (observed <= 6e-8); parameters by
`assert_trained_params_close` (tests/dist/common.py, where the argument is written out):
99.9% of elements within 2e-6, all within lr x steps, and the difference's norm below 1e-3
of the update's. The only difference between the runs is the order of floating-point sums
(reduce-scatter, gradient accumulation, vector kernels), a few ulps for most gradient
elements; AdamW turns the relative error of a gradient element into a relative error of
its step, which is large only for the rare element whose gradient cancels to near zero.
A parameter 2.15e-6 off after 5 steps (ulysses_dp2_sp2_llama_tied under
ATEN_CPU_CAPABILITY=avx2) is such an element; one absolute bound per element failed there.

bf16 tolerance (rows marked bf16): the sharded run computes with bf16 parameters while the
reference computes in fp32. bf16 has 8 bits of mantissa (relative rounding 2^-9 = 0.2%);
through two layers and a 64-way softmax the loss moves by about 1%, so losses agree within
2e-2 relative. Parameters: AdamW moves each parameter by at most ~lr per step whatever the
gradient's size, so two runs whose gradients differ by rounding differ by at most
2 * lr * steps = 1e-2; we assert 4e-3, and that the sharded run did move the parameters.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from dist.common import (
    FP32,
    TINY_BERT,
    TINY_LLAMA,
    TINY_QWEN3,
    TINY_QWEN25_VL,
    assert_trained_params_close,
    reference_run,
    sharded_run,
)
from dist.launcher import run_ranks

STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-3
BASE = [f"train.optimizer.lr={LR}", "train.scheduler.warmup_steps=2", f"train.max_steps={STEPS}",
        "train.grad_clip=1.0"]

# name: (world, micro_batch_size, model, overrides, precision)
CASES = {
    "fsdp_default_qwen3": (2, 2, TINY_QWEN3, [], "fp32"),
    "fsdp_default_llama_tied": (2, 2, TINY_LLAMA, [], "fp32"),
    "pattern_wrap": (2, 2, TINY_QWEN3, ["fsdp.wrap.modules=[model.layers.{*}, model.layers.{0,1}.mlp]"], "fp32"),
    "embeddings_lm_head": (2, 2, TINY_QWEN3, ["fsdp.wrap.embeddings=true", "fsdp.wrap.lm_head=true"], "fp32"),
    "hsdp_2x2": (4, 1, TINY_QWEN3, ["parallel.fsdp_size=2"], "fp32"),
    "shard_grad_op": (2, 2, TINY_QWEN3, ["parallel.sharding_strategy=shard_grad_op"], "fp32"),
    "no_shard": (2, 2, TINY_QWEN3, ["parallel.sharding_strategy=no_shard"], "fp32"),
    "offload": (2, 2, TINY_QWEN3, ["fsdp.offload.enabled=true", "fsdp.offload.pin_memory=false"], "fp32"),
    "recompute": (2, 2, TINY_QWEN3, ["fsdp.recompute.modules=[Qwen3DecoderLayer]"], "fp32"),
    "recompute_reentrant_mlp": (2, 2, TINY_LLAMA, ["fsdp.recompute.modules=[model.layers.{*}.mlp]",
                                                   "fsdp.recompute.use_reentrant=true"], "fp32"),
    "prefetch": (2, 2, TINY_QWEN3, ["fsdp.prefetch.forward=2", "fsdp.prefetch.backward=2",
                                    "fsdp.wrap.embeddings=true"], "fp32"),
    "reshard_int": (4, 1, TINY_QWEN3, ["fsdp.reshard_after_forward=2"], "fp32"),
    "tiled_mlp": (2, 2, TINY_QWEN3, ["fsdp.tiled_mlp.enabled=true", "fsdp.tiled_mlp.shards=4"], "fp32"),
    "tiled_mlp_units_recompute": (2, 2, TINY_LLAMA, ["fsdp.wrap.modules=[model.layers.{*}, model.layers.{*}.mlp]",
                                                     "fsdp.tiled_mlp.enabled=true", "fsdp.tiled_mlp.shards=5",
                                                     "fsdp.recompute.modules=[model.layers.{*}]"], "fp32"),
    "freeze_and_ignored": (2, 2, TINY_QWEN3, ["model.freeze=[model.embed_tokens]",
                                              "fsdp.ignored_modules=[model.layers.1.mlp]"], "fp32"),
    "ulysses_sp2": (2, 2, TINY_QWEN3, ["parallel.ulysses_size=2"], "fp32"),
    "ulysses_dp2_sp2_llama_tied": (4, 1, TINY_LLAMA, ["parallel.ulysses_size=2"], "fp32"),
    "ulysses_sp4_kv_repeat_hsdp": (4, 2, TINY_QWEN3, ["parallel.ulysses_size=4", "parallel.fsdp_size=2"], "fp32"),
    "bf16_params": (2, 2, TINY_QWEN3, [], "bf16"),
    "layered_fp32_in_bf16": (2, 2, TINY_QWEN3, ["fsdp.module_precision={model.norm: fp32, lm_head: fp32}"], "bf16"),
    # encoders (seed 002): BERT with its masked-LM head (tied decoder) and with a classifier
    "encoder_mlm_fsdp2": (2, 2, TINY_BERT, ["model.task=masked_lm"], "fp32"),
    "encoder_mlm_bertlayer_shard_grad_op": (2, 2, TINY_BERT, ["model.task=masked_lm", "fsdp.wrap.classes=[BertLayer]",
                                                              "parallel.sharding_strategy=SHARD_GRAD_OP"], "fp32"),
    "encoder_cls_hsdp_2x2": (4, 1, TINY_BERT, ["model.task=sequence_classification", "parallel.fsdp_size=2"], "fp32"),
    # vision-language (seed 001): Qwen2.5-VL, rows with images, the vision tower frozen, its
    # blocks units that do not cast their inputs
    "vl_frozen_tower": (2, 2, TINY_QWEN25_VL, ["model.freeze=[model.visual]"], "fp32"),
}


# Overrides that change the math (not only the sharding) apply to the reference as well.
MATH_KEYS = ("model.freeze", "model.task")


@cache
def _reference(model: str, micro: int, math: tuple[str, ...] = (), steps: int = STEPS) -> dict:
    return reference_run([model, *FP32, *BASE, *math], steps, GLOBAL_BATCH, micro)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_unsharded(name):
    world, micro, model, overrides, precision = CASES[name]
    prec = FP32 if precision == "fp32" else ["fsdp.mixed_precision.param_dtype=bf16"]
    ref = _reference(model, micro, tuple(o for o in overrides if o.startswith(MATH_KEYS)))
    ranks = run_ranks(sharded_run, world, [model, *prec, *BASE, *overrides], STEPS, GLOBAL_BATCH, micro,
                      timeout=240)
    # every rank reports the same global loss
    for r in ranks[1:]:
        assert r["losses"] == ranks[0]["losses"]
    got = torch.tensor(ranks[0]["losses"], dtype=torch.float64)
    want = torch.tensor(ref["losses"], dtype=torch.float64)
    params = ranks[0]["params"]
    assert params.keys() == ref["params"].keys()
    if precision == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        init = _reference(model, micro, tuple(o for o in overrides if o.startswith(MATH_KEYS)), steps=0)
        assert_trained_params_close(params, ref["params"], init["params"], LR, STEPS)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
        assert not torch.equal(got, want), "bf16 run matched fp32 bitwise: mixed precision not applied?"
        init = _reference(model, micro, steps=0)["params"]
        for k in params:
            torch.testing.assert_close(params[k], ref["params"][k], rtol=0, atol=4e-3, msg=k)
        moved = sum(float((params[k] - init[k]).abs().max()) > 1e-4 for k in params)
        assert moved >= len(params) - 2  # the norm weights of q/k may barely move; the rest must
