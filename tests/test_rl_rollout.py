"""HFGenerator (the RL rollout's and every job's generation engine) and gathered_for_generation on a 2-rank FSDP2 tiny Qwen3 (fp32 parameters).

One spawned run (module fixture) builds two TrainEngines with the same seeded init: A, on
which everything is generated, and Ref, which never generates. It records, in order:
uneven forwards inside `gathered_for_generation`, seeded sampling, log-probs against
`compute_log_probs`, a left-padded greedy batch against each prompt alone, an EOS after one
token on rank 0 only, zero rows on rank 1, then train steps on A (between generations) and
on Ref, whose losses and parameters must be bitwise equal: generating leaves training
untouched. A second, smaller run checks that the reshard settings torch keeps per FSDP
state (automatic root, explicit bools) come back exactly. Assertions run here, per rank.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from dist.common import (
    FP32,
    TINY_QWEN3,
    full_params,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_ranks

R = 8  # max_new_tokens
PAD = 0
EOS = 63  # main rollout; the EOS test picks its own
VOCAB = 64
OVERRIDES = [TINY_QWEN3, *FP32, "train.optimizer.lr=1e-2", "train.scheduler.name=constant",
             "train.scheduler.warmup_steps=0", "train.grad_clip=null",
             f"rl.rollout.max_new_tokens={R}", "rl.rollout.temperature=1.0", "rl.rollout.top_p=1.0"]
TOL = 1e-5  # fp32 both sides; KV-cached decoding vs one full forward differ only in summation order


def prompts_batch(lengths: list[int], seed: int, width: int | None = None, tag: int = 0, **meta):
    """Left-padded prompts of the given lengths (tokens 1..VOCAB-2: never PAD, never EOS)."""
    from shardwise.data.batch import Batch

    width = width or max(lengths, default=1)
    g = torch.Generator().manual_seed(1000 + tag)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, VOCAB - 1, (n,), generator=g)
        mask[i, width - n:] = 1
    rows = range(len(lengths))
    return Batch.from_dict(
        tensors={"prompt_ids": ids, "prompt_mask": mask},
        arrays={"prompt": [f"p{tag}-{i}" for i in rows], "ground_truth": [str(i) for i in rows],
                "uid": [f"u{tag}-{i}" for i in rows]},
        meta={"seed": seed, **meta},
    )


def _log_probs_of(model, seqs) -> torch.Tensor:
    """compute_log_probs of the generated sequences, masked like the rollout's (collective)."""
    from shardwise.engine.infer import compute_log_probs

    model.eval()
    with torch.no_grad():
        lp = compute_log_probs(model, seqs.tensors["input_ids"], seqs.tensors["attention_mask"],
                               seqs.tensors["position_ids"])["log_probs"]
    return lp.masked_fill(seqs.tensors["response_mask"] == 0, 0.0)


def _settings(model) -> list:
    """Per FSDP state: (auto flag, per-group post_forward_mesh_info identity)."""
    from shardwise.fsdp.gather import fsdp_states

    return [(s._auto_reshard_after_forward, [id(g.post_forward_mesh_info) if g.post_forward_mesh_info is not None
                                             else None for g in s._fsdp_param_groups])
            for s in (p.state for p in fsdp_states(model))]


def _local_shards(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()}


def _train(engine, step: int, rank: int, world: int):
    rows = make_global_batch(step, 4)
    return engine.train_step(micro_batches_of(rows, rank, world, 2), loss_tokens(rows)).loss


# ---------------------------------------------------------------- rank body


def _rollout_body(rank: int, world: int, overrides: list[str]) -> dict:
    from torch.distributed.tensor import DTensor

    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.generate import HFGenerator
    from shardwise.engine.train import TrainEngine
    from shardwise.fsdp.gather import gathered_for_generation

    runtime = init_distributed(timeout_s=30)  # a rank stuck in a collective fails in seconds
    cfg = load_config(None, overrides)
    a, ref = TrainEngine(cfg, runtime), TrainEngine(cfg, runtime)
    rollout = HFGenerator(a.model, cfg.rl.rollout, runtime, pad_id=PAD, eos_id=EOS)
    out: dict = {}

    # 1. Uneven numbers of forwards inside the gathered block (rank 0: 3, rank 1: 1).
    before_settings, before_shards = _settings(a.model), _local_shards(a.model)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad(), gathered_for_generation(a.model):
        out["inside_all_plain"] = not any(isinstance(p, DTensor) for p in a.model.parameters())
        inside = [a.model(input_ids=ids).logits for _ in range(3 if rank == 0 else 1)]
    out["after_all_dtensor"] = all(isinstance(p, DTensor) for p in a.model.parameters())
    out["settings_restored"] = _settings(a.model) == before_settings
    out["shards_unchanged"] = all(torch.equal(v, before_shards[k]) for k, v in _local_shards(a.model).items())
    with torch.no_grad():  # the same forward the normal (all-gathering) way
        out["gathered_logits_equal"] = torch.equal(inside[0], a.model(input_ids=ids).logits)

    # 2. Seeded sampling, temperature 1, top_p 1: reproducible, seed-dependent, global RNG untouched.
    p = prompts_batch([3, 5, 4], seed=11)  # the same rows on both ranks
    rng = torch.get_rng_state()
    s1, s1_again = rollout.generate_sequences(p), rollout.generate_sequences(p)
    s2 = rollout.generate_sequences(prompts_batch([3, 5, 4], seed=12))
    out["rng_untouched"] = torch.equal(rng, torch.get_rng_state())
    out["s1"], out["s1_again"], out["s2_ids"] = dict(s1.tensors), dict(s1_again.tensors), s2.tensors["input_ids"]
    out["s1_arrays"] = {k: list(v) for k, v in s1.arrays.items()}
    out["s1_meta"] = s1.meta
    # A session (a multi-turn rollout's turns): gathered once, the same samples; FSDP's
    # forward hooks (skipped while generating) all back in place after each call.
    hooks = [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in a.model.modules()]
    with rollout.rollout_session():
        in_session = [rollout.generate_sequences(p), rollout.generate_sequences(p)]
    out["session_same"] = all(torch.equal(v, s.tensors[k]) for s in in_session for k, v in s1.tensors.items())
    out["fsdp_hooks_back"] = hooks == [(list(m._forward_pre_hooks), list(m._forward_hooks))
                                       for m in a.model.modules()]

    # 3. rollout_log_probs against one full forward of the same (sharded) model.
    out["s1_recomputed"] = _log_probs_of(a.model, s1)
    # ... and at other settings: temperature 5 (near uniform: HF's default top_k=50 would show
    # as no token ranked >= 50 ever drawn), and top_p 0.5.
    # A checkpoint's generation_config.json must not leak into the sampling (Qwen3 ships top_k 20).
    from transformers import GenerationConfig

    a.model.generation_config = GenerationConfig(top_k=5, temperature=0.3, suppress_tokens=list(range(32)))
    for name, update in (("hot", {"temperature": 5.0}), ("top_p", {"top_p": 0.5})):
        seqs = HFGenerator(a.model, cfg.rl.rollout.model_copy(update=update), runtime, PAD, EOS
                         ).generate_sequences(prompts_batch([3, 5, 4], seed=13, tag=rank))
        with torch.no_grad():
            logits = a.model(input_ids=seqs.tensors["input_ids"], attention_mask=seqs.tensors["attention_mask"],
                             position_ids=seqs.tensors["position_ids"]).logits
        out[name] = {"seqs": dict(seqs.tensors), "logits": logits}
    out["generation_config_kept"] = a.model.generation_config.top_k == 5

    # 4. Greedy on a left-padded batch of different lengths vs each prompt alone; and the
    #    position ids HF passes to the model during generation.
    greedy = prompts_batch([2, 6, 4], seed=0, tag=10 + rank, greedy=True)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    modes: list[bool] = []

    def record(module, _args, kw):
        seen.append((kw["position_ids"].clone(), kw["attention_mask"].clone()))
        modes.extend(m.training for m in module.modules())

    hook = a.model.register_forward_pre_hook(record, with_kwargs=True)
    a.model.train()
    a.model.model.layers[1].eval()  # a mixed state, to be restored as it was
    batched = rollout.generate_sequences(greedy)
    hook.remove()
    out["eval_inside"] = not any(modes)
    out["modes_restored"] = a.model.training and not any(m.training for m in a.model.model.layers[1].modules()) \
        and a.model.model.layers[0].training
    out["hf_positions_ok"] = [torch.equal(pos, (am.cumsum(-1) - 1).clamp(min=0)[:, -pos.shape[1]:])
                              for pos, am in seen]
    out["hf_forwards"] = len(seen)
    alone = []
    for i in range(len(greedy)):
        n = int(greedy.tensors["prompt_mask"][i].sum())
        one = greedy[i]
        one.tensors["prompt_ids"] = one.tensors["prompt_ids"][:, -n:]
        one.tensors["prompt_mask"] = one.tensors["prompt_mask"][:, -n:]
        alone.append(rollout.generate_sequences(one))
    out["greedy_batched"] = {k: batched.tensors[k] for k in ("responses", "rollout_log_probs", "response_mask")}
    out["greedy_alone"] = [{k: s.tensors[k] for k in ("responses", "rollout_log_probs", "response_mask")}
                           for s in alone]

    # 5. EOS after one token on rank 0 only: eos_id = rank 0's greedy first token.
    cands = prompts_batch([3, 6, 5, 4, 7], seed=0, width=7, tag=20)  # the same on both ranks
    with torch.no_grad():
        a.model.eval()
        last = a.model(input_ids=cands.tensors["prompt_ids"], attention_mask=cands.tensors["prompt_mask"],
                       position_ids=(cands.tensors["prompt_mask"].cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    first = last.argmax(-1)
    eos = int(first[0])
    other = next(i for i in range(1, len(cands)) if int(first[i]) != eos)
    mine = cands[[0]] if rank == 0 else cands[[other]]
    n = int(mine.tensors["prompt_mask"].sum())
    mine.tensors["prompt_ids"], mine.tensors["prompt_mask"] = (mine.tensors["prompt_ids"][:, -n:],
                                                               mine.tensors["prompt_mask"][:, -n:])
    mine.meta["greedy"] = True
    eos_rollout = HFGenerator(a.model, cfg.rl.rollout, runtime, pad_id=PAD, eos_id=eos)
    out["eos"] = eos
    out["eos_seq"] = dict(eos_rollout.generate_sequences(mine).tensors)

    # 6. Zero rows on rank 1.
    zero = prompts_batch([4, 2] if rank == 0 else [], seed=5, width=4, tag=30)
    z = rollout.generate_sequences(zero)
    out["zero"] = {k: (tuple(v.shape), v.dtype) for k, v in z.tensors.items()}
    out["zero_arrays"] = sorted(z.arrays)

    # 8. Per-row seeds (arrays["sample_key"]): the same batch on both ranks (as if one rank
    #    generated it all), in another row order on each rank, and split over the 2 ranks.
    keyed = prompts_batch([3, 3, 5, 4, 5, 2], seed=21, tag=40)
    keyed.tensors["prompt_ids"][1] = keyed.tensors["prompt_ids"][0]  # rows 0, 1: one prompt, two samples
    keyed.arrays["sample_key"] = np.array(["g0/0", "g0/1", "g1/0", "g2/0", "g2/1", "g3/0"], dtype=object)
    order = [4, 0, 5, 2, 1, 3] if rank == 0 else [5, 4, 3, 2, 1, 0]
    whole = rollout.generate_sequences(keyed)
    out["keyed_whole"] = {k: whole.tensors[k] for k in ("responses", "rollout_log_probs", "response_mask")}
    out["keyed_whole_recomputed"] = _log_probs_of(a.model, whole)
    permuted = rollout.generate_sequences(keyed.reorder(order))
    out["keyed_order"] = order
    out["keyed_permuted"] = {k: permuted.tensors[k] for k in ("responses", "rollout_log_probs")}
    half = rollout.generate_sequences(keyed[[0, 1, 2]] if rank == 0 else keyed[[3, 4, 5]])
    out["keyed_half"] = {k: half.tensors[k] for k in ("responses", "rollout_log_probs")}
    out["keyed_other_seed"] = rollout.generate_sequences(
        Batch(keyed.tensors, keyed.arrays, {**keyed.meta, "seed": 22})).tensors["responses"]

    # 7. Train A, generate again, then train Ref the same way: A's generations change nothing.
    shards_before_step = _local_shards(a.model)
    out["a_equals_ref_before_step"] = all(torch.equal(v, shards_before_step[k])
                                          for k, v in _local_shards(ref.model).items())
    out["a_losses"] = [_train(a, 0, rank, world)]
    s3 = rollout.generate_sequences(p)  # same prompts and seed as s1, updated weights
    out["s3"] = dict(s3.tensors)
    out["s3_recomputed"] = _log_probs_of(a.model, s3)
    out["s3_old_model"] = _log_probs_of(ref.model, s3)  # Ref still holds the old weights
    out["s1_new_model"] = _log_probs_of(a.model, s1)
    out["ref_losses"] = [_train(ref, 0, rank, world)]
    out["a_losses"].append(_train(a, 1, rank, world))
    out["ref_losses"].append(_train(ref, 1, rank, world))
    pa, pr = full_params(a.model), full_params(ref.model)
    out["params_equal_ref"] = all(torch.equal(pa[k], pr[k]) for k in pa)
    teardown()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_rollout_body, 2, OVERRIDES, timeout=150)


# ---------------------------------------------------------------- gathered_for_generation


def test_uneven_forwards_inside_gathered_block_issue_no_collective(ranks):
    for r in ranks:
        assert r["inside_all_plain"] and r["after_all_dtensor"]
        assert r["settings_restored"] and r["shards_unchanged"]
        assert r["gathered_logits_equal"]


def test_generation_leaves_training_bitwise_equal(ranks):
    """A generated (and ran uneven forwards) between its steps; Ref never did."""
    for r in ranks:
        assert r["a_equals_ref_before_step"]
        assert r["a_losses"] == r["ref_losses"]
    assert ranks[0]["params_equal_ref"]


# ---------------------------------------------------------------- HFGenerator


def test_output_layout(ranks):
    for r in ranks:
        t = r["s1"]
        b, p = t["prompt_ids"].shape
        assert set(t) == {"prompt_ids", "prompt_mask", "input_ids", "attention_mask", "position_ids",
                          "response_mask", "responses", "rollout_log_probs"}
        for k in ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs"):
            assert t[k].shape == (b, p + R), k
        assert t["responses"].shape == (b, R)
        assert all(t[k].dtype == torch.int64 for k in t if k != "rollout_log_probs")
        assert t["rollout_log_probs"].dtype == torch.float32
        assert torch.equal(t["input_ids"][:, :p], t["prompt_ids"])
        assert torch.equal(t["input_ids"][:, p:], t["responses"])
        assert torch.equal(t["attention_mask"], torch.cat([t["prompt_mask"], t["response_mask"][:, p:]], 1))
        assert torch.equal(t["position_ids"], (t["attention_mask"].cumsum(-1) - 1).clamp(min=0))
        assert torch.equal(t["responses"][t["response_mask"][:, p:] == 0],
                           torch.full((int((t["response_mask"][:, p:] == 0).sum()),), PAD))
        assert r["s1_arrays"] == {"prompt": [f"p0-{i}" for i in range(3)],
                                  "ground_truth": ["0", "1", "2"], "uid": [f"u0-{i}" for i in range(3)]}
        assert r["s1_meta"] == {"seed": 11}


def test_same_seed_same_samples_other_seed_other_samples(ranks):
    for r in ranks:
        for k, v in r["s1"].items():
            assert torch.equal(v, r["s1_again"][k]), k
        assert not torch.equal(r["s1"]["input_ids"], r["s2_ids"])
        assert r["rng_untouched"]
    # Same rows and seed on both ranks: the rank is part of the sampling seed, else e.g. GRPO
    # copies of one prompt split over ranks would be sampled identically.
    assert torch.equal(ranks[0]["s1"]["prompt_ids"], ranks[1]["s1"]["prompt_ids"])
    assert not torch.equal(ranks[0]["s1"]["responses"], ranks[1]["s1"]["responses"])


def test_rollout_session_and_skipped_fsdp_hooks_change_nothing(ranks):
    """`rollout_session` gathers once for several calls: the same samples as calls alone;
    the FSDP forward hooks that generation skips are all back, in order."""
    for r in ranks:
        assert r["session_same"] and r["fsdp_hooks_back"]


def test_rollout_log_probs_equal_compute_log_probs(ranks):
    for r in ranks:
        mask = r["s1"]["response_mask"].bool()
        assert mask.sum() >= 2 * R  # most rows run to max_new_tokens
        got = r["s1"]["rollout_log_probs"]
        torch.testing.assert_close(got, r["s1_recomputed"], atol=TOL, rtol=0)
        assert got[mask].lt(0).all() and torch.equal(got[~mask], torch.zeros(int((~mask).sum())))


def test_rollout_samples_with_the_updated_weights(ranks):
    for r in ranks:
        # The step moved the log-probs of the fixed responses of s1 ...
        m1 = r["s1"]["response_mask"].bool()
        assert (r["s1_new_model"][m1] - r["s1"]["rollout_log_probs"][m1]).abs().max() > 100 * TOL
        # ... and the rollout after it reports the new model's log-probs, not the old one's.
        m3 = r["s3"]["response_mask"].bool()
        torch.testing.assert_close(r["s3"]["rollout_log_probs"], r["s3_recomputed"], atol=TOL, rtol=0)
        assert (r["s3"]["rollout_log_probs"][m3] - r["s3_old_model"][m3]).abs().max() > 100 * TOL


def test_temperature_and_no_top_k(ranks):
    for r in ranks:
        t, logits = r["hot"]["seqs"], r["hot"]["logits"]
        p = t["prompt_ids"].shape[1]
        m = t["response_mask"].bool()
        assert m.sum() >= 2 * R
        expect = torch.log_softmax(logits[:, :-1] / 5.0, -1).gather(-1, t["input_ids"][:, 1:, None])[..., 0]
        torch.testing.assert_close(t["rollout_log_probs"][:, 1:][m[:, 1:]], expect[m[:, 1:]], atol=TOL, rtol=0)
        # rank of each sampled token among the logits that produced it (0 = most likely)
        rank_of = (logits[:, :-1] > logits[:, :-1].gather(-1, t["input_ids"][:, 1:, None])).sum(-1)
        assert rank_of[:, p - 1:][m[:, p:]].max() >= 50  # top_k is off (HF's 50 and the model's 5)
        assert t["responses"][m[:, p:]].lt(32).any()  # the model's suppress_tokens did not apply
        assert r["generation_config_kept"]


def test_top_p_samples_stay_in_the_nucleus(ranks):
    for r in ranks:
        t, logits = r["top_p"]["seqs"], r["top_p"]["logits"]
        m = t["response_mask"][:, 1:].bool()
        probs = torch.softmax(logits[:, :-1].double(), -1)
        chosen = probs.gather(-1, t["input_ids"][:, 1:, None])
        mass_before = torch.where(probs > chosen, probs, 0.0).sum(-1)  # of strictly likelier tokens
        assert mass_before[m].max() < 0.5 + 1e-4


def test_sample_key_seeds_each_row_whichever_rank_position_or_batch(ranks):
    """With arrays["sample_key"] a row's tokens depend on its key (and the call's seed), not
    on the rank (both ranks generate the whole batch alike), its position (another order on
    each rank) or the rows beside it (the batch split over the 2 ranks); the log-probs stay
    the model's (temperature 1) distribution of the sampled tokens."""
    whole = [r["keyed_whole"] for r in ranks]
    assert torch.equal(whole[0]["responses"], whole[1]["responses"])
    for rank, r in enumerate(ranks):
        resp, lp = r["keyed_whole"]["responses"], r["keyed_whole"]["rollout_log_probs"]
        torch.testing.assert_close(lp, r["keyed_whole_recomputed"], atol=TOL, rtol=0)
        order = r["keyed_order"]
        assert torch.equal(r["keyed_permuted"]["responses"], resp[order])
        torch.testing.assert_close(r["keyed_permuted"]["rollout_log_probs"], lp[order], atol=TOL, rtol=0)
        mine = [0, 1, 2] if rank == 0 else [3, 4, 5]
        assert torch.equal(r["keyed_half"]["responses"], resp[mine])
        torch.testing.assert_close(r["keyed_half"]["rollout_log_probs"], lp[mine], atol=TOL, rtol=0)
        assert not torch.equal(r["keyed_other_seed"], resp)  # the call's seed still counts
    assert not torch.equal(whole[0]["responses"][0], whole[0]["responses"][1])  # one prompt, two keys


def test_preallocated_layer_holds_what_the_concatenating_layer_holds():
    """`PreallocatedLayer` (the ragged loop's cache): prompt, decoding steps past its first
    buffer and past `capacity`, rows dropped between them: the same keys and values as
    transformers' `DynamicLayer` at every step, bitwise (copies only)."""
    from transformers.cache_utils import DynamicLayer

    from shardwise.engine.generate import PreallocatedLayer

    torch.manual_seed(0)
    ours, theirs = PreallocatedLayer(capacity=12), DynamicLayer()
    rows = 5
    for step, width in enumerate([4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]):
        k, v = torch.randn(rows, 2, width, 8), torch.randn(rows, 2, width, 6)
        a, b = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
        assert ours.get_seq_length() == theirs.get_seq_length()
        if step in (3, 9):  # rows leave the batch
            keep = torch.tensor([0, 2, 3][: rows - 1])
            ours.batch_select_indices(keep)
            theirs.batch_select_indices(keep)
            rows = len(keep)
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert ours.get_seq_length() == 17  # past capacity 12: grown to fit


def test_row_sampler_draws_the_tempered_nucleus_distribution():
    """RowSampler.draw (inverse CDF of softmax(logits / T), cut to the top-p nucleus) on
    fixed logits against the distribution computed here: 20000 uniforms per setting, the
    frequencies within 0.015 of it (about 5 standard deviations of a share near 0.5);
    nothing outside the nucleus; and the processor forces exactly the drawn token."""
    from shardwise.engine.generate import RowSampler

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    u = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for temperature, top_p in ((1.0, 1.0), (0.5, 1.0), (2.0, 0.6)):
        sampler = RowSampler([], temperature, top_p, prompt_width=0, max_new_tokens=1)
        tokens = sampler.draw(logits.expand(len(u), -1), u)
        probs = torch.softmax(logits.double() / temperature, -1)
        keep = (torch.cumsum(probs, 0) - probs) < top_p  # logits are sorted already
        want = torch.where(keep, probs, 0.0) / torch.where(keep, probs, 0.0).sum()
        got = torch.bincount(tokens, minlength=len(logits)).double() / len(u)
        assert (got - want).abs().max() < 0.015, (temperature, top_p, got, want)
        assert got[~keep].sum() == 0
    sampler = RowSampler([3, 4], 1.0, 1.0, prompt_width=2, max_new_tokens=3)
    forced = sampler(torch.zeros((2, 3), dtype=torch.long), logits.expand(2, -1).clone())
    assert (forced == 0).sum(-1).tolist() == [1, 1] and torch.isinf(forced).sum() == 2 * (len(logits) - 1)
    assert torch.equal(forced.argmax(-1), sampler.draw(logits.expand(2, -1), sampler.uniforms[:, 1]))


def test_generation_runs_in_eval_mode_and_restores_modes(ranks):
    for r in ranks:
        assert r["eval_inside"] and r["modes_restored"]


def test_greedy_left_padded_batch_equals_each_prompt_alone(ranks):
    for r in ranks:
        b = r["greedy_batched"]
        p = b["response_mask"].shape[1] - R
        for i, one in enumerate(r["greedy_alone"]):
            q = one["response_mask"].shape[1] - R
            assert torch.equal(b["responses"][i], one["responses"][0])
            assert torch.equal(b["response_mask"][i, p:], one["response_mask"][0, q:])
            torch.testing.assert_close(b["rollout_log_probs"][i, p:], one["rollout_log_probs"][0, q:],
                                       atol=TOL, rtol=0)


def test_hf_generation_positions_equal_default_position_ids(ranks):
    for r in ranks:
        assert r["hf_forwards"] >= 2 and all(r["hf_positions_ok"])


def test_eos_after_one_token_on_one_rank(ranks):
    eos = ranks[0]["eos"]
    assert ranks[1]["eos"] == eos
    t0, t1 = ranks[0]["eos_seq"], ranks[1]["eos_seq"]
    assert t0["responses"][0, 0] == eos and torch.equal(t0["responses"][0, 1:], torch.full((R - 1,), PAD))
    p0 = t0["prompt_ids"].shape[1]
    assert torch.equal(t0["response_mask"][0, p0:], torch.tensor([1] + [0] * (R - 1)))
    assert torch.equal(t0["attention_mask"][0, p0 + 1:], torch.zeros(R - 1, dtype=torch.long))
    assert t0["rollout_log_probs"][0, p0] < 0 and t0["rollout_log_probs"][0, p0 + 1:].eq(0).all()
    # rank 1 decoded more steps than rank 0's one, alone (no collective kept them in step)
    p1 = t1["prompt_ids"].shape[1]
    assert p1 != p0 and t1["responses"][0, 0] != eos
    assert int(t1["response_mask"].sum()) > 1


def test_zero_rows_on_one_rank(ranks):
    z0, z1 = ranks[0]["zero"], ranks[1]["zero"]
    assert set(z0) == set(z1) and ranks[0]["zero_arrays"] == ranks[1]["zero_arrays"]
    assert z1["input_ids"] == ((0, 4 + R), torch.int64) and z1["responses"] == ((0, R), torch.int64)
    assert z1["rollout_log_probs"] == ((0, 4 + R), torch.float32)
    assert z0["input_ids"] == ((2, 4 + R), torch.int64)


# ---------------------------------------------------------------- reshard settings torch keeps


def _tiny_fsdp(mesh, reshard) -> torch.nn.Module:
    """Three Linear units and a last Linear of the root's own, in a Sequential root; `reshard`
    for the units (None: fully_shard's automatic default), the root always automatic (so
    torch's lazy init decides it)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    kw = {} if reshard is None else {"reshard_after_forward": reshard}
    for layer in model[:3]:
        fully_shard(layer, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh)


def _settings_body(rank: int, world: int) -> dict:
    """Per case: the reshard settings after a gathered block vs a twin that never entered one
    (identity of torch's mesh-info objects: None = keep, group's own = reshard, other =
    int), and loss and gradients of a training forward/backward afterwards, twin vs model."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.fsdp.gather import fsdp_states, gathered_for_generation

    init_distributed(timeout_s=30)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))

    def kinds(model):
        return [(s._auto_reshard_after_forward, s._is_root,
                 ["keep" if g.post_forward_mesh_info is None else
                  "reshard" if g.post_forward_mesh_info is g.mesh_info else
                  f"to {g.post_forward_mesh_info.shard_mesh_size}" for g in s._fsdp_param_groups])
                for s in (p.state for p in fsdp_states(model))]

    out = {}
    # auto: the model's first forward (torch's lazy root set-up) runs inside the block.
    # int 2 (world 4): a no-grad forward first leaves the units sharded to groups of 2.
    for name, reshard, warm in (("auto", None, False), ("int", 2, True), ("false", False, True)):
        model, twin = _tiny_fsdp(mesh, reshard), _tiny_fsdp(mesh, reshard)
        with torch.no_grad():
            if warm:
                model(x), twin(x)
            else:
                twin(x)  # the twin's lazy init runs outside any block
            with gathered_for_generation(model):
                for _ in range(rank + 1):  # a different number of forwards per rank
                    model(x)
        case = {"model": kinds(model), "twin": kinds(twin)}
        losses = []
        for m in (model, twin):
            loss = m(x).square().sum()
            loss.backward()
            losses.append(loss.detach())
        case["loss_equal"] = torch.equal(*losses)
        case["grads_equal"] = all(torch.equal(a.grad.to_local(), b.grad.to_local())
                                  for a, b in zip(model.parameters(), twin.parameters(), strict=True))
        out[name] = case
    teardown()
    return out


def test_reshard_settings_restored_exactly():
    """Automatic root (lazily set to keep), explicit int and False: as they were, and
    training afterwards equals a model that never entered the block."""
    got = run_ranks(_settings_body, 4, timeout=120)
    for r in got:
        for name, case in r.items():
            assert case["model"] == case["twin"], name
            assert case["loss_equal"] and case["grads_equal"], name
        root, *units = r["auto"]["model"]
        assert root == (True, True, ["keep"]) and all(u == (True, False, ["reshard"]) for u in units)
        assert all(u[2] == ["to 2"] for u in r["int"]["model"][1:])
        assert all(u[2] == ["keep"] for u in r["false"]["model"][1:])


# ---------------------------------------------------------------- user errors


@pytest.mark.parametrize("edit,message", [
    (lambda b: b.tensors.pop("prompt_mask"), "no tensor 'prompt_mask'"),
    (lambda b: b.tensors.update(prompt_mask=b.tensors["prompt_mask"].flip(-1)), "LEFT-padded"),
    (lambda b: b.tensors["prompt_mask"][1].zero_(), "no real token"),
    (lambda b: b.meta.pop("seed"), "meta['seed']"),
], ids=["missing_mask", "right_padded", "empty_prompt", "no_seed"])
def test_bad_prompts_raise_before_any_collective(edit, message):
    """Raised on entry, before the all-gather: a plain module and no process group suffice."""
    from shardwise.config.schema import RolloutConfig
    from shardwise.distributed.runtime import Runtime
    from shardwise.engine.generate import HFGenerator

    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    rollout = HFGenerator(torch.nn.Linear(1, 1), RolloutConfig(), runtime, pad_id=PAD, eos_id=EOS)
    prompts = prompts_batch([2, 3], seed=1)
    edit(prompts)
    with pytest.raises(ValueError, match=re.escape(message)):
        rollout.generate_sequences(prompts)


def test_private_state_reads_a_torch_2_11_state_too():
    """torch 2.11's FSDPState has one `_fsdp_param_group` (None before lazy init) and no
    `_fsdp_param_groups`; the accessor reads both shapes (the installed torch's is covered by
    the tests above). A stand-in object with exactly the 2.11 attributes."""
    from shardwise.fsdp.gather import _PrivateState

    class Group:
        post_forward_mesh_info = "own"

    class State211:
        def __init__(self, group):
            self._fsdp_param_group = group
            self._is_root = None
            self._auto_reshard_after_forward = True

    class Module:
        def __init__(self, state):
            self.state = state

        def _get_fsdp_state(self):
            return self.state

    group = Group()
    s = _PrivateState(Module(State211(group)))
    assert s.param_groups == [group] and s.post_forward() == ["own"] and s.auto is True and s.is_root is None
    s.set_post_forward([None])
    assert group.post_forward_mesh_info is None
    assert _PrivateState(Module(State211(None))).param_groups == []
