"""InferEngine and compute_log_probs: a 2-rank sharded model scores sequences exactly as the
unsharded HF model does, under the documented alignment and padding convention.

One 2-process run (module fixture) computes everything on the sharded side; the
assertions run here, against a plain `build_full_model` reference (same seed, fp32).
Tolerance 1e-5: fp32 on both sides, the same kernels; the only differences are the
reduction order inside logsumexp vs log_softmax and fp32 vs the reference's fp64 softmax.
"""

from __future__ import annotations

import pytest
import torch
from dist.common import FP32, TINY_QWEN3
from dist.launcher import run_ranks

# Attention dropout on: a model left in train mode would not match the eval-mode reference.
OVERRIDES = [TINY_QWEN3.replace("tie_word_embeddings: false}",
                                "tie_word_embeddings: false, attention_dropout: 0.5}"), *FP32]
assert OVERRIDES[0] != TINY_QWEN3
SEQ = 12
PAD = 0
# (left padding, prompt length, response length); the rest of the row is right padding.
LAYOUT = [(0, 3, 9), (2, 3, 5), (4, 2, 6), (0, 5, 4), (1, 1, 8), (3, 4, 2)]
TOL = 1e-5


def make_batch() -> dict[str, torch.Tensor]:
    """Rows ``[pad* prompt response pad*]``: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(7)
    ids = torch.full((len(LAYOUT), SEQ), PAD, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, (left, prompt, response) in enumerate(LAYOUT):
        n = prompt + response
        assert left + n <= SEQ
        ids[i, left:left + n] = torch.randint(1, 64, (n,), generator=g)
        attn[i, left:left + n] = 1
        resp[i, left + prompt:left + n] = 1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}


def manual_positions(attn: torch.Tensor) -> torch.Tensor:
    """Position ids written out by hand: 0, 1, ... over each row's real tokens, 0 on padding."""
    pos = torch.zeros_like(attn)
    for i in range(attn.shape[0]):
        real = attn[i].nonzero().flatten()
        pos[i, real] = torch.arange(len(real))
    return pos


# ---------------------------------------------------------------- rank body


def _infer_body(rank: int, world: int, overrides: list[str]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.infer import InferEngine

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    engine = InferEngine(cfg, runtime)
    b = make_batch()
    half = len(LAYOUT) // world
    mine = {k: v[rank * half:(rank + 1) * half] for k, v in b.items()}
    out: dict = {"training": engine.model.training}
    out["logits"] = engine.logits(mine["input_ids"], mine["attention_mask"])
    whole = engine.log_probs(**mine, with_entropy=True)
    out["log_probs"], out["entropy"] = whole["log_probs"], whole["entropy"]
    micro = engine.log_probs(**mine, micro_batch_size=2, with_entropy=True)  # 3 rows: chunks 2 + 1
    out["micro_log_probs"], out["micro_entropy"] = micro["log_probs"], micro["entropy"]
    out["no_entropy_keys"] = sorted(engine.log_probs(**mine))

    # Uneven rows: rank 0 has 5 rows, rank 1 one; with micro 1 rank 0 runs 5 forwards and
    # rank 1 must run 4 throw-away ones or the all-gathers would hang.
    cut = 5
    rows = slice(0, cut) if rank == 0 else slice(cut, None)
    uneven = {k: v[rows] for k, v in b.items()}
    out["uneven_log_probs"] = engine.log_probs(**uneven, micro_batch_size=1)["log_probs"]
    # No rows at all on rank 1, with and without micro-batching.
    rows = slice(0, len(LAYOUT)) if rank == 0 else slice(0, 0)
    empty_or_all = {k: v[rows] for k, v in b.items()}
    out["zero_rows_log_probs"] = engine.log_probs(**empty_or_all, micro_batch_size=2)["log_probs"]
    out["zero_rows_logits"] = engine.logits(empty_or_all["input_ids"], empty_or_all["attention_mask"])

    # A user mistake is raised before any collective, on every rank.
    bad = dict(mine, response_mask=mine["response_mask"].clone())
    bad["response_mask"][:, 0] = 1
    try:
        engine.log_probs(**bad)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    teardown()
    return out


@pytest.fixture(scope="module")
def sharded() -> list[dict]:
    return run_ranks(_infer_body, 2, OVERRIDES, timeout=180)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The unsharded HF model on the whole batch, in float64 arithmetic from its logits."""
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    cfg = load_config(None, OVERRIDES)
    model = build_full_model(cfg.model, cfg.run.seed).eval()
    b = make_batch()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=manual_positions(b["attention_mask"]), use_cache=False).logits
    logp_all = torch.log_softmax(logits.double(), -1)
    probs = torch.softmax(logits.double(), -1)
    logp = torch.zeros(b["input_ids"].shape, dtype=torch.float64)
    ent = torch.zeros_like(logp)
    # Written out step by step: token t is scored by the distribution at position t - 1.
    for t in range(1, SEQ):
        logp[:, t] = logp_all[:, t - 1].gather(-1, b["input_ids"][:, t:t + 1]).squeeze(-1)
        ent[:, t] = -(probs[:, t - 1] * logp_all[:, t - 1]).sum(-1)
    m = b["response_mask"].bool()
    return {"model": model, "logits": logits, "log_probs": torch.where(m, logp, 0.0),
            "entropy": torch.where(m, ent, 0.0), "batch": b}


def _cat(sharded: list[dict], key: str) -> torch.Tensor:
    return torch.cat([r[key] for r in sharded])


def test_engine_is_in_eval_mode(sharded):
    assert all(r["training"] is False for r in sharded)


def test_logits_equal_unsharded_model(sharded, reference):
    got = _cat(sharded, "logits")
    assert got.dtype == torch.float32 and got.shape == reference["logits"].shape
    real = reference["batch"]["attention_mask"].bool()
    torch.testing.assert_close(got[real], reference["logits"][real], atol=TOL, rtol=0)


def test_log_probs_equal_unsharded_model(sharded, reference):
    got = _cat(sharded, "log_probs")
    assert got.dtype == torch.float32 and got.shape == (len(LAYOUT), SEQ)
    torch.testing.assert_close(got.double(), reference["log_probs"], atol=TOL, rtol=0)
    assert got[reference["batch"]["response_mask"].bool()].lt(0).all()  # real log-probs, not zeros


def test_entropy_equals_softmax_entropy(sharded, reference):
    got = _cat(sharded, "entropy")
    torch.testing.assert_close(got.double(), reference["entropy"], atol=TOL, rtol=0)
    assert got[reference["batch"]["response_mask"].bool()].gt(0).all()
    assert sharded[0]["no_entropy_keys"] == ["log_probs"]


def test_masked_positions_are_exactly_zero(sharded, reference):
    off = ~reference["batch"]["response_mask"].bool()
    assert off.any()
    for key in ("log_probs", "entropy", "micro_log_probs", "micro_entropy"):
        assert torch.equal(_cat(sharded, key)[off], torch.zeros(int(off.sum())))
    assert torch.equal(_cat(sharded, "log_probs")[:, 0], torch.zeros(len(LAYOUT)))


def test_micro_batched_equals_one_pass(sharded):
    # Rows are independent in every op of the model, so micro-batching is bitwise equal here.
    assert torch.equal(_cat(sharded, "micro_log_probs"), _cat(sharded, "log_probs"))
    assert torch.equal(_cat(sharded, "micro_entropy"), _cat(sharded, "entropy"))


def test_uneven_and_empty_rank_shares(sharded):
    whole = _cat(sharded, "log_probs")
    torch.testing.assert_close(_cat(sharded, "uneven_log_probs"), whole, atol=1e-6, rtol=0)
    assert sharded[1]["zero_rows_log_probs"].shape == (0, SEQ)
    assert sharded[1]["zero_rows_logits"].shape == (0, SEQ, 64)
    torch.testing.assert_close(sharded[0]["zero_rows_log_probs"], whole, atol=1e-6, rtol=0)


def test_padding_does_not_change_log_probs(sharded, reference):
    """The convention's promise: a response token's log-prob is the one of the unpadded
    sequence, wherever the left and right padding put it."""
    got = _cat(sharded, "log_probs")
    b = reference["batch"]
    for i, (left, prompt, response) in enumerate(LAYOUT):
        ids = b["input_ids"][i, left:left + prompt + response].unsqueeze(0)
        with torch.no_grad():
            logits = reference["model"](input_ids=ids, use_cache=False).logits[0].double()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        torch.testing.assert_close(got[i, left + prompt:left + prompt + response].double(),
                                   logp[prompt - 1:], atol=TOL, rtol=0)


def test_bad_response_mask_is_a_user_error(sharded):
    for r in sharded:
        assert r["error"] is not None and "position 0" in r["error"]


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Independent formulation: log_softmax then gather. (batch, seq, vocab), (batch, seq) -> (batch, seq)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_compute_log_probs_with_grad_matches_token_log_probs():
    """The function the RL actor calls on the TrainEngine's model: differentiable, and the
    same numbers as an independent log_softmax + gather (`token_log_probs` above) under the documented alignment."""
    from shardwise.config import load_config
    from shardwise.engine.infer import compute_log_probs
    from shardwise.models.loading import build_full_model

    cfg = load_config(None, OVERRIDES)
    model = build_full_model(cfg.model, cfg.run.seed).eval()
    b = make_batch()
    out = compute_log_probs(model, b["input_ids"], b["attention_mask"], with_entropy=True)
    assert out["log_probs"].requires_grad and out["entropy"].requires_grad
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=manual_positions(b["attention_mask"]), use_cache=False).logits
    expected = token_log_probs(logits[:, :-1], b["input_ids"][:, 1:])
    real = b["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(out["log_probs"][:, 1:][real], expected[real], atol=1e-6, rtol=0)
    m = b["response_mask"].bool()
    (out["log_probs"][m].sum() + out["entropy"][m].sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
