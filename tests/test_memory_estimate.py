"""The plan's per-rank memory estimate (sharded params + grads + AdamW state) matches the
bytes each rank actually holds after apply_plan and one optimizer step (within 1%)."""

from __future__ import annotations

import pytest
import torch
from dist.common import (
    FP32,
    TINY_QWEN3,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_ranks
from torch.distributed.tensor import DTensor


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _measure(rank: int, world: int, overrides: list[str]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine, lm_loss_sum

    runtime = init_distributed(timeout_s=60)
    engine = TrainEngine(load_config(None, overrides), runtime)
    rows = make_global_batch(0, 4)
    total = loss_tokens(rows)
    for mb in micro_batches_of(rows, rank, world, 4 // world):
        (lm_loss_sum(engine.model, mb) * world / total).backward()
    engine.optimizer.step()  # grads kept: params, grads and optimizer state all live now
    params = [p for p in engine.model.parameters()]
    held = {
        "params": _storage_bytes(params),
        "grads": _storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": _storage_bytes([v for s in engine.optimizer.state.values() for v in s.values()
                                     if torch.is_tensor(v)]),
    }
    estimate = engine.plan.memory_per_rank_bytes[rank]
    teardown()
    return {"held": held, "estimate": estimate}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("extra", [[], ["fsdp.module_precision={lm_head: fp32}", "model.dtype=bf16",
                                        "fsdp.ignored_modules=[model.layers.1.mlp]"]],
                         ids=["fp32", "bf16_layered_ignored"])
def test_estimate_matches_bytes_held(world, extra):
    overrides = [TINY_QWEN3, *(FP32 if not extra else []), *extra]
    for r in run_ranks(_measure, world, overrides, timeout=180):
        for k in ("params", "grads", "optimizer"):
            held, est = r["held"][k], r["estimate"][k]
            assert held > 0
            assert abs(held - est) <= 0.01 * held, (k, held, est)
