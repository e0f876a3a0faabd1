"""`shardwise rl` config mistakes: exit 2 with one message naming the key and a hint,
before Ray or any worker starts."""

from __future__ import annotations

import importlib.util

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT

from shardwise.cli import main

EXAMPLE = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")
# The example warm-starts from the SFT demo's output; these rows use an inline model instead.
INLINE = ["model.path=null", TINY_QWEN3]
VLLM = importlib.util.find_spec("vllm") is not None

ROWS = [
    (["rl.algorithm=ppo"], "rl.critic.enabled", "set rl.critic.enabled=true"),
    (["rl.advantage=gae"], "rl.critic.enabled", "set rl.critic.enabled=true"),
    (["rl.advantage=gae", "rl.critic.enabled=true"], "rl.advantage", "rl.algorithm=ppo"),
    # vllm: with it installed, a tensor-parallel size that does not tile the 2 ranks; without, the install hint
    (["rl.rollout.engine=vllm", "rl.rollout.vllm.tensor_parallel_size=4"],
     *(("rl.rollout.vllm.tensor_parallel_size", "pick one of [1, 2]") if VLLM
       else ("rl.rollout.engine", "pip install 'shardwise[vllm]'"))),
    (["rl.rollout.tis_cap=0"], "rl.rollout.tis_cap", None),
    (["rl.rollout.n=1"], "rl.rollout.n", "n=4"),
    (["train.global_batch_size=3", "train.micro_batch_size=1", "rl.rollout.n=3"], "train.global_batch_size",
     "multiple of 2"),
    (["rl.actor.ppo_mini_batches=3"], "rl.actor.ppo_mini_batches", "divisor"),
    (["rl.reference.enabled=false"], "rl.reference.enabled", "rl.reference.enabled=true"),
    (["rl.reward.function=builtin:arithmatic"], "rl.reward.function", "builtin:arithmetic"),
    (["rl.reward.function=no_such_module_xyz:score"], "rl.reward.function", None),
    (["rl.reward.function=null", "rl.reward.model=null"], "rl.reward", "builtin:arithmetic"),
    (["rl.reward.model=/nonexistent/rm"], "rl.reward.model", "save_pretrained"),
    (["rl.rollout.temperature=-1"], "rl.rollout.temperature", None),
    (["rl.actor.loss_agg_mode=token_mean"], "rl.actor.loss_agg_mode", "token-mean"),
    (["rl.algorthm=ppo"], "rl.algorthm", "did you mean rl.algorithm?"),
    (["rl.filter_groups=zero_var"], "rl.filter_groups", "zero_variance"),
    # n=1: every group is one sample, always zero variance (grpo already needs n >= 2)
    (["rl.filter_groups=zero_variance", "rl.rollout.n=1", "rl.advantage=reinforce_plus_plus"],
     "rl.filter_groups", "rl.rollout.n=4"),
    (["rl.filter_groups=zero_variance", "rl.filter_groups_max_rounds=0"], "rl.filter_groups_max_rounds", None),
]


@pytest.mark.parametrize("overrides,key,hint", ROWS, ids=[r[1] + ":" + r[0][0] for r in ROWS])
def test_rl_config_errors_exit_2_before_ray(overrides, key, hint, capsys, monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    code = main(["rl", EXAMPLE, *INLINE, f"run.dir={tmp_path / 'run'}", *overrides, "--nproc", "2"])
    out, err = capsys.readouterr()
    report = f"exit {code}\n{out}\n{err}"
    assert code == 2, report
    assert out == "" and err.startswith("shardwise: ") and err.count("shardwise: ") == 1, report
    assert key in err, report
    if hint is not None:
        assert hint in err, report
    assert not (tmp_path / "run").exists()  # nothing written, nothing started
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
