"""Every policy loss of `shardwise.rl.algorithms` through the real actor worker (FSDP2 on 2
gloo ranks, tiny Qwen3), data parallel, and under Ulysses on packed token-budget
micro-batches with LoRA: for each name, on rows whose response masks have holes (multi-turn: a tool's
answer between the model's turns), updates of one mini-batch:

- at ratio 1 (the old log-probs are the policy's own): the reported ``actor/pg_loss``
  equals the loss's formula at ratio 1, computed here from the gathered rows and verl's
  aggregation (token-mean, seq-mean-token-mean, seq-mean-token-sum-norm, token-sum);
- off-policy (old log-probs moved by noise of std 1.5, far outside any clip; data
  parallel): PPO's clip-higher + dual clip (``vanilla``) equals its formula; every loss
  that clips reports it;
- as under ``rl.async`` staleness with ``rl.actor.off_policy.correction=decoupled`` (the
  proximal policy is the current one, the behaviour policy noisy): the loss at ratio 1
  times the truncated behaviour weights, and the ``off_policy/*`` metrics.

Each update moves the policy, its loss is finite and its metrics carry verl's keys.
Tolerance: the update's forward and `compute_log_prob`'s are the same model on the same
rows (ratio 1 up to fp32 rounding, ~1e-6); the losses are O(1) means: 1e-5 relative."""

from __future__ import annotations

import math

import pytest
import torch
from dist.common import FP32, TINY_QWEN3, worker_rows
from dist.launcher import run_ranks

ROWS, PROMPT, RESP = 8, 5, 8
CAP = 2.0  # rl.actor.off_policy.cap
BASE = [TINY_QWEN3, *FP32, "train.optimizer.lr=1e-2", "train.scheduler.name=constant",
        "train.scheduler.warmup_steps=0", "train.micro_batch_size=2", "train.max_steps=100",
        "rl.actor.ppo_epochs=1", "rl.actor.ppo_mini_batches=1", f"rl.rollout.max_new_tokens={RESP}"]
OPT = "rl.actor.policy_loss_options."

# name: its overrides (each loss's own options where it has them). Together: every loss
# verl registers, with clip-higher + dual clip on PPO and four aggregation modes.
LOSSES = {
    "vanilla": ["rl.actor.clip_ratio_low=0.2", "rl.actor.clip_ratio_high=0.28", "rl.actor.clip_ratio_c=3.0"],
    "ppo_clip": ["rl.actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "gspo": ["rl.actor.loss_agg_mode=seq-mean-token-mean", "rl.actor.clip_ratio_low=3e-4",
             "rl.actor.clip_ratio_high=4e-4"],
    "sapo": ["rl.actor.tau_pos=1.0", "rl.actor.tau_neg=1.05"],
    "gpg": ["rl.actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "cispo": ["rl.actor.clip_ratio_high=0.28"],
    "clip_cov": [f"{OPT}clip_cov_ratio=0.2", f"{OPT}clip_cov_lb=0.0", f"{OPT}clip_cov_ub=100.0"],
    "kl_cov": [f"{OPT}kl_cov_ratio=0.2", f"{OPT}ppo_kl_coef=1.0"],
    "geo_mean": ["rl.actor.clip_ratio=0.4"],
    "dppo_tv": ["rl.actor.clip_ratio_low=0.01", "rl.actor.clip_ratio_high=0.01"],
    "dppo_kl": ["rl.actor.clip_ratio_low=0.01", "rl.actor.clip_ratio_high=0.01"],
    "dro": [f"{OPT}dro_beta=0.1", "rl.actor.loss_agg_mode=token-sum"],
}
# the metrics each loss measures (verl's keys); the others it leaves at 0
MEASURES = {"gpg": (), "clip_cov": ("actor/pg_clipfrac", "actor/ppo_kl"), "kl_cov": ("actor/ppo_kl",),
            "dro": ("actor/ppo_kl",)}
ALL_PG = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
# losses whose clip (or drop / cut) acts on the off-policy batch: pg_clipfrac > 0
CLIPS = ("vanilla", "ppo_clip", "gspo", "cispo", "clip_cov", "geo_mean", "dppo_tv", "dppo_kl")


def rollout_batch():
    """Worker-layout rows (left-padded prompts, ragged responses) with holes in the response
    mask of every row of 4+ response tokens, GRPO-like advantages (one per row, both signs),
    and two noise draws (old log-probs off-policy, the behaviour policy's)."""
    from shardwise.data.batch import Batch
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(11)
    ids, attn, resp = worker_rows(g, ROWS, PROMPT, RESP)
    for r in range(ROWS):
        if int(resp[r].sum()) >= 4:
            resp[r, PROMPT + 1:PROMPT + 1 + r % 2 + 1] = 0  # a tool's answer: attended to, not trained on
    adv = torch.randn(ROWS, 1, generator=g) * resp
    noise = 1.5 * torch.randn(ROWS, PROMPT + RESP, generator=g)
    behave = 0.3 * torch.randn(ROWS, PROMPT + RESP, generator=g)
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": resp, "advantages": adv}), noise, behave


# The layouts the losses run in, one actor each in the same 2-rank process group: data
# parallel (each rank its 4 rows, padded micro-batches of 2 rows, no packing); Ulysses (one
# sequence-parallel group of both ranks, every rank all 8 rows) on packed micro-batches of
# at most 30 tokens (token budgets), the actor a LoRA adapter (r 4) on the frozen base.
SP = "ulysses+packing+budget+lora"
LAYOUTS = {"dp": ["rl.packing=false"], SP: ["parallel.ulysses_size=2", "rl.packing=true",
                                            "rl.actor.max_tokens_per_micro_batch=30",
                                            "rl.log_prob_max_tokens_per_micro_batch=30", "model.lora.enabled=true",
                                            "model.lora.r=4", "model.lora.alpha=8"]}
# the updates each layout runs (how the losses clip far off-policy does not depend on it)
KINDS = {"dp": ("ratio1", "off_policy", "decoupled"), SP: ("ratio1", "decoupled")}


def body(rank: int, world: int) -> dict:
    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.actor import ActorWorker

    runtime = init_distributed(timeout_s=60)
    result = {}
    for layout, setting in LAYOUTS.items():
        actor = ActorWorker(load_config(None, [*BASE, *setting]), runtime)
        batch, noise, behave = rollout_batch()
        rows = list(range(rank * ROWS // 2, (rank + 1) * ROWS // 2)) if layout == "dp" else list(range(ROWS))
        batch, noise, behave = batch[rows], noise[rows], behave[rows]
        mask = batch.tensors["response_mask"].bool()
        out = {name: {} for name in LOSSES}
        fresh = actor.compute_log_prob(batch).tensors["old_log_probs"]
        for name, overrides in LOSSES.items():
            for kind in KINDS[layout]:
                extra = ["rl.actor.off_policy.correction=decoupled",
                         f"rl.actor.off_policy.cap={CAP}"] if kind == "decoupled" else []
                actor.cfg = load_config(None, [*BASE, *setting, f"rl.actor.policy_loss={name}", *overrides, *extra])
                old = fresh if kind != "off_policy" else (fresh + noise).masked_fill(~mask, 0.0)
                given = {"old_log_probs": old}
                if kind == "decoupled":
                    given["rollout_log_probs"] = (fresh + behave).masked_fill(~mask, 0.0)
                metrics = actor.update_actor(batch.union(Batch.from_dict(given)))
                after = actor.compute_log_prob(batch).tensors["old_log_probs"]  # the next update's `fresh`
                out[name][kind] = {"metrics": metrics, "fresh": fresh, "old": old,
                                   "moved": float(((after - fresh) * mask).abs().max())}
                fresh = after
        result[layout] = {"runs": out, "mask": mask, "adv": batch.tensors["advantages"], "behave": behave,
                          "sp": actor.engine.sp_group is not None, "layout": actor.update_shape.layout,
                          "lora": any("lora_" in n for n, p in actor.model.named_parameters() if p.requires_grad)}
        del actor
    teardown()
    return result


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(body, 2, timeout=300)


def agg(x: torch.Tensor, m: torch.Tensor, mode: str) -> float:
    """verl's aggregation over all rows of both ranks, in float64."""
    x, m = x.double() * m, m.double()
    if mode == "token-mean":
        return float(x.sum() / m.sum())
    if mode == "token-sum":
        return float(x.sum())
    seqs = m.any(-1)
    per = x.sum(-1) / m.sum(-1).clamp(min=1) if mode == "seq-mean-token-mean" else x.sum(-1)
    loss = per[seqs].sum() / seqs.sum()
    return float(loss / RESP if mode == "seq-mean-token-sum-norm" else loss)


def at_ratio_one(name: str, logp: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, mode: str,
                 w: torch.Tensor) -> float:
    """Each loss's value where the ratio is 1, per token times the behaviour weights `w`
    (1: none), from the papers' formulas."""
    if name in ("vanilla", "ppo_clip", "gspo", "clip_cov", "kl_cov"):
        return agg(-adv * w, m, mode)  # -A * ratio; nothing clipped, cut or penalised at 1
    if name == "sapo":  # -A * (4 / tau) * sigmoid(0), seq-mean-token-mean always
        tau = torch.where(adv > 0, 1.0, 1.05)
        return agg(-adv * 2.0 / tau * w, m, "seq-mean-token-mean")
    if name == "geo_mean":  # per row -mean(A) * exp(0) * geometric mean of w, mean over rows
        n = m.sum(-1).double()
        return float((-(adv * m).sum(-1) / n * torch.exp((torch.log(w) * m).sum(-1) / n)).mean())
    return agg(-adv * logp * w, m, mode)  # gpg, cispo, dppo_*, dro: REINFORCE at ratio 1


@pytest.mark.parametrize("layout,kind", [(layout, kind) for layout in LAYOUTS for kind in KINDS[layout]])
def test_every_policy_loss_updates_the_real_actor(ranks, layout, kind):
    from shardwise.config import load_config

    per_rank = [r[layout] for r in ranks]
    assert all(r["sp"] == (layout != "dp") and r["layout"] == ("padded" if layout == "dp" else "packed")
               and r["lora"] == (layout == SP) for r in per_rank)
    rows = per_rank if layout == "dp" else per_rank[:1]  # Ulysses: both ranks hold all the rows

    def cat(name, key):
        return torch.cat([r["runs"][name][kind][key] for r in rows]).double()

    m = torch.cat([r["mask"] for r in rows])
    adv = torch.cat([r["adv"] for r in rows]).double()
    behave = torch.cat([r["behave"] for r in rows]).double()
    assert all(0 < int(row.sum()) for row in m) and not torch.equal(m, m.cummax(-1).values)  # holes
    for name in LOSSES:
        cfg = load_config(None, [*BASE, f"rl.actor.policy_loss={name}", *LOSSES[name]])
        mode = cfg.rl.actor.loss_agg_mode
        got = per_rank[0]["runs"][name][kind]
        assert per_rank[1]["runs"][name][kind]["metrics"] == got["metrics"], name  # all-reduced alike
        metrics = got["metrics"]
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"]), (name, metrics)
        assert all(k in metrics for k in ALL_PG), (name, metrics)
        assert metrics["actor/grad_norm"] > 0 and got["moved"] > 1e-4, (name, kind)  # the loss moved the policy
        measured = MEASURES.get(name, ALL_PG)
        for k in set(ALL_PG) - set(measured):
            assert metrics[k] == 0.0, (name, k)
        logp = cat(name, "fresh")
        if kind in ("ratio1", "decoupled"):
            # decoupled: exp(prox - behave) truncated at the cap, 1 outside the mask
            w = torch.clamp(torch.exp(-behave), max=CAP) * m + ~m if kind == "decoupled" else torch.ones_like(adv)
            if name == "clip_cov":  # it cuts random tokens' terms even at ratio 1
                assert metrics["actor/pg_clipfrac"] > 0, (name, kind, metrics)
            else:
                want = at_ratio_one(name, logp, adv, m, mode, w)
                assert metrics["actor/pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), (name, kind)
                assert metrics["actor/pg_clipfrac"] == 0.0, (name, kind)
        if kind == "decoupled":
            assert metrics["off_policy/is_weight_mean"] == pytest.approx(
                agg(torch.exp(-behave), m, "token-mean"), rel=1e-5), name
            assert metrics["off_policy/truncated_share"] == pytest.approx(
                agg((torch.exp(-behave) > CAP).double(), m, "token-mean"), abs=1e-6), name
        if kind == "off_policy":
            if name in CLIPS:
                assert metrics["actor/pg_clipfrac"] > 0, (name, metrics)
            if "actor/ppo_kl" in measured:
                assert metrics["actor/ppo_kl"] != 0, (name, metrics)
    # PPO with clip-higher and dual clip off-policy, by its formula (Schulman 2017; Ye 2019; DAPO)
    if kind == "off_policy":
        got = per_rank[0]["runs"]["vanilla"]["off_policy"]["metrics"]
        r = torch.exp(cat("vanilla", "fresh") - cat("vanilla", "old"))
        pg = torch.maximum(-adv * r, -adv * torch.clamp(r, 0.8, 1.28))
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
        assert got["actor/pg_loss"] == pytest.approx(agg(pg, m, "token-mean"), rel=1e-5, abs=1e-6)
        assert got["actor/pg_clipfrac_lower"] > 0  # the dual clip acted
