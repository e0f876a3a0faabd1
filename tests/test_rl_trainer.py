"""`shardwise rl` end to end through the real CLI: 2 Ray worker processes forming one gloo
group, the single controller in the CLI process.

- resume: a PPO run (critic and reward model colocated with the actor, a user reward
  function) stopped at step 2 and resumed to step 4 logs exactly the metrics of an
  uninterrupted 4-step run (actor, critic, optimizers, sampler, sampling seeds restored);
- GRPO from the SFT warm start raises the mean reward (of a reward it can learn in 12 steps);
- PPO with the critic in a worker group of its own (GAE) lowers its value loss.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, run_cli

pytest.importorskip("ray")

GRPO = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")
TINY = ["model.path=null", TINY_QWEN3, "train.global_batch_size=4", "train.micro_batch_size=8",
        "rl.rollout.n=4", "rl.rollout.max_new_tokens=4", "train.optimizer.lr=1e-3"]


def rl(run_dir: Path, *overrides: str, timeout: float = 400, cwd: Path | None = None):
    res = run_cli(["rl", GRPO, "--nproc", "2", f"run.dir={run_dir}", *overrides], timeout=timeout, cwd=cwd)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


TOY_REWARD = "def ones(prompt, response, ground_truth):\n    return response.count('1') / 4\n"


def save_tiny_reward_model(path: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64,
                      num_labels=1, pad_token_id=0)
    Qwen3ForSequenceClassification(cfg).save_pretrained(path)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    # An untrained model never answers right: a user reward function (module:function,
    # imported from the working directory) gives the advantages something to work with.
    (tmp_path / "toy_reward.py").write_text(TOY_REWARD)
    save_tiny_reward_model(tmp_path / "rm")
    common = [*TINY, "checkpoint.every_steps=2", "checkpoint.export_hf=false",
              "rl.reward.function=toy_reward:ones", f"rl.reward.model={tmp_path / 'rm'}",
              "rl.algorithm=ppo", "rl.advantage=gae", "rl.critic.enabled=true", "rl.critic.lr=1e-3"]
    whole = tmp_path / "whole"
    rl(whole, *common, "train.max_steps=4", cwd=tmp_path)
    parts = tmp_path / "parts"
    rl(parts, *common, "train.max_steps=2", cwd=tmp_path)
    assert sorted(p.name for p in (parts / "checkpoints").iterdir()) == ["step_00000002"]
    assert sorted(p.name for p in (parts / "critic" / "checkpoints").iterdir()) == ["step_00000002"]
    res = rl(parts, *common, "train.max_steps=4", cwd=tmp_path)
    assert "ppo" in res.stderr  # the progress bar
    a, b = metrics(whole), metrics(parts)
    assert [m["step"] for m in a] == [1, 2, 3, 4] and [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("reward/mean", "reward/model_mean", "response_length/mean", "entropy", "kl", "actor/loss",
                "actor/grad_norm", "actor/pg_clipfrac", "critic/vf_loss", "critic/grad_norm"):
        assert [m[key] for m in b[2:]] == [m[key] for m in a[2:]], key
    assert a[3]["actor/grad_norm"] > 0 and a[3]["actor/loss"] != a[2]["actor/loss"]  # real updates
    for key in ("time/generate", "time/reward", "time/old_log_prob", "time/ref", "time/values", "time/advantage",
                "time/update_critic", "time/update_actor", "time/step", "accuracy", "actor/lr", "response_length/clip_frac"):
        assert all(isinstance(m[key], (int, float)) for m in a), key
    assert (whole / "rl.png").stat().st_size > 1000

    # A damaged checkpoint named explicitly passes the launcher's look at the folder and is
    # found by the Ray workers when they verify its checksums: the user still reads one
    # line naming the key, exit status 2, as when the controller finds a mistake.
    damaged = tmp_path / "damaged"
    shutil.copytree(parts / "checkpoints" / "step_00000004", damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = run_cli(["rl", GRPO, "--nproc", "2", f"run.dir={tmp_path / 'again'}", *common, "train.max_steps=6",
                   f"checkpoint.resume={damaged}"], timeout=400, cwd=tmp_path)
    lines = [x for x in res.stderr.splitlines() if x.startswith("shardwise: ")]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "checkpoint.resume" in lines[0] and "failed verification" in lines[0] and shard.name in lines[0], lines
    assert "Traceback" not in res.stderr


STARTS_WITH_ONE = ("def starts_with_one(prompt, response, ground_truth):\n"
                   "    return 1.0 if response.strip().startswith('1') else 0.0\n")


def test_grpo_from_sft_raises_mean_reward(sft_demo_model, tmp_path):
    # A learning signal that holds for any seed and CPU. The arithmetic reward itself rises
    # too slowly for a test (0.329 -> 0.362 over 40 steps on one machine, 0.234 -> 0.239
    # on another: the SFT model differs between CPUs), so the reward here is one the
    # SFT model earns on 21-38% of its samples and GRPO can raise quickly: an answer that
    # starts with "1". Measured (lr 5e-4, 64 prompts x 8 samples, 12 steps), mean reward
    # of steps 1-3 -> steps 10-12: +0.43, +0.31, +0.32 (seeds 0, 1, 2, AVX512 kernels,
    # SFT model at 33.5% held-out accuracy) and +0.51, +0.31 (seeds 0, 1, AVX2 kernels,
    # whose SFT run ends at 71%): mean 0.38, std 0.09; asserted > 0.15.
    (tmp_path / "easy.py").write_text(STARTS_WITH_ONE)
    run_dir = tmp_path / "grpo"
    res = rl(run_dir, f"model.path={sft_demo_model}", "train.max_steps=12", "checkpoint.every_steps=0",
             "rl.reward.function=easy:starts_with_one", "train.optimizer.lr=5e-4", cwd=tmp_path)
    m = metrics(run_dir)
    first = sum(x["reward/mean"] for x in m[:3]) / 3
    last = sum(x["reward/mean"] for x in m[-3:]) / 3
    assert last > first + 0.15, (first, last, [round(x["reward/mean"], 3) for x in m])
    assert m[-1]["kl"] > 0  # the policy moved away from the reference
    assert "held-out accuracy (greedy): before RL" in res.stdout
    assert (run_dir / "hf" / "config.json").is_file() and (run_dir / "rl.png").is_file()


def test_ppo_with_critic_lowers_value_loss(sft_demo_model, tmp_path):
    run_dir = tmp_path / "ppo"
    rl(run_dir, f"model.path={sft_demo_model}", "rl.algorithm=ppo", "rl.advantage=gae", "rl.critic.enabled=true",
       "rl.critic.lr=1e-3", "rl.critic.colocated=false", "train.max_steps=8", "train.global_batch_size=16", "checkpoint.every_steps=4",
       "checkpoint.export_hf=false")
    m = metrics(run_dir)
    vf = [x["critic/vf_loss"] for x in m]
    # The targets move with the policy, so the loss is not monotone; measured on this
    # machine: 0.156 at step 1, 0.088 at step 5, ~0.1 at steps 6-8.
    assert min(vf[-4:]) < 0.7 * vf[0] and sum(vf[-4:]) / 4 < 0.85 * vf[0], vf
    assert all("time/values" in x and "time/update_critic" in x for x in m)
    assert sorted(p.name for p in (run_dir / "critic" / "checkpoints").iterdir()) == ["step_00000004",
                                                                                    "step_00000008"]
