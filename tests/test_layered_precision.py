"""Layered precision (seed 000): modules listed in fsdp.module_precision keep their
parameters AND buffers at fp32 inside a bf16 model, see fp32 during forward, and reduce
their gradients in fp32; the other modules compute in bf16."""

from __future__ import annotations

import torch
from dist.common import TINY_QWEN3, loss_tokens, make_global_batch, micro_batches_of
from dist.launcher import run_ranks

FP32_MODULES = ["model.norm", "lm_head", "model.rotary_emb", "model.layers.0.input_layernorm"]
OVERRIDES = [
    TINY_QWEN3,
    "model.dtype=bf16",
    "fsdp.mixed_precision.param_dtype=bf16",
    "fsdp.mixed_precision.reduce_dtype=bf16",
    "fsdp.module_precision={" + ", ".join(f"{m}: fp32" for m in FP32_MODULES) + "}",
    "train.max_steps=2",
]


def _record_dtypes(rank: int, world: int) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    engine = TrainEngine(load_config(None, OVERRIDES), runtime)
    seen: dict[str, list[str]] = {}

    def hook(name):
        def record(mod, args):
            for pn, p in mod.named_parameters(recurse=False):
                seen.setdefault(f"{name}.{pn}" if name else pn, []).append(str(p.dtype))
            for bn, b in mod.named_buffers(recurse=False):
                seen.setdefault(f"{name}.{bn}" if name else bn, []).append(str(b.dtype))
        return record

    for name, mod in engine.model.named_modules():
        mod.register_forward_pre_hook(hook(name))
    rows = make_global_batch(0, 4)
    res = engine.train_step(micro_batches_of(rows, rank, world, 2), loss_tokens(rows))
    # Reduce dtype of every FSDP-managed parameter, as FSDP used it (set at lazy init;
    # None means gradients are reduced in the parameter's own dtype).
    reduce = {}
    for name, mod in engine.model.named_modules():
        state = getattr(mod, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        if group is not None:
            for fp in group.fsdp_params:
                reduce[f"{name}.{fp._param_fqn}" if name else fp._param_fqn] = str(group._reduce_dtype or fp.orig_dtype)
    grads_dtype = {n: str(p.dtype) for n, p in engine.model.named_parameters()}
    teardown()
    return {"seen": seen, "reduce": reduce, "storage": grads_dtype, "loss": res.loss}


def _listed(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in FP32_MODULES)


def test_fp32_modules_inside_bf16_model():
    ranks = run_ranks(_record_dtypes, 2, timeout=180)
    for r in ranks:
        seen = r["seen"]
        assert any(_listed(k) for k in seen) and any(not _listed(k) for k in seen)
        for name, dtypes in seen.items():
            if _listed(name):
                assert set(dtypes) == {"torch.float32"}, (name, dtypes)
            elif not name.endswith(("inv_freq", "original_inv_freq")):
                assert set(dtypes) == {"torch.bfloat16"}, (name, dtypes)
        # buffers of a listed module: rotary inv_freq is kept in fp32
        assert set(seen["model.rotary_emb.inv_freq"]) == {"torch.float32"}
        # gradients of fp32 modules are reduced in fp32, the rest in the global bf16
        for name, dt in r["reduce"].items():
            want = "torch.float32" if _listed(name) else "torch.bfloat16"
            assert dt == want, (name, dt)
        # master weights: fp32 for listed modules, bf16 elsewhere
        for name, dt in r["storage"].items():
            assert dt == ("torch.float32" if _listed(name) else "torch.bfloat16"), (name, dt)
        assert torch.isfinite(torch.tensor(r["loss"]))
