"""The actor's PPO update under 2 processes equals the 1-process update on the same rows,
for each loss aggregation mode, with mini-batches, 2 epochs, dual clip, entropy bonus and
the KL loss on; and the reference worker's log-probs equal the actor's before training."""

from __future__ import annotations

import pytest
import torch
from dist.common import FP32, TINY_QWEN3, full_params, worker_rows
from dist.launcher import run_ranks

ROWS, PROMPT, RESP = 8, 5, 6
BASE = [TINY_QWEN3, *FP32, "train.optimizer.lr=1e-2", "train.scheduler.name=constant",
        "train.scheduler.warmup_steps=0", "train.micro_batch_size=1", "train.max_steps=4",
        "rl.actor.ppo_epochs=2", "rl.actor.ppo_mini_batches=2", "rl.actor.entropy_coef=0.01",
        "rl.actor.kl_loss.enabled=true", "rl.actor.kl_loss.type=k3", "rl.actor.kl_loss.coef=0.1",
        "rl.actor.clip_ratio_low=0.1", "rl.actor.clip_ratio_high=0.3", "rl.rollout.temperature=0.7"]


def shares(split: tuple[int, ...]) -> list[list[int]]:
    """The rows of each rank: consecutive runs of the given sizes."""
    starts = [sum(split[:r]) for r in range(len(split))]
    return [list(range(s, s + n)) for s, n in zip(starts, split)]


def one_process_order(split: tuple[int, ...], n_mini: int = 2) -> list[int]:
    """Rank r's mini-batch i is the i-th of `n_mini` equal parts of its rows; global
    mini-batch i is those parts of all ranks together. The 1-process run sees the rows
    in that order, so its mini-batches are the same sets."""
    order = []
    for i in range(n_mini):
        for rows in shares(split):
            k = len(rows) // n_mini
            order += rows[i * k:(i + 1) * k]
    return order


def rollout_batch():
    """A hand-made rollout batch in the worker layout: left-padded prompts, responses of
    different lengths, advantages of both signs, old log-probs off-policy enough to clip."""
    from shardwise.data.batch import Batch
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(7)
    T = PROMPT + RESP
    ids, attn, resp = worker_rows(g, ROWS, PROMPT, RESP)
    adv = torch.randn(ROWS, T, generator=g) * resp
    noise = 0.3 * torch.randn(ROWS, T, generator=g)
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": resp, "advantages": adv}), noise


def actor_body(rank: int, world: int, overrides: list[str], split: tuple[int, ...]) -> dict:
    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.actor import ActorWorker, ReferenceWorker

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    actor = ActorWorker(cfg, runtime)
    init = full_params(actor.model)  # collective: every rank gathers
    batch, noise = rollout_batch()
    rows = one_process_order(split) if world == 1 else shares(split)[rank]
    batch, noise = batch[rows], noise[rows]
    scored = actor.compute_log_prob(batch)
    ref = ReferenceWorker(cfg, runtime).compute_ref_log_prob(batch)
    mask = batch.tensors["response_mask"].bool()
    same_as_ref = bool(torch.equal(scored.tensors["old_log_probs"], ref.tensors["ref_log_probs"]))
    old = (scored.tensors["old_log_probs"] + noise).masked_fill(~mask, 0.0)
    batch = batch.union(Batch.from_dict({"old_log_probs": old,
                                         "ref_log_probs": ref.tensors["ref_log_probs"] - 0.2 * noise}))
    metrics = actor.update_actor(batch)
    after = actor.compute_log_prob(batch).tensors["old_log_probs"]
    params = full_params(actor.model)
    teardown()
    return {"metrics": metrics, "params": params if rank == 0 else None, "init": init if rank == 0 else None, "same_as_ref": same_as_ref,
            "before": scored.tensors["old_log_probs"], "after": after, "entropy_zero_outside": bool((scored.tensors["entropy"][~mask] == 0).all())}


@pytest.mark.parametrize("mode,split", [
    ("token-mean", (4, 4)), ("seq-mean-token-sum", (4, 4)), ("seq-mean-token-mean", (4, 4)),
    ("token-mean", (6, 2)), ("seq-mean-token-sum", (8, 0)),
], ids=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-mean-rows-6-2",
        "seq-mean-token-sum-rows-8-0"])
def test_actor_update_two_processes_equals_one(mode, split):
    # Uneven splits: the rank with fewer micro-batches runs throw-away forwards/backwards
    # so that every rank issues the same collectives.
    overrides = [*BASE, f"rl.actor.loss_agg_mode={mode}"]
    one = run_ranks(actor_body, 1, overrides, split, timeout=180)[0]  # the same mini-batch sets
    two = run_ranks(actor_body, 2, overrides, split, timeout=180)
    assert one["same_as_ref"] and all(r["same_as_ref"] for r in two)
    assert one["entropy_zero_outside"]
    m1, m2 = one["metrics"], two[0]["metrics"]
    assert two[1]["metrics"] == m2  # every rank reports the same (all-reduced) metrics
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # the batch was off-policy enough for the clip (both sides) to act
    assert m1["actor/pg_clipfrac"] > 0 and m1["actor/pg_clipfrac_lower"] >= 0
    for k, v in one["params"].items():
        torch.testing.assert_close(two[0]["params"][k], v, rtol=0, atol=2e-6, msg=k)
    order = one_process_order(split)
    after_two = torch.cat([r["after"] for r in two])  # rows 0..7: the ranks' shares are consecutive
    after_one = one["after"][[order.index(i) for i in range(ROWS)]]
    torch.testing.assert_close(after_two, after_one, rtol=0, atol=1e-5)
    assert float((one["after"] - one["before"]).abs().max()) > 1e-2  # the update did move the policy


def on_policy_body(rank: int, world: int, overrides: list[str], split: tuple[int, ...], shortcut: bool) -> dict:
    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.actor import ActorWorker, ReferenceWorker

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    actor = ActorWorker(cfg, runtime)
    batch, noise = rollout_batch()
    batch, noise = batch[shares(split)[rank]], noise[shares(split)[rank]]
    scored = actor.compute_log_prob(batch)
    ref = ReferenceWorker(cfg, runtime).compute_ref_log_prob(batch).tensors["ref_log_probs"]
    mask = batch.tensors["response_mask"].bool()
    old = scored.tensors["old_log_probs"]
    batch = batch.union(Batch.from_dict({"ref_log_probs": (ref - 0.2 * noise).masked_fill(~mask, 0.0),
                                         "rollout_log_probs": (old + 0.05 * noise).masked_fill(~mask, 0.0)}))
    given = batch if shortcut else batch.union(Batch.from_dict({"old_log_probs": old}))
    metrics = actor.update_actor(given)
    params = full_params(actor.model)
    teardown()
    return {"metrics": metrics, "params": params if rank == 0 else None, "old": old, "entropy": scored.tensors["entropy"],
            "ref": batch.tensors["ref_log_probs"], "rollout": batch.tensors["rollout_log_probs"], "mask": mask}


def test_on_policy_update_without_old_log_probs_equals_the_one_with_them():
    # One epoch of one mini-batch: the old log-probs are the update's own forward, detached.
    # Uneven rows (6, 2) over 2 ranks, the KL loss and truncated IS on. The policy metrics
    # the controller takes from the old-log-prob forward come from the update's forward.
    from shardwise.rl import algorithms as alg

    overrides = [*BASE, "rl.actor.ppo_epochs=1", "rl.actor.ppo_mini_batches=1", "rl.rollout.tis_cap=2.0"]
    fast = run_ranks(on_policy_body, 2, overrides, (6, 2), True, timeout=180)
    slow = run_ranks(on_policy_body, 2, overrides, (6, 2), False, timeout=180)
    for k, v in slow[0]["params"].items():
        torch.testing.assert_close(fast[0]["params"][k], v, rtol=0, atol=1e-6, msg=k)
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy_loss"):
        assert fast[0]["metrics"][key] == pytest.approx(slow[0]["metrics"][key], rel=1e-5, abs=1e-7), key
    assert fast[0]["metrics"]["actor/ppo_kl"] == 0.0 and fast[0]["metrics"]["actor/pg_clipfrac"] == 0.0
    assert fast[1]["metrics"] == fast[0]["metrics"]
    # what the controller computes over all rows from the old-log-prob forward
    cat = {k: torch.cat([r[k] for r in slow]) for k in ("old", "entropy", "ref", "rollout", "mask")}
    want = {"entropy": float(alg.masked_mean(cat["entropy"], cat["mask"])),
            "kl": float(alg.masked_mean(alg.kl_penalty(cat["old"], cat["ref"], "k1"), cat["mask"])),
            **alg.rollout_mismatch(cat["old"], cat["rollout"], cat["mask"])}
    assert sorted(want) == sorted(k for k in fast[0]["metrics"] if not k.startswith("actor/"))
    for key, value in want.items():
        assert fast[0]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
