"""The chunked LM head and loss (``train.chunked_loss``) compute the plain full-logits
numbers without ever forming the (tokens x vocab) logits.

- unsharded, fp32: the SFT loss sum and its gradients; log-probs and entropy at
  temperature 0.7 (left and right padding) and the gradients through them; chunk sizes 1,
  7 (divides no token count here) and larger than the batch; untied (Qwen3) and tied
  (Llama) heads; the head's forward comes back after the call, also after an error;
- memory: a dispatch-mode meter sees every tensor any op creates, in forward and in
  backward (recomputation included); with chunking none has more than chunk_tokens rows of
  vocab values, without it one has all the tokens' (so the test fails if chunking is off);
- models that post-process their logits (Gemma 2 softcapping) are refused;
- 2 gloo ranks, named configurations: FSDP training with the chunked loss equals the same
  run with the plain loss (head in the root unit, tied, its own unit, bf16, a fp32 head in
  a bf16 model whose output FSDP casts, Ulysses sp=2), and the TrainEngine's first step
  never forms the full logits;
- the RL actor (scoring and PPO update), the reference worker and `InferEngine.log_probs`
  honour the setting.

Tolerances (fp32). The chunked path runs, per token, the arithmetic of the plain path
(linear, fp32 upcast, logsumexp and gather, softmax and entr); what differs is (i) the
order of sums over tokens (the loss sum, and each head-weight gradient summed per chunk
and then over chunks), (ii) the GEMM's row blocking (a one-row chunk runs a matrix-vector
kernel), and (iii) for the SFT loss, cross_entropy's log_softmax + nll against
logsumexp - gather. Each is a few fp32 roundings:

- loss sums: the terms are positive, so reordering N of them moves the sum by at most
  N * eps * sum = 48 * 6e-8 = 3e-6 relative (48 tokens), and (iii) by a few ulps per term;
  we assert 1e-5 relative (observed <= 7e-8);
- log-probs and entropies: per-row values, |value| <= ~5: a few ulps of 5 (4.8e-7 each);
  we assert 1e-5 absolute (observed <= 9.6e-7 under the AVX512, AVX2 and default
  kernels);
- gradients: sums over the 48 tokens, then through the backbone's matmuls: a rounding
  of a few ulps of the largest terms. An element that cancels to near zero has a large
  relative error but a small absolute one, so each tensor is compared to its own scale:
  |diff| <= 1e-5 * max|grad| + 1e-5 * |grad| (observed <= 8.3e-7 * max|grad|).
- FSDP runs: as in test_parity.py, losses 1e-5 relative and parameters by
  `assert_trained_params_close` (argued in tests/dist/common.py).

bf16 rows: both runs compute in bf16, with differences of bf16 rounding (2^-9 = 2e-3
relative): the chunked run adds the head-weight gradient over chunks in bf16 (autograd
sums the chunks' gradients in the weight's dtype), and with a fp32 head in a bf16 model
the plain run scores bf16-cast logits where the chunked one uses the head's fp32 values.
A logit rounded by 2^-9 of |logit| (<= ~1 here) moves its token's loss (~log 80 = 4.4)
by <= 5e-4 relative, with random signs over the ~40 loss tokens of a step: losses are
asserted within 1e-3 relative (observed <= 2.1e-5; test_parity.py's bf16-vs-fp32 rows
need 2e-2). Parameters: AdamW moves a parameter by about lr per step whatever its
gradient's size, so a tiny gradient whose sign rounding flips moves it by up to
2 * lr * steps = 6e-3 (observed 3.8e-3 with the fp32 head): every element within that,
and each run must have moved the parameters.
"""

from __future__ import annotations

import pytest
import torch
from dist.common import (
    FP32,
    TINY_LLAMA,
    TINY_QWEN3,
    assert_trained_params_close,
    full_params,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
    stack,
)
from dist.launcher import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.errors import ConfigError

VOCAB = 80
"""A vocabulary size no other dimension of the tiny models has (hidden 32, MLP 64, heads
8 x 4), so the meter can tell logits-shaped tensors apart."""
QWEN3 = TINY_QWEN3.replace("vocab_size: 64", f"vocab_size: {VOCAB}")
LLAMA_TIED = TINY_LLAMA.replace("vocab_size: 64", f"vocab_size: {VOCAB}")
GEMMA2_SOFTCAP = (f"model.config={{model_type: gemma2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
                  f"num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, vocab_size: {VOCAB}, "
                  "max_position_embeddings: 64, final_logit_softcapping: 30.0}")
CHUNKS = [1, 7, 1000]
"""One token, a size dividing none of the token counts here, more than the batch."""


class VocabMeter(TorchDispatchMode):
    """Records the most rows (numel / vocab) of any floating tensor with last dimension
    `vocab` that an op creates (views excluded: they allocate nothing), in forward and in
    backward alike, and its bytes."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.rows = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_flatten(out)[0]:
                if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2
                        and t.shape[-1] == self.vocab):
                    self.rows = max(self.rows, t.numel() // self.vocab)
                    self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _model(*overrides: str):
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    cfg = load_config(None, [*overrides, *FP32])
    return build_full_model(cfg.model, cfg.run.seed)


def _sft_batch() -> dict[str, torch.Tensor]:
    """4 rows x 12 tokens, prompts of different lengths (label -100)."""
    return stack(make_global_batch(0, 4))


def _rl_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask (4, 12): left padding, right padding, both, none."""
    ids = _sft_batch()["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -4:] = 0
    mask[2, :2] = 0
    mask[2, -2:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _grads(model) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        scale = float(w.abs().max())
        assert scale > 0, k
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-5 * scale, msg=k)


# -- unsharded --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", ["qwen3_untied", "llama_tied"])
def test_lm_loss_and_grads_equal_plain(name, chunk):
    from shardwise.engine.train import lm_loss_sum

    model = _model(QWEN3 if name == "qwen3_untied" else LLAMA_TIED)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name == "llama_tied")
    batch = _sft_batch()
    plain = lm_loss_sum(model, batch)
    plain.backward()
    want = _grads(model)
    chunked = lm_loss_sum(model, batch, chunk_tokens=chunk)
    chunked.backward()
    assert chunked.dtype == torch.float32 and chunked.dim() == 0
    torch.testing.assert_close(chunked.detach(), plain.detach(), rtol=1e-5, atol=0)
    _assert_grads_close(_grads(model), want)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", ["qwen3_untied", "llama_tied"])
def test_log_probs_entropy_and_grads_equal_plain(name, chunk):
    from shardwise.engine.infer import compute_log_probs

    model = _model(QWEN3 if name == "qwen3_untied" else LLAMA_TIED)
    ids, mask = _rl_batch()
    g = torch.Generator().manual_seed(3)
    w_lp, w_ent = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)

    def run(chunk_tokens):
        out = compute_log_probs(model, ids, mask, with_entropy=True, temperature=0.7, chunk_tokens=chunk_tokens)
        (out["log_probs"] * w_lp + out["entropy"] * w_ent).sum().backward()
        return {k: v.detach() for k, v in out.items()}, _grads(model)

    want, want_grads = run(None)
    got, got_grads = run(chunk)
    for k in ("log_probs", "entropy"):
        assert got[k].shape == ids.shape and got[k].dtype == torch.float32
        assert (got[k][:, 0] == 0).all()
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    assert float(want["entropy"][:, 1:].min()) > 0.5  # a real distribution, not a degenerate one
    _assert_grads_close(got_grads, want_grads)
    # without grad (the infer engine's mode): the same values
    with torch.no_grad():
        again = compute_log_probs(model, ids, mask, with_entropy=True, temperature=0.7, chunk_tokens=chunk)
    assert all(torch.equal(again[k], got[k]) for k in got)


def test_head_forward_is_restored_also_after_an_error():
    from shardwise.models.chunked_head import per_token_log_probs

    model = _model(QWEN3)
    ids, mask = _rl_batch()
    head = model.get_output_embeddings()
    per_token_log_probs(model, ids, 5, input_ids=ids, attention_mask=mask)
    assert "forward" not in head.__dict__
    compiled_like = head.forward  # a forward set on the instance (as apply_compile does) comes back
    head.forward = compiled_like
    with pytest.raises(ValueError, match="slices its tokens"):
        per_token_log_probs(model, ids, 5, input_ids=ids, attention_mask=mask, logits_to_keep=1)
    assert head.__dict__["forward"] is compiled_like
    assert model(input_ids=ids, attention_mask=mask).logits.shape == (*ids.shape, VOCAB)


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_paths_never_form_the_full_logits(chunk):
    """Forward and backward (with its recomputation): at most `chunk` rows of vocab values
    at once, against all 48 tokens' rows on the plain path."""
    from shardwise.engine.infer import compute_log_probs
    from shardwise.engine.train import lm_loss_sum

    model = _model(QWEN3)
    batch = _sft_batch()
    ids, mask = _rl_batch()
    tokens = ids.numel()

    def rows(fn, chunk_tokens) -> tuple[int, int, int]:
        fwd, bwd = VocabMeter(VOCAB), VocabMeter(VOCAB)
        with fwd:
            loss = fn(chunk_tokens)
        with bwd:
            loss.backward()
        model.zero_grad(set_to_none=True)
        return fwd.rows, bwd.rows, max(fwd.bytes, bwd.bytes)

    def sft(c):
        return lm_loss_sum(model, batch, chunk_tokens=c)

    def rl(c):
        out = compute_log_probs(model, ids, mask, with_entropy=True, temperature=0.7, chunk_tokens=c)
        return out["log_probs"].sum() + out["entropy"].sum()

    for fn in (sft, rl):
        fwd, bwd, peak = rows(fn, None)
        assert fwd >= tokens - 4 and bwd >= tokens - 4, (fn.__name__, fwd, bwd)  # (B, T or T-1, V)
        fwd, bwd, peak = rows(fn, chunk)
        assert 0 < fwd <= chunk and 0 < bwd <= chunk, (fn.__name__, fwd, bwd)
        assert peak <= chunk * VOCAB * 4, (fn.__name__, peak)


def test_models_that_post_process_logits_are_refused():
    from shardwise.models.chunked_head import check_model, per_token_log_probs

    model = _model(GEMMA2_SOFTCAP, "model.attn_implementation=eager")
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0") as e:
        check_model(model)
    assert "train.chunked_loss.enabled" in str(e.value)
    # without the config check: the call itself sees the forward change the head's result
    ids, mask = _rl_batch()
    with pytest.raises(ConfigError, match="post-processes its output head's result"):
        per_token_log_probs(model, ids, 7, input_ids=ids, attention_mask=mask)
    check_model(_model(QWEN3))
    check_model(_model(LLAMA_TIED))


# -- 2 gloo ranks ------------------------------------------------------------------------------

STEPS = 3
GLOBAL_BATCH = 8
LR = 1e-3
CHUNK = 5
BASE = [f"train.optimizer.lr={LR}", "train.scheduler.warmup_steps=1", f"train.max_steps={STEPS}",
        "train.grad_clip=1.0"]

# name: (world, micro_batch_size, model, overrides, precision)
CASES = {
    "fsdp_root_head": (2, 2, QWEN3, [], "fp32"),
    "fsdp_tied": (2, 2, LLAMA_TIED, [], "fp32"),
    "lm_head_unit": (2, 2, QWEN3, ["fsdp.wrap.lm_head=true", "fsdp.wrap.embeddings=true"], "fp32"),
    "lm_head_unit_bf16": (2, 2, QWEN3, ["fsdp.wrap.lm_head=true"], "bf16"),
    "fp32_head_output_cast_bf16": (2, 2, QWEN3, ["fsdp.module_precision={lm_head: fp32}"], "bf16"),
    "ulysses_sp2": (2, 2, QWEN3, ["parallel.ulysses_size=2"], "fp32"),
    "ulysses_sp2_tied": (2, 2, LLAMA_TIED, ["parallel.ulysses_size=2"], "fp32"),
}


def plain_and_chunked(rank: int, world: int, overrides: list[str], micro: int) -> dict:
    """Body of each rank: the same training twice, with the plain loss and with
    train.chunked_loss; the first step of each under the vocab meter."""
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    out = {}
    for name, extra in (("plain", []), ("chunked", ["train.chunked_loss.enabled=true",
                                                   f"train.chunked_loss.chunk_tokens={CHUNK}"])):
        engine = TrainEngine(load_config(None, [*overrides, *extra]), runtime)
        init = full_params(engine.model)
        losses, meter = [], VocabMeter(VOCAB)
        for step in range(STEPS):
            rows = make_global_batch(step, GLOBAL_BATCH)
            mbs = micro_batches_of(rows, engine.dp_rank, engine.dp_size, micro)
            if step == 0:
                with meter:
                    losses.append(engine.train_step(mbs, loss_tokens(rows)).loss)
            else:
                losses.append(engine.train_step(mbs, loss_tokens(rows)).loss)
        params = full_params(engine.model)
        out[name] = {"losses": losses, "rows": meter.rows, "init": init if rank == 0 else None,
                     "params": params if rank == 0 else None}
    teardown()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_chunked_loss_equals_plain(name):
    world, micro, model, overrides, precision = CASES[name]
    prec = FP32 if precision == "fp32" else ["fsdp.mixed_precision.param_dtype=bf16"]
    ranks = run_ranks(plain_and_chunked, world, [model, *prec, *BASE, *overrides], micro, timeout=240)
    plain, chunked = ranks[0]["plain"], ranks[0]["chunked"]
    for r in ranks[1:]:
        assert r["chunked"]["losses"] == chunked["losses"]
    # the plain step formed a micro-batch's (or its sequence slice's) full logits; the
    # chunked one at most CHUNK rows
    tokens = micro * 12 // (2 if "parallel.ulysses_size=2" in overrides else 1)
    assert all(r["plain"]["rows"] >= tokens - micro for r in ranks), [r["plain"]["rows"] for r in ranks]
    assert all(0 < r["chunked"]["rows"] <= CHUNK for r in ranks), [r["chunked"]["rows"] for r in ranks]
    got = torch.tensor(chunked["losses"], dtype=torch.float64)
    want = torch.tensor(plain["losses"], dtype=torch.float64)
    init = plain["init"]
    assert all(torch.equal(chunked["init"][k], init[k]) for k in init)
    if precision == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert_trained_params_close(chunked["params"], plain["params"], init, LR, STEPS)
    else:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
        for k in init:
            torch.testing.assert_close(chunked["params"][k], plain["params"][k], rtol=0, atol=2 * LR * STEPS, msg=k)
        for run in (plain, chunked):
            moved = sum(float((run["params"][k] - init[k]).abs().max()) > 1e-4 for k in init)
            assert moved >= len(init) - 2


# -- RL ----------------------------------------------------------------------------------------

RL_BASE = [QWEN3, *FP32, "train.optimizer.lr=1e-2", "train.scheduler.name=constant",
           "train.scheduler.warmup_steps=0", "train.micro_batch_size=2", "train.max_steps=2",
           "rl.actor.ppo_epochs=1", "rl.actor.ppo_mini_batches=1", "rl.actor.entropy_coef=0.01",
           "rl.actor.kl_loss.enabled=true", "rl.actor.kl_loss.type=k3", "rl.actor.kl_loss.coef=0.1",
           "rl.rollout.temperature=0.7"]


def _rollout(rank: int):
    """This rank's 4 rows of a rollout batch: left-padded prompts (5), responses of 2-5 tokens."""
    from shardwise.data.batch import Batch
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(11 + rank)
    rows, prompt, resp_len = 4, 5, 6
    ids = torch.randint(3, 64, (rows, prompt + resp_len), generator=g)
    attn = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    for r in range(rows):
        attn[r, :r % 3] = 0
        n = 2 + r
        resp[r, prompt:prompt + n] = 1
        attn[r, prompt + n:] = 0
    ids = ids.masked_fill(attn == 0, 0)
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": resp, "advantages": torch.randn(ids.shape, generator=g) * resp})


def actor_plain_and_chunked(rank: int, world: int) -> dict:
    """Body of each rank: score, reference-score (also through `InferEngine.log_probs`) and
    update the actor, plain and chunked."""
    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.actor import ActorWorker, ReferenceWorker

    runtime = init_distributed(timeout_s=60)
    out = {}
    for name, extra in (("plain", []), ("chunked", ["train.chunked_loss.enabled=true",
                                                   f"train.chunked_loss.chunk_tokens={CHUNK}"])):
        cfg = load_config(None, [*RL_BASE, *extra])
        actor, reference = ActorWorker(cfg, runtime), ReferenceWorker(cfg, runtime)
        batch = _rollout(rank)
        meters = {k: VocabMeter(VOCAB) for k in ("score", "ref", "infer", "update")}
        with meters["score"]:
            scored = actor.compute_log_prob(batch)
        with meters["ref"]:
            ref = reference.compute_ref_log_prob(batch)
        t = batch.tensors
        with meters["infer"]:
            infer = reference.engine.log_probs(t["input_ids"], t["attention_mask"], t["response_mask"],
                                               micro_batch_size=2, with_entropy=True)
        g = torch.Generator().manual_seed(5 + rank)
        noise = 0.2 * torch.randn(batch.tensors["input_ids"].shape, generator=g) * batch.tensors["response_mask"]
        batch = batch.union(Batch.from_dict({"old_log_probs": scored.tensors["old_log_probs"] + noise,
                                             "ref_log_probs": ref.tensors["ref_log_probs"] - noise}))
        init = full_params(actor.model)
        with meters["update"]:
            metrics = actor.update_actor(batch)
        params = full_params(actor.model)  # collective
        out[name] = {"old_log_probs": scored.tensors["old_log_probs"], "entropy": scored.tensors["entropy"],
                     "ref_log_probs": ref.tensors["ref_log_probs"], "infer_log_probs": infer["log_probs"],
                     "infer_entropy": infer["entropy"], "metrics": metrics,
                     "rows": {k: m.rows for k, m in meters.items()},
                     "init": init if rank == 0 else None, "params": params if rank == 0 else None}
    teardown()
    return out


def test_actor_and_reference_honour_chunked_loss():
    ranks = run_ranks(actor_plain_and_chunked, 2, timeout=240)
    for r in ranks:
        plain, chunked = r["plain"], r["chunked"]
        # the plain path forms the logits of a whole micro-batch: 2 rows packed into one
        # (rl.packing's default), their 14 or 17 real tokens (22: InferEngine.log_probs'
        # padded rows, 2 x 11 tokens)
        assert min(plain["rows"].values()) >= 14 > CHUNK
        assert all(0 < v <= CHUNK for v in chunked["rows"].values()), chunked["rows"]
        for k in ("old_log_probs", "entropy", "ref_log_probs", "infer_log_probs", "infer_entropy"):
            torch.testing.assert_close(chunked[k], plain[k], rtol=0, atol=1e-5, msg=k)
        assert float(plain["entropy"].abs().sum()) > 0
        for k in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm"):
            assert chunked["metrics"][k] == pytest.approx(plain["metrics"][k], rel=1e-5, abs=1e-7), k
    plain, chunked = ranks[0]["plain"], ranks[0]["chunked"]
    assert_trained_params_close(chunked["params"], plain["params"], plain["init"], 1e-2, 1)
