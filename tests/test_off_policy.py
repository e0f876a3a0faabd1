"""``rl.actor.off_policy``: the tis and decoupled policy losses and their importance-weight
metrics against an independent plain-Python implementation on fixed inputs (tokens above
the cap, masked tokens holding NaN), the direction of their gradients, the config errors,
the actor's tis update (a cap that never binds is PPO against the behaviour log-probs) and
one `shardwise rl` run with decoupled that logs ``off_policy/*``. With correction none the
update is today's: tests/test_rl_actor.py and tests/test_rl_algorithms.py hold it."""

from __future__ import annotations

import math

import pytest
import torch
from dist.common import FP32, TINY_QWEN3, full_params, worker_rows
from dist.launcher import REPO_ROOT, run_ranks

from shardwise.cli import main
from shardwise.rl import algorithms as alg

NAN = float("nan")
CAP, CL, CH, CC = 2.0, 0.2, 0.28, 3.0
# Two rows of five tokens; row 1's last two tokens are masked (NaN there must not matter).
LOGP = [[-1.0, -0.5, -2.0, -0.1, -3.0], [-0.2, -1.5, -0.7, -0.4, -0.9]]
PROX = [[-1.1, -0.5, -1.0, -0.3, -2.0], [-0.2, -1.2, -0.9, NAN, NAN]]
BEHAVE = [[-2.5, -0.4, -1.1, -0.2, -0.5], [-0.3, -1.0, -2.0, NAN, NAN]]
ADV = [[1.0, -1.0, 2.0, -0.5, -1.5], [0.5, 1.5, -2.0, NAN, NAN]]
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def ref_token(ratio: float, adv: float, weight: float = 1.0) -> float:
    """One token's PPO term, written out: clip, dual clip, weight."""
    pg1 = -adv * ratio
    pg2 = -adv * min(max(ratio, 1 - CL), 1 + CH)
    term = max(pg1, pg2)
    if adv < 0:
        term = min(term, -adv * CC)
    return term * weight


def ref_loss(correction: str) -> tuple[list[list[float]], float]:
    """Per-token terms (0 where masked) and their token mean, by plain loops."""
    rows = []
    for lp, px, bh, ad, mk in zip(LOGP, PROX, BEHAVE, ADV, MASK):
        row = []
        for i in range(len(lp)):
            if not mk[i]:
                row.append(0.0)
            elif correction == "tis":
                row.append(ref_token(min(math.exp(lp[i] - bh[i]), CAP), ad[i]))
            else:  # decoupled
                row.append(ref_token(math.exp(lp[i] - px[i]), ad[i], min(math.exp(px[i] - bh[i]), CAP)))
        rows.append(row)
    count = sum(map(sum, MASK))
    return rows, sum(map(sum, rows)) / count


def ref_weights(start) -> tuple[float, float]:
    """(mean untruncated weight, share above the cap) over the masked tokens."""
    w = [math.exp(s - b) for srow, brow, mrow in zip(start, BEHAVE, MASK)
         for s, b, m in zip(srow, brow, mrow) if m]
    return sum(w) / len(w), sum(x > CAP for x in w) / len(w)


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_each_correction_equals_its_formula_written_out(correction):
    per_token, metrics = alg.off_policy_token_loss(correction, t(LOGP), t(ADV), t(MASK), behave_logp=t(BEHAVE),
                                                   prox_logp=t(PROX), cap=CAP, clip_low=CL, clip_high=CH,
                                                   clip_c=CC)
    want_rows, want_loss = ref_loss(correction)
    torch.testing.assert_close(per_token, t(want_rows), rtol=1e-12, atol=1e-12)
    assert float(alg.aggregate_loss(per_token, t(MASK), "token-mean")) == pytest.approx(want_loss, rel=1e-12)
    assert math.isfinite(metrics["clipfrac"]) and 0 < metrics["clipfrac"] < 1
    # the weights at the start of the update: tis, the policy's (here LOGP); decoupled, the proximal ones
    start = LOGP if correction == "tis" else PROX
    mean, share = ref_weights(start)
    got = alg.off_policy_weights(t(start), t(BEHAVE), t(MASK), CAP)
    assert float(got["off_policy/is_weight_mean"]) == pytest.approx(mean, rel=1e-6)
    assert float(got["off_policy/truncated_share"]) == pytest.approx(share, rel=1e-6)
    assert 0 < share < 1  # the inputs hold tokens on both sides of the cap
    # micro-batches with the global token count add up to the whole batch's figures
    parts = [alg.off_policy_weights(t(start)[i:i + 1], t(BEHAVE)[i:i + 1], t(MASK)[i:i + 1], CAP, global_tokens=8)
             for i in range(2)]
    assert float(sum(p["off_policy/is_weight_mean"] for p in parts)) == pytest.approx(mean, rel=1e-6)


def test_none_is_the_ppo_loss_against_the_old_log_probs():
    per_token, metrics = alg.off_policy_token_loss("none", t(LOGP), t(ADV), t(MASK), prox_logp=t(PROX),
                                                   clip_low=CL, clip_high=CH, clip_c=CC)
    loss, want = alg.policy_loss(t(PROX), t(LOGP), t(ADV), t(MASK), clip_low=CL, clip_high=CH, clip_c=CC)
    assert torch.equal(alg.aggregate_loss(per_token, t(MASK), "token-mean"), loss) and metrics == want
    with pytest.raises(ValueError, match="did you mean 'tis'"):
        alg.off_policy_token_loss("tiss", t(LOGP), t(ADV), t(MASK), behave_logp=t(BEHAVE))


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_the_gradient_raises_good_tokens_and_stops_at_the_cap(correction):
    logp = t(LOGP).requires_grad_(True)
    per_token, _ = alg.off_policy_token_loss(correction, logp, t(ADV), t(MASK), behave_logp=t(BEHAVE),
                                             prox_logp=t(PROX), cap=CAP, clip_low=CL, clip_high=CH, clip_c=CC)
    alg.aggregate_loss(per_token, t(MASK), "token-mean").backward()
    g = logp.grad
    assert torch.isfinite(g).all() and (g[1, 3:] == 0).all()  # masked tokens: no gradient, no NaN
    for (r, i), adv in zip([(0, 0), (0, 2), (1, 1)], [1.0, 2.0, 1.5]):
        lp, px, bh = LOGP[r][i], PROX[r][i], BEHAVE[r][i]
        ratio = min(math.exp(lp - bh), CAP) if correction == "tis" else math.exp(lp - px)
        w = 1.0 if correction == "tis" else min(math.exp(px - bh), CAP)
        truncated = correction == "tis" and math.exp(lp - bh) > CAP
        if truncated or ratio > 1 + CH:
            assert g[r, i] == 0, (r, i)  # past the cap or the clip: the token pushes no further
        else:
            # d/dlogp of -A * ratio * w / tokens: a descent step raises a positive-advantage token
            assert float(g[r, i]) == pytest.approx(-adv * ratio * w / 8, rel=1e-9), (r, i)
            assert g[r, i] < 0
    assert correction != "tis" or g[0, 0] == 0  # exp(-1 + 2.5) > cap: truncated


def test_config_errors(capsys, tmp_path):
    base = ["rl", str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"), "model.path=null", TINY_QWEN3,
            f"run.dir={tmp_path / 'run'}", "--nproc", "1"]
    for overrides, expect in [
        (["rl.actor.off_policy.correction=tis", "rl.rollout.tis_cap=3"],
         ["rl.rollout.tis_cap", "rl.actor.off_policy.correction=tis", "rl.actor.off_policy.cap=3"]),
        (["rl.actor.off_policy.cap=0.5"], ["rl.actor.off_policy.cap", ">= 1"]),
        (["rl.actor.off_policy.correction=decoupeld"], ["rl.actor.off_policy.correction", "decoupled"]),
    ]:
        assert main([*base, *overrides]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("shardwise: "), err
        assert all(x in err for x in expect), err
    assert not (tmp_path / "run").exists()


ROWS, PROMPT, RESP = 6, 4, 5
ACTOR = [TINY_QWEN3, *FP32, "train.optimizer.lr=1e-2", "train.scheduler.name=constant",
         "train.scheduler.warmup_steps=0", "train.micro_batch_size=2", "rl.rollout.temperature=0.7"]


def tis_body(rank: int, world: int) -> dict:
    """Two actors from the same initial weights, one update each on the same rows: tis with
    a cap that never binds (from a batch without old_log_probs, as the controller sends it)
    and none with old_log_probs := the behaviour log-probs."""
    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.infer import default_position_ids
    from shardwise.rl.workers.actor import ActorWorker

    runtime = init_distributed(timeout_s=60)
    g = torch.Generator().manual_seed(3)
    ids, attn, resp = worker_rows(g, ROWS, PROMPT, RESP)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                             "response_mask": resp, "advantages": torch.randn(ROWS, PROMPT + RESP, generator=g) * resp})
    noise = 0.3 * torch.randn(ROWS, PROMPT + RESP, generator=g)
    out = {}
    for name, extra in [("tis", ["rl.actor.off_policy.correction=tis", "rl.actor.off_policy.cap=1e6"]),
                        ("none", [])]:
        actor = ActorWorker(load_config(None, [*ACTOR, *extra]), runtime)
        start = actor.compute_log_prob(batch).tensors["old_log_probs"]
        behave = (start + noise).masked_fill(~resp.bool(), 0.0)
        rows = batch.union(Batch.from_dict({"rollout_log_probs": behave}))
        if name == "none":
            rows = rows.union(Batch.from_dict({"old_log_probs": behave}))
        out[name] = {"metrics": actor.update_actor(rows), "params": full_params(actor.model), "start": start,
                     "behave": behave}
    teardown()
    return {**out, "mask": resp.bool()}


def test_the_actors_tis_update_is_ppo_against_the_behaviour_policy():
    out = run_ranks(tis_body, 1, timeout=180)[0]
    tis, none = out["tis"], out["none"]
    for k, v in none["params"].items():
        torch.testing.assert_close(tis["params"][k], v, rtol=0, atol=1e-6, msg=k)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
        assert tis["metrics"][key] == pytest.approx(none["metrics"][key], rel=1e-5, abs=1e-7), key
    w = torch.exp(tis["start"] - tis["behave"])[out["mask"]]
    assert tis["metrics"]["off_policy/is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
    assert tis["metrics"]["off_policy/truncated_share"] == 0.0 and tis["metrics"]["actor/pg_clipfrac"] > 0
    assert not any(k.startswith("off_policy/") for k in none["metrics"])


def test_the_plot_gets_the_off_policy_panel_with_a_correction():
    """The decoupled run through the CLI (asynchronous, staleness 1) is in test_rl_async;
    here only that rl.png draws the weights when a correction is on."""
    from shardwise.config import load_config
    from shardwise.jobs.rl import plot_panels

    grpo = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")
    for correction, drawn in (("none", False), ("decoupled", True), ("tis", True)):
        cfg = load_config(grpo, [f"rl.actor.off_policy.correction={correction}"])
        names = [m for _, ms in plot_panels(cfg, on_policy_shortcut=False) for m in ms]
        assert ("off_policy/is_weight_mean" in names) == drawn, correction
