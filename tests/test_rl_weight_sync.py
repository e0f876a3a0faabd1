"""Weight sync from the FSDP actor into a rollout engine that keeps its own copy: after a
training step the copy equals the actor's full parameters, tensor by tensor and in its
logits; the HF engine, which generates with the actor's parameters, needs no sync."""

from __future__ import annotations

import torch
from dist.common import (
    FP32,
    TINY_LLAMA,
    TINY_QWEN3,
    full_params,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_ranks


def sync_body(rank: int, world: int, model_override: str) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.generate import GenerationEngine, HFGenerator
    from shardwise.engine.train import TrainEngine
    from shardwise.engine.weight_sync import WeightSync
    from shardwise.fsdp.gather import iter_full_tensors
    from shardwise.models.loading import build_full_model

    class OwnCopyEngine(GenerationEngine):
        """An engine with its own plain copy of the model (as vLLM would have)."""

        def __init__(self, model):
            self.model = model
            self.loaded: list[str] = []

        def sync_weights(self, named_tensors):
            params = dict(self.model.state_dict())
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
                self.loaded.append(name)

        def generate_sequences(self, prompts):
            raise NotImplementedError("not needed to test the weight sync")

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, [model_override, *FP32, "train.optimizer.lr=1e-2"])
    engine = TrainEngine(cfg, runtime)
    rows = make_global_batch(0, 4)
    engine.train_step(micro_batches_of(rows, rank, world, 2), loss_tokens(rows))
    copy = OwnCopyEngine(build_full_model(cfg.model, seed=123))  # different init: the sync must overwrite it
    sync = WeightSync(engine.model, copy)
    assert sync.sync() is True
    want = full_params(engine.model)
    got = {k: v.detach().clone() for k, v in copy.model.state_dict().items()}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        engine.model.eval()
        sharded_logits = engine.model(input_ids=ids).logits
        copy_logits = copy.model(input_ids=ids).logits
    names = [n for n, _ in iter_full_tensors(engine.model)]
    hf = WeightSync(engine.model, HFGenerator(engine.model, cfg.rl.rollout, runtime, 0, 2))
    shared = hf.sync()
    teardown()
    return {"want": want, "got": got, "loaded": copy.loaded, "names": names, "shared_sync": shared,
            "logits_diff": float((sharded_logits - copy_logits).abs().max())}


def test_sync_into_an_engine_with_its_own_copy_qwen3():
    for out in run_ranks(sync_body, 2, TINY_QWEN3, timeout=120):
        assert out["shared_sync"] is False
        assert out["loaded"] == out["names"] and len(set(out["names"])) == len(out["names"])
        for k, v in out["want"].items():
            assert torch.equal(out["got"][k], v), k
        assert out["logits_diff"] < 1e-5


def test_sync_sends_a_tied_weight_once_llama():
    out = run_ranks(sync_body, 2, TINY_LLAMA, timeout=120)[0]
    assert "lm_head.weight" not in out["names"] and "model.embed_tokens.weight" in out["names"]
    assert torch.equal(out["got"]["lm_head.weight"], out["want"]["model.embed_tokens.weight"])
    assert out["logits_diff"] < 1e-5


def bucket_body(rank: int, world: int, extra: tuple[str, ...]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine
    from shardwise.fsdp.gather import full_tensor, gather_full, iter_full_tensors

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, [TINY_QWEN3, *FP32, "train.optimizer.lr=1e-2", *extra])
    engine = TrainEngine(cfg, runtime)
    rows = make_global_batch(0, 4)
    engine.train_step(micro_batches_of(rows, rank, world, 2), loss_tokens(rows))  # LoRA: B is no longer 0
    sd = engine.model.state_dict()
    want = {k: full_tensor(v) for k, v in sd.items()}  # DTensor's own gather, one tensor at a time
    got = gather_full(sd)
    out = {"state_mismatch": [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])],
           "uneven": sum(v.shape[0] % world != 0 for v in want.values() if v.dim()), "mismatch": {}}
    one_by_one = list(iter_full_tensors(engine.model))
    out["names"] = [n for n, _ in one_by_one]
    for bucket in (1000, 1 << 30):  # a bucket smaller than most tensors (each goes alone), and all at once
        got = list(iter_full_tensors(engine.model, bucket_bytes=bucket))
        out["mismatch"][bucket] = [n for (n, t), (m, u) in zip(one_by_one, got, strict=True)
                                   if n != m or t.dtype != u.dtype or not torch.equal(t, u)]
    teardown()
    return out


def test_bucketed_gather_equals_one_tensor_at_a_time():
    """`gather_full` (one all-gather per bucket, shards padded to the chunk size) gives the
    tensors `DTensor.full_tensor` gives, bitwise: uneven shards (3 ranks: 32 rows as 11, 11,
    10) with LoRA's merge, and HSDP (2 replicas x 2 shards: gathered over the shard group)."""
    lora = ("model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[all-linear]")
    for world, extra in ((3, lora), (4, ("parallel.fsdp_size=2",))):
        for out in run_ranks(bucket_body, world, extra, timeout=120):
            assert out["state_mismatch"] == [] and out["names"], (world, out["state_mismatch"])
            assert out["mismatch"] == {1000: [], 1 << 30: []}, (world, out["mismatch"])
            assert out["uneven"] > 0 or world == 4
