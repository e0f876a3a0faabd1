"""Group filtering (``rl.filter_groups: zero_variance``, DAPO's dynamic sampling).

- which groups leave (`zero_variance_groups`) and how many groups an update takes
  (`rl_update_groups`): tables of inputs and outputs;
- joining sampling rounds of different prompt widths keeps every row's tokens, masks and
  positions, and the step's reward metrics are those of all rounds scored at once;
- the loss normalisation: under 2 processes, the actor update on a rollout batch with
  zero-variance groups, filtered the way the controller filters (the same functions, the
  same dispatch split), equals the 1-process update on a batch holding only the kept
  groups with filtering off; and differs clearly from the update without filtering (the
  dropped rows' tokens would count in the token-mean and the KL loss).

The end-to-end check (the CLI with filtering and refill) is in tests/test_rl_trainer.py.
"""

from __future__ import annotations

import pytest
import torch
from dist.common import FP32, TINY_QWEN3, assert_trained_params_close, full_params, worker_rows
from dist.launcher import at_once, run_ranks

from shardwise.config.validate import rl_update_groups
from shardwise.data.batch import Batch
from shardwise.engine.infer import default_position_ids
from shardwise.rl.algorithms import zero_variance_groups
from shardwise.rl.trainer import concat_rounds, drop_zero_variance_groups, merge_reward_metrics


@pytest.mark.parametrize("scores,groups,want", [
    ([1, 1, 0, 1, 0.5, 0.5, 2], "aabbccd", [1, 1, 0, 0, 1, 1, 1]),  # a group of one is always zero variance
    ([0, 0, 0, 0], "abab", [1, 1, 1, 1]),  # rows of a group need not be adjacent
    ([0, 1e-7, 3, 3], "aabb", [0, 0, 1, 1]),  # exact equality, no tolerance
    ([-1, -1, float("inf"), float("inf")], "aabb", [1, 1, 1, 1]),
    ([], "", []),
])
def test_zero_variance_groups(scores, groups, want):
    got = zero_variance_groups(torch.tensor(scores, dtype=torch.float32), list(groups))
    assert got.dtype == torch.bool and got.tolist() == [bool(w) for w in want]


@pytest.mark.parametrize("groups,n,dp,mini,want", [
    (13, 8, 2, 1, 13),  # n a multiple of dp x mini: every count
    (13, 8, 2, 4, 13),
    (3, 4, 2, 4, 2),  # 2 groups = 8 rows = 2 ranks x 4 mini-batches of 1 row
    (1, 4, 2, 4, 0),  # too few for one row per rank and mini-batch: no update
    (7, 3, 2, 1, 6),  # odd n over 2 ranks: an even number of groups
    (5, 5, 4, 2, 0),
    (8, 5, 4, 2, 8),
    (0, 8, 2, 1, 0),
])
def test_rl_update_groups(groups, n, dp, mini, want):
    got = rl_update_groups(groups, n, dp, mini)
    assert got == want
    assert (got * n) % (dp * mini) == 0 and got <= groups


def scored_round(prompt_width: int, prompt_lens: list[int], n: int, resp: int, scores: list[float],
                 tag: str, pad: int = 0, seed: int = 0) -> Batch:
    """A scored rollout round in the generate layout: left-padded prompts of `prompt_lens`
    tokens, each repeated `n` times, responses of 1..resp tokens, `scores` per row at the
    last response token."""
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens) * n
    prompt_ids = torch.full((rows, prompt_width), pad)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.randint(3, 60, (rows, resp), generator=g)
    keep = torch.zeros(rows, resp, dtype=torch.long)
    for r in range(rows):
        length = prompt_lens[r // n]
        prompt_ids[r, prompt_width - length:] = torch.randint(3, 60, (length,), generator=g)
        prompt_mask[r, prompt_width - length:] = 1
        keep[r, :1 + r % resp] = 1
    responses = responses.masked_fill(keep == 0, pad)
    attn = torch.cat([prompt_mask, keep], 1)
    scores_t = torch.zeros(rows, prompt_width + resp)
    for r in range(rows):
        scores_t[r, prompt_width + int(keep[r].sum()) - 1] = scores[r]
    return Batch.from_dict(
        {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "input_ids": torch.cat([prompt_ids, responses], 1),
         "attention_mask": attn, "position_ids": default_position_ids(attn),
         "response_mask": torch.cat([torch.zeros_like(prompt_mask), keep], 1), "responses": responses,
         "rollout_log_probs": torch.randn(rows, prompt_width + resp, generator=g) * torch.cat([prompt_mask * 0, keep], 1),
         "token_level_scores": scores_t},
        {"uid": [f"{tag}-{r // n}" for r in range(rows)], "prompt": [f"p{r // n}" for r in range(rows)]},
        {"seed": seed})


def test_rounds_of_different_prompt_widths_join_row_for_row():
    a = scored_round(3, [3, 2], 2, 4, [1, 0, 1, 1], "0", seed=1)
    b = scored_round(5, [5, 4], 2, 4, [0, 0, 0, 1], "0.1", seed=2)
    kept = [drop_zero_variance_groups(a), drop_zero_variance_groups(b)]
    assert [len(k) for k in kept] == [2, 2] and list(kept[0].arrays["uid"]) == ["0-0", "0-0"]
    joined = concat_rounds(kept, pad_id=0)
    assert joined.tensors["input_ids"].shape == (4, 9) and joined.tensors["prompt_ids"].shape == (4, 5)
    assert "seed" not in joined.meta
    originals = [kept[0][0], kept[0][1], kept[1][0], kept[1][1]]
    for row, orig in enumerate(originals):
        got = joined[row].tensors
        real = got["attention_mask"][0].bool()
        assert int(real.sum()) == int(orig.tensors["attention_mask"].sum())
        for k in ("input_ids", "position_ids", "response_mask", "rollout_log_probs", "token_level_scores"):
            torch.testing.assert_close(got[k][0][real], orig.tensors[k][0][orig.tensors["attention_mask"][0].bool()])
        # the new padding is masked, its positions as generate's own left padding
        assert got["response_mask"][0][~real].eq(0).all()
        torch.testing.assert_close(got["position_ids"], default_position_ids(got["attention_mask"]))
        torch.testing.assert_close(got["responses"], orig.tensors["responses"])
    # reward metrics of two rounds = those of all their rows at once
    rounds = [a, b]
    per_round = [{"reward/mean": float(x.tensors["token_level_scores"].sum(-1).mean()), "accuracy": acc,
                  "reward/std": -1.0} for x, acc in zip(rounds, (0.75, 0.25))]
    merged = merge_reward_metrics(rounds, per_round)
    every = torch.cat([x.tensors["token_level_scores"].sum(-1) for x in rounds])
    assert merged["reward/mean"] == pytest.approx(float(every.mean()))
    assert merged["reward/std"] == pytest.approx(float(every.std()))
    assert merged["accuracy"] == pytest.approx(0.5)


def test_rounds_of_different_response_widths_join_row_for_row():
    """Multi-turn rounds are as wide as their longest trajectory: the response columns are
    right-padded to the widest round's, every real token where it was."""
    a = scored_round(3, [3, 2], 2, 4, [1, 0, 1, 1], "0", seed=1)
    b = scored_round(5, [5, 4], 2, 7, [0, 0, 0, 1], "0.1", seed=2)
    joined = concat_rounds([a, b], pad_id=0)
    assert joined.tensors["input_ids"].shape == (8, 12) and joined.tensors["responses"].shape == (8, 7)
    for row, orig in enumerate([a[i] for i in range(4)] + [b[i] for i in range(4)]):
        got, o = joined[row].tensors, orig.tensors
        real = got["attention_mask"][0].bool()
        for k in ("input_ids", "position_ids", "response_mask", "rollout_log_probs", "token_level_scores"):
            torch.testing.assert_close(got[k][0][real], o[k][0][o["attention_mask"][0].bool()])
        width = o["responses"].shape[1]
        torch.testing.assert_close(got["responses"][0, :width], o["responses"][0])
        assert got["responses"][0, width:].eq(0).all()
        torch.testing.assert_close(got["position_ids"], default_position_ids(got["attention_mask"]))


# ------------------------------------------------------------------ the update's normalisation

G, N, PROMPT, RESP = 4, 4, 5, 6
SCORES = [1, 0, 0, 1,  1, 1, 1, 1,  0, 1, 0, 0,  0, 0, 0, 0]  # groups 1 and 3 have zero variance
KEPT = [0, 1, 2, 3, 8, 9, 10, 11]  # the rows of groups 0 and 2
LR, MINI = 1e-2, 2
BASE = [TINY_QWEN3, *FP32, f"train.optimizer.lr={LR}", "train.scheduler.name=constant",
        "train.scheduler.warmup_steps=0", "train.micro_batch_size=1", "train.max_steps=4",
        "rl.actor.ppo_epochs=1", f"rl.actor.ppo_mini_batches={MINI}", "rl.actor.kl_loss.enabled=true",
        "rl.actor.kl_loss.type=k3", "rl.actor.kl_loss.coef=0.1", "rl.rollout.temperature=0.7",
        f"rl.rollout.n={N}", "rl.reference.enabled=true"]


def grpo_rollout() -> Batch:
    """G groups of N rows in the worker layout: left-padded prompts, responses of
    different lengths, the SCORES at each row's last response token, a uid per group and
    a fixed off-policy shift of the old log-probs (``noise``, travels with its row)."""
    g = torch.Generator().manual_seed(11)
    rows, T = G * N, PROMPT + RESP
    ids, attn, resp = worker_rows(g, rows, PROMPT, RESP)
    scores = torch.zeros(rows, T)
    for r in range(rows):
        scores[r, PROMPT + 1 + r % (RESP - 1)] = SCORES[r]  # the last response token
    noise = 0.3 * torch.randn(rows, T, generator=g)
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": resp, "token_level_scores": scores, "noise": noise},
                           {"uid": [f"0-{r // N}" for r in range(rows)]})


def with_advantages(batch: Batch) -> Batch:
    """The controller's advantage phase (grpo) on the update's rows."""
    from shardwise.registry import ADVANTAGE_ESTIMATORS

    adv, _ = ADVANTAGE_ESTIMATORS.get("grpo")(batch.tensors["token_level_scores"], batch.tensors["response_mask"],
                                              values=None, group_ids=list(batch.arrays["uid"]), gamma=1.0, lam=1.0)
    return batch.union(Batch.from_dict({"advantages": adv}))


def update(actor, ref, batch: Batch) -> dict:
    """Old and reference log-probs of this rank's rows, then one PPO update; the metrics."""
    mask = batch.tensors["response_mask"].bool()
    old = actor.compute_log_prob(batch).tensors["old_log_probs"]
    ref_lp = ref.compute_ref_log_prob(batch).tensors["ref_log_probs"]
    noise = batch.tensors["noise"]
    return actor.update_actor(batch.union(Batch.from_dict({"old_log_probs": (old + noise).masked_fill(~mask, 0.0),
                                                           "ref_log_probs": ref_lp - 0.2 * noise})))


def filtered_body(rank: int, world: int, overrides: list[str]) -> dict:
    """The controller's path under `world` processes: drop the zero-variance groups, cut to
    what splits over ranks and mini-batches, advantages, the update_actor dispatch split."""
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.dispatch import Layout, dispatch_rule, split_arguments
    from shardwise.rl.workers.actor import ActorWorker, ReferenceWorker
    from shardwise.rl.workers.hybrid import RLWorker

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, [*overrides, "rl.filter_groups=zero_variance"])
    actor, ref = ActorWorker(cfg, runtime), ReferenceWorker(cfg, runtime)
    init = full_params(actor.model)
    kept = drop_zero_variance_groups(grpo_rollout())
    take = rl_update_groups(len(kept) // N, N, world, cfg.rl.actor.ppo_mini_batches)
    rows = with_advantages(kept[:take * N])
    calls, pad = split_arguments(dispatch_rule(RLWorker, "update_actor"), Layout.data_parallel(world),
                                 "update_actor", (rows,), {})
    assert pad == 0
    mine = calls[rank][0][0]
    metrics = update(actor, ref, mine)
    params = full_params(actor.model)
    teardown()
    return {"metrics": metrics, "params": params if rank == 0 else None, "init": init if rank == 0 else None,
            "rows": len(mine), "uids": sorted(set(rows.arrays["uid"]))}


def reference_body(rank: int, world: int, overrides: list[str]) -> dict:
    """One process, filtering off: the update on only the kept groups' rows (in the order
    that makes its mini-batches the 2-process run's global mini-batches), and the update
    on every row, the zero-variance groups included (advantage 0)."""
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.actor import ActorWorker, ReferenceWorker

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    assert cfg.rl.filter_groups == "none"
    out = {}
    for name, rows in (("kept", KEPT), ("all", list(range(G * N)))):
        actor, ref = ActorWorker(cfg, runtime), ReferenceWorker(cfg, runtime)
        init = full_params(actor.model)
        batch = with_advantages(grpo_rollout()[rows])
        if name == "kept":
            # rank r of 2 holds rows 4r..4r+3, its mini-batch i the i-th pair: global
            # mini-batch i = pair i of rank 0 + pair i of rank 1
            batch = batch[[0, 1, 4, 5, 2, 3, 6, 7]]
        out[name] = {"metrics": update(actor, ref, batch), "params": full_params(actor.model), "init": init}
    teardown()
    return out


def test_filtered_update_equals_the_update_on_the_kept_groups_alone():
    two, (one,) = at_once(lambda: run_ranks(filtered_body, 2, BASE, timeout=180),
                          lambda: run_ranks(reference_body, 1, BASE, timeout=180))
    assert two[0]["uids"] == ["0-0", "0-2"] and [r["rows"] for r in two] == [4, 4]
    got, want = two[0], one["kept"]
    for k, v in got["init"].items():  # every run starts from the same weights
        assert torch.equal(want["init"][k], v) and torch.equal(one["all"]["init"][k], v), k
    assert two[1]["metrics"] == got["metrics"]
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), key
    assert_trained_params_close(got["params"], want["params"], got["init"], LR, MINI)
    # The filter changed the update: keeping the zero-variance rows (advantage 0) puts their
    # tokens in the token-mean's denominator and their KL in the loss.
    diff = torch.cat([(got["params"][k] - one["all"]["params"][k]).flatten() for k in got["params"]])
    moved = torch.cat([(want["params"][k] - got["init"][k]).flatten() for k in got["params"]])
    assert float(diff.norm()) > 0.05 * float(moved.norm()), (float(diff.norm()), float(moved.norm()))
