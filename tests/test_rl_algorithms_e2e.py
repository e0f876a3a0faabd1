"""Policy losses and advantage estimators of `shardwise.rl.algorithms` in a real 2-rank
`shardwise rl` job (tiny Qwen3, one step each): the job runs, its recorded batch's
advantages are the estimator's on that batch's rewards (one job with packing, token budgets
and LoRA too), and a user's loss that raises
stops the job with one line naming it (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from dist.launcher import run_cli
from test_rl_trainer import GRPO, TINY

from shardwise.data.batch import Batch
from shardwise.rl import algorithms as alg

pytest.importorskip("ray")

COMMON = [*TINY, "train.max_steps=1", "rl.heldout_eval=false", "checkpoint.every_steps=0",
          "checkpoint.export_hf=false", "rl.record_batches=1", "rl.reward.function=my_loss:ones"]
USER = "import torch\nfrom shardwise.rl.algorithms import get_policy_loss_fn\n\n" \
       "def mine(*args, **kwargs):\n    return get_policy_loss_fn('gpg')(*args, **kwargs)\n\n" \
       "def broken(*args, **kwargs):\n    raise RuntimeError('no loss today')\n\n" \
       "def ones(prompt, response, ground_truth):\n    return response.count('1') / 4\n"

# (policy loss, estimator, extra overrides): each row one job; together every loss family
JOBS = {
    # a sequence-level loss on packed rows (sequences sharing a row), token-budget micro-batches
    # (rows of at most 20 tokens: 2 to a micro-batch) and LoRA (the reference: adapters off)
    "gspo+grpo_passk+packing+budget+lora": ["rl.actor.policy_loss=gspo", "rl.advantage=grpo_passk",
                                            "rl.actor.loss_agg_mode=seq-mean-token-mean", "rl.packing=true",
                                            "rl.actor.max_tokens_per_micro_batch=40",
                                            "rl.log_prob_max_tokens_per_micro_batch=40", "model.lora.enabled=true",
                                            "model.lora.r=4", "model.lora.alpha=8"],
    "cispo+remax+overlong": ["rl.actor.policy_loss=cispo", "rl.advantage=remax", "rl.actor.clip_ratio_high=0.28",
                             "rl.reward.overlong.enabled=true", "rl.reward.overlong.buffer_len=2"],
    "user+opo+dr_grpo": ["rl.actor.policy_loss=my_loss:mine", "rl.advantage=opo",
                         "rl.actor.loss_agg_mode=seq-mean-token-sum-norm", "rl.norm_adv_by_std=false"],
}


@pytest.mark.parametrize("job", list(JOBS))
def test_the_algorithm_runs_end_to_end(job, tmp_path):
    (tmp_path / "my_loss.py").write_text(USER)
    run_dir = tmp_path / "run"
    res = run_cli(["rl", GRPO, "--nproc", "2", f"run.dir={run_dir}", *COMMON, *JOBS[job]], timeout=400, cwd=tmp_path)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert "actor/loss" in m and m["actor/loss"] == m["actor/loss"], m  # an update ran, its loss finite
    b = Batch.from_bytes((run_dir / "batches" / "step_00000001.batch").read_bytes())
    t = b.tensors
    name = next(o.split("=")[1] for o in JOBS[job] if o.startswith("rl.advantage="))
    kwargs = {"token_level_rewards": t["token_level_rewards"], "response_mask": t["response_mask"],
              "index": list(b.arrays["uid"]), "config": {"norm_adv_by_std_in_grpo": "dr_grpo" not in job}}
    if name == "remax":
        kwargs["reward_baselines"] = t["reward_baselines"]
        assert m["time/generate_baseline"] > 0
    want, _ = alg.get_adv_estimator_fn(name)(**kwargs)
    torch.testing.assert_close(t["advantages"], want)
    if "lora" in job:  # B starts at 0: the actor is its reference at step 1, which is its adapters disabled
        assert m["kl"] == 0.0 and "the reference is the actor with its adapters disabled" in res.stderr
    if "overlong" in job:
        assert m["reward/overlong_penalty_mean"] <= 0


def test_a_user_loss_that_raises_is_one_line(tmp_path):
    (tmp_path / "my_loss.py").write_text(USER)
    res = run_cli(["rl", GRPO, "--nproc", "2", f"run.dir={tmp_path / 'run'}", *COMMON,
                   "rl.actor.policy_loss=my_loss:broken"], timeout=400, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "my_loss:broken raised RuntimeError: no loss today" in res.stderr
