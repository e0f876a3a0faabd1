"""Asynchronous RL (``rl.async``) end to end through the real CLI: a training group and a
generator group of Ray workers, the weight bridge between them, the single controller in
the CLI process.

- exact at zero: ``--nproc 2`` with one generator rank and ``max_staleness: 0``, stopped
  after its first step and resumed, equals the uninterrupted synchronous ``--nproc 1`` run
  on the same seed: the same batches (samples, log-probs, scores, advantages), the same
  metrics, bitwise the same exported weights, the same evaluations after every step; with
  ``reference_on: balanced`` the generator rank scores half of each batch's rows with the
  reference and the actor rank the other half: together the reference log-probs the
  synchronous run's actor rank gives;
- ``reference_on: balanced`` at staleness 1 with two generator ranks: a batch made while
  the actor is still busy with an earlier step is scored on the generator beyond the share;
- ``max_staleness: 1`` (with ``on_stale: drop``, which runs ahead without waiting for
  weights) measures the held-out accuracy through the generator group, logs its staleness
  (never above 1) and the idle figures of both sides, and checkpoints the policy version and
  the steps in flight; its generator rank, killed mid-run, ends the run with exit 1 and one
  line naming the group, the rank, what it was doing and the last checkpoint, and leaves no
  process of the run behind;
- multi-turn rollouts with a real tool on the generator rank: at staleness 0 the same
  trajectories, metrics and weights as the synchronous run;
- Ulysses on the training ranks: at staleness 0 the synchronous Ulysses run, bitwise; a
  LoRA actor from an adapter folder: the generator samples with its merged policy from the
  first step on;
- what the asynchronous run cannot do is refused before Ray starts (exit 2, one line), and
  ``shardwise plan --rl`` shows both groups.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from dist.common import TINY_QWEN3, missing_optional
from dist.launcher import REPO_ROOT, SRC_DIR, _kill_tree, alive, at_once, environ_of, run_cli
from tool_model import build_tool_model

pytest.importorskip("ray")

GRPO = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")
TOY_REWARD = "def ones(prompt, response, ground_truth):\n    return response.count('1') / 4\n"
COMMON = ["model.path=null", TINY_QWEN3, "train.global_batch_size=4", "train.micro_batch_size=8",
          "rl.rollout.n=4", "rl.rollout.max_new_tokens=4", "train.optimizer.lr=1e-3",
          "rl.reward.function=toy_reward:ones", "checkpoint.every_steps=0"]
ASYNC = ["rl.async.enabled=true", "rl.async.generator_ranks=1"]


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict]:
    """The training steps' lines (an evaluation's own line, with ``time/eval``, left out)."""
    return [m for m in lines(run_dir) if "time/eval" not in m]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Side by side (each its own command and Ray cluster): the synchronous run on 1 rank;
    the asynchronous one at staleness 0 on 1 + 1 ranks, stopped after step 1 and resumed;
    and the one whose generator is killed (`kill_the_generator`)."""
    tmp = tmp_path_factory.mktemp("async_runs")
    (tmp / "toy_reward.py").write_text(TOY_REWARD)

    def rl(name: str, nproc: int, *overrides: str):
        res = run_cli(["rl", GRPO, "--nproc", str(nproc), f"run.dir={tmp / name}", *COMMON, *overrides],
                      timeout=400, cwd=tmp)
        return tmp / name, res

    exact = ["rl.record_batches=2", "rl.heldout_eval=false",  # evaluated every step: 8 held-out prompts
             "eval.source=builtin:arithmetic", "eval.num_prompts=8", "eval.n=2", "eval.every_steps=1"]

    def stopped_and_resumed():  # step 1, then (resumed from its checkpoint) step 2
        # balanced: its share starts at a half, and moves only after a step that is not a
        # (resumed) run's first, so neither of this run's two steps moves it
        zero = [*exact, *ASYNC, "rl.async.max_staleness=0", "rl.async.reference_on=balanced"]
        first = rl("zero", 2, *zero, "train.max_steps=1")
        return first if first[1].returncode else rl("zero", 2, *zero, "train.max_steps=2")

    sync, zero, killed = at_once(
        lambda: rl("sync", 1, *exact, "train.max_steps=2"),
        stopped_and_resumed,
        lambda: kill_the_generator(tmp))
    return {"sync": sync, "zero": zero, "killed": killed}


def kill_the_generator(tmp: Path) -> dict:
    """A long asynchronous run at max_staleness 1 (on_stale drop: generation runs ahead
    without waiting for weights; the held-out accuracy measured through the generator group
    first; rl.actor.off_policy decoupled with the CISPO loss, clip-higher; the reference's
    forward on the generator) whose generator rank is killed by SIGKILL once three steps
    were logged and a checkpoint committed; its exit status, output, the rank's pid and the run's mark (an environment
    variable every process of the run inherits)."""
    run = tmp / "killed"
    mark = f"shardwise-test-{os.getpid()}-{time.monotonic_ns()}"
    out = open(tmp / "killed.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "rl", GRPO, "--nproc", "2", f"run.dir={run}", *COMMON, *ASYNC,
         "rl.async.max_staleness=1", "rl.async.on_stale=drop", "train.max_steps=100000", "checkpoint.every_steps=1",
         "checkpoint.async=false", "rl.actor.off_policy.correction=decoupled", "rl.async.reference_on=generator",
         "rl.actor.policy_loss=cispo", "rl.actor.clip_ratio_high=0.28"],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(SRC_DIR), "OMP_NUM_THREADS": "1", "SHARDWISE_TEST_MARK": mark})
    try:
        deadline = time.monotonic() + 300
        while not (list((run / "checkpoints").glob("step_*/COMMITTED")) and (run / "metrics.jsonl").is_file()
                   and len(metrics(run)) >= 3):
            if proc.poll() is not None or time.monotonic() > deadline:
                out.seek(0)
                return {"run": run, "code": proc.poll(), "text": out.read(), "pid": None, "mark": mark}
            time.sleep(0.3)
        pid = json.loads((run / "workers.json").read_text())["gen"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=120)
        out.seek(0)
        return {"run": run, "code": code, "text": out.read(), "pid": pid, "mark": mark}
    finally:
        _kill_tree(proc.pid)
        proc.wait()
        out.close()


def finished(runs, name: str) -> Path:
    run_dir, res = runs[name]
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return run_dir


def test_async_at_staleness_zero_and_resumed_equals_the_synchronous_run(runs):
    from shardwise.data.batch import Batch

    sync, zero = finished(runs, "sync"), finished(runs, "zero")
    assert f"resuming {zero / 'checkpoints' / 'step_00000001'}" in runs["zero"][1].stderr  # the second command
    a, b = metrics(sync), metrics(zero)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    assert a[1]["actor/grad_norm"] > 0  # the toy reward varies within groups: real updates
    for m, n in zip(a, b):
        for key, value in m.items():
            if not key.startswith(("time", "perf/")):
                assert n[key] == value, key
        assert n["async/staleness_max"] == 0 and n["async/dropped"] == 0
        assert n["async/reference_share"] == 0.5 and n["time/generator_ref"] > 0 and n["time/ref"] > 0
    for step in (1, 2):
        x = Batch.from_bytes((sync / "batches" / f"step_{step:08d}.batch").read_bytes())
        y = Batch.from_bytes((zero / "batches" / f"step_{step:08d}.batch").read_bytes())
        assert set(x.tensors) == set(y.tensors)
        for key, t in x.tensors.items():
            assert torch.equal(t, y.tensors[key]), (step, key)
        assert list(y.arrays["version"]) == [step - 1] * len(y)  # generated by the policy it updates
        assert set(x.arrays) == set(y.arrays) - {"version"}
        for key, v in x.arrays.items():
            assert list(v) == list(y.arrays[key]), (step, key)
    assert (sync / "hf" / "model.safetensors").read_bytes() == (zero / "hf" / "model.safetensors").read_bytes()
    # the evaluations (through the generator group, after each update) answer alike: the
    # same figures and samples at steps 0, 1 (the resumed run's first: logged once) and 2
    evals = [[{k: v for k, v in m.items() if not k.startswith("time")} for m in lines(r) if "time/eval" in m]
             for r in (sync, zero)]
    assert [m["step"] for m in evals[0]] == [0, 1, 2] and evals[1] == evals[0]
    for step in (0, 1, 2):
        name = f"samples/step_{step:07d}.jsonl"
        assert (sync / name).read_text() == (zero / name).read_text(), step
    places = json.loads((zero / "workers.json").read_text())
    assert sorted(places) == ["gen", "rl"] and len(places["gen"]) == len(places["rl"]) == 1


def test_async_at_staleness_one_runs_ahead_within_the_bound(runs):
    k = runs["killed"]  # the steps it logged before its generator was killed
    lines = metrics(k["run"])
    assert len(lines) >= 3, k["text"][-3000:]
    for m in lines:
        assert 0 <= m["async/staleness_mean"] <= m["async/staleness_max"] <= 1, m
        for key in ("async/dropped", "time/trainer_wait", "time/generator_wait", "time/weight_sync",
                    "time/weight_gather", "weight_sync/bytes", "reward/mean", "actor/grad_norm"):
            assert isinstance(m[key], float), key
        assert m["time/generate"] > 0, m  # the generator's own seconds
    assert lines[0]["async/staleness_max"] == 0  # the first step has no older policy to come from
    for m in lines:  # reference_on generator: every row scored there, none by the actor
        assert m["async/reference_share"] == 1.0 and m["time/generator_ref"] > 0 and "time/ref" not in m, m
    for m in lines:  # decoupled: the proximal policy is recomputed, the behaviour weights logged
        assert "time/old_log_prob" in m, m
        assert 0 <= m["actor/pg_clipfrac"] <= 1 and m["actor/loss"] == m["actor/loss"], m  # CISPO's, finite
        assert m["off_policy/is_weight_mean"] > 0 and 0 <= m["off_policy/truncated_share"] <= 1, m
    # step 1 trains on version 0's samples with version 0: pi_prox = pi_behave up to the
    # engines' rounding, so the weights are 1 and none is truncated
    assert lines[0]["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3), lines[0]
    assert lines[0]["off_policy/truncated_share"] == 0.0
    assert lines[0]["time/startup/eval"] > 0  # the held-out accuracy, through the generator group
    # a checkpoint holds the policy version and the steps in flight (generated again on resume)
    last = sorted((k["run"] / "checkpoints").glob("step_*/COMMITTED"))[-1].parent
    extra = json.loads((last / "meta.json").read_text())["extra"]
    step = int(last.name.removeprefix("step_"))
    assert extra["async"]["policy_version"] == step and extra["step"] == step, extra
    assert extra["async"]["in_flight"] and all(t >= step for t in extra["async"]["in_flight"]), extra


def test_balanced_the_generator_scores_more_rows_while_the_trainer_is_busy(tmp_path):
    """reference_on balanced at staleness 1, two generator ranks: step 2's batch is
    generated while the actor still updates step 1 (60 policy epochs: a margin that holds when
    the other test worker loads the machine; 20 failed once in CI), so the generator
    ranks score the rest of their rows beyond the share (a half at first), agreeing before
    each part, instead of waiting for version 1; step 1's batch, which the trainer waits
    for, gets the share only."""
    (tmp_path / "toy_reward.py").write_text(TOY_REWARD)
    run = tmp_path / "run"
    res = run_cli(["rl", GRPO, "--nproc", "3", f"run.dir={run}", *COMMON, "rl.async.enabled=true",
                   "rl.async.generator_ranks=2", "rl.async.max_staleness=1",
                   "rl.async.reference_on=balanced", "rl.reference.enabled=true", "rl.actor.ppo_epochs=60",
                   "train.max_steps=2", "rl.heldout_eval=false"], timeout=400, cwd=tmp_path)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    first, second = metrics(run)
    assert first["async/reference_share"] == 0.5 and first["time/ref"] > 0, first
    assert second["async/reference_share"] == 1.0 and "time/ref" not in second, second


def test_a_killed_generator_rank_is_named_with_the_last_checkpoint_and_nothing_is_left(runs):
    k = runs["killed"]
    run, code, text, pid, mark = k["run"], k["code"], k["text"], k["pid"], k["mark"]
    assert pid is not None, f"the run ended (exit {code}) before the generator was killed:\n{text[-3000:]}"
    lines = [x for x in text.splitlines() if x.startswith("shardwise: ")]
    assert code == 1 and len(lines) == 1, f"exit {code}\n{text[-3000:]}"
    line = lines[0]
    assert "worker group 'gen' lost rank 0 in generate_sequences for step" in line, line
    assert f"pid {pid}" in line and str(run / "checkpoints" / "step_") in line, line
    left = []
    for _ in range(100):  # Ray's processes go within seconds of the line
        left = alive([p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                      if environ_of(p).get("SHARDWISE_TEST_MARK") == mark])
        if not left:
            break
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]


GRPO_TOOLS = str(REPO_ROOT / "examples" / "grpo_tools.yaml")
LENGTH_REWARD = "def by_length(prompt, response, ground_truth):\n    return len(response) % 3 / 2\n"


def test_async_multi_turn_at_staleness_zero_equals_the_synchronous_run(tmp_path):
    """The tool model (tests/tool_model.py: it calls the calculator, sampled at temperature 0.5:
    most turns call, some trajectories differ) through examples/grpo_tools.yaml made small, rewarded by
    the final answer's length: the generator rank runs the multi-turn loop with its own tool
    processes, and at staleness 0 gives the synchronous run's trajectories and update, under
    GSPO (one ratio per trajectory, over its model tokens only: the tool turns are holes)."""
    from shardwise.data.batch import Batch

    folder = build_tool_model(tmp_path / "model")
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    common = [f"model.path={folder}", "train.global_batch_size=4", "rl.rollout.n=4", "train.micro_batch_size=16",
              "rl.rollout.max_new_tokens=8", "rl.rollout.temperature=0.5", "rl.multi_turn.max_turns=2", "rl.multi_turn.max_response_tokens=40",
              "rl.multi_turn.max_tool_response_tokens=8", "rl.multi_turn.tool_workers=2", "data.max_length=32",
              "rl.reward.function=length_reward:by_length", "train.optimizer.lr=1e-3",
              "rl.heldout_eval=false", "checkpoint.every_steps=0", "checkpoint.async=false",
              "rl.actor.policy_loss=gspo", "rl.actor.loss_agg_mode=seq-mean-token-mean"]  # a sequence-level loss

    sync, zero = sync_and_async_at_zero(tmp_path, GRPO_TOOLS, common, 1)
    a = same_runs(sync, zero)
    assert all(m["tools/calls_per_trajectory"] > 0 and m["actor/grad_norm"] > 0 for m in a), [
        {k: v for k, v in m.items() if k.startswith(("tools/", "multi_turn/", "actor/grad"))} for m in a]
    for step in (1, 2):
        x = Batch.from_bytes((sync / "batches" / f"step_{step:08d}.batch").read_bytes())
        assert 0 < int(x.tensors["response_mask"].sum()) < int(x.tensors["attention_mask"].sum())  # tool turns
    assert (zero / "logs" / "tools-gen0.log").is_file()  # the generator rank ran the tools


def sync_and_async_at_zero(tmp_path: Path, config: str, overrides: list[str], nproc: int) -> tuple[Path, Path]:
    """At once: the synchronous run of `config` on `nproc` ranks and the asynchronous one at
    staleness 0 on one generator rank more (their run folders under `tmp_path`, both
    recording their 2 steps' batches)."""
    def rl(name: str, ranks: int, *extra: str) -> Path:
        res = run_cli(["rl", config, "--nproc", str(ranks), f"run.dir={tmp_path / name}", *overrides,
                       "train.max_steps=2", "rl.record_batches=2", *extra], timeout=400, cwd=tmp_path)
        assert res.returncode == 0, f"{name}: {res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        return tmp_path / name

    return at_once(lambda: rl("sync", nproc), lambda: rl("zero", nproc + 1, *ASYNC, "rl.async.max_staleness=0"))


def same_runs(sync: Path, zero: Path) -> list[dict]:
    """Assert the two runs' steps 1 and 2 alike: metrics (timings apart), batches and exported
    weights, bitwise; the synchronous run's metrics."""
    from shardwise.data.batch import Batch

    a, b = metrics(sync), metrics(zero)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for m, n in zip(a, b):
        for key, value in m.items():
            if not key.startswith(("time", "perf/")):
                assert n[key] == value, key
    for step in (1, 2):
        x = Batch.from_bytes((sync / "batches" / f"step_{step:08d}.batch").read_bytes())
        y = Batch.from_bytes((zero / "batches" / f"step_{step:08d}.batch").read_bytes())
        for key, t in x.tensors.items():
            assert torch.equal(t, y.tensors[key]), (step, key)
    assert (sync / "hf" / "model.safetensors").read_bytes() == (zero / "hf" / "model.safetensors").read_bytes()
    return a


def test_async_with_ulysses_on_the_training_ranks_equals_the_synchronous_ulysses_run(tmp_path):
    """parallel.ulysses_size 2 on the training ranks (--nproc 3, one generator rank: one
    data-parallel rank of two sequence-parallel peers) at staleness 0 equals the synchronous
    run on the same two-peer layout (--nproc 2): the same batches, metrics and weights, bitwise.
    The generator group runs no Ulysses (its ranks hold whole sequences)."""
    (tmp_path / "toy_reward.py").write_text(TOY_REWARD)
    sync, zero = sync_and_async_at_zero(tmp_path, GRPO, [*COMMON, "parallel.ulysses_size=2", "rl.heldout_eval=false"], 2)
    assert same_runs(sync, zero)[1]["actor/grad_norm"] > 0
    places = json.loads((zero / "workers.json").read_text())
    assert len(places["rl"]) == 2 and len(places["gen"]) == 1


def test_async_lora_from_an_adapter_folder_generates_with_the_actors_merged_policy(tmp_path):
    """A LoRA actor started from an adapter folder (model.lora.path, B not 0: its policy is not
    the base's) at staleness 0, the reference's forward on the generator: the generator rank
    waits for the first push (version 0, the adapters merged into the base) before its first
    batch and takes every later version merged, so its behaviour log-probs are the actor's
    own on the same tokens up to the merge's fp32 rounding (~5e-7 here; the base's would be
    off by the adapters' whole effect), from step 1 on."""
    from peft import LoraConfig, get_peft_model

    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    base = build_full_model(load_config(None, [TINY_QWEN3]).model, seed=0)
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    adapter = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")
    (tmp_path / "toy_reward.py").write_text(TOY_REWARD)
    res = run_cli(["rl", GRPO, "--nproc", "2", f"run.dir={tmp_path / 'run'}", *COMMON, *ASYNC,
                   "rl.async.max_staleness=0", "rl.async.reference_on=generator", "model.lora.enabled=true",
                   f"model.lora.path={tmp_path / 'adapter'}", "train.max_steps=2", "rl.heldout_eval=false"],
                  timeout=400, cwd=tmp_path)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    steps = metrics(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["async/staleness_max"] == 0 and m["actor/grad_norm"] > 0, m
        assert m["rollout/log_prob_diff_abs_max"] < 1e-5, m  # the generator's policy is the actor's
        assert m["weight_sync/bytes"] == full_bytes, m  # pushed merged: the base's tensors, not the adapters
        assert m["actor/kl_loss"] > 1e-4, m  # the reference is the base, the policy the adapter folder's
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("nproc,extra,key,words", [
    (2, ["rl.async.generator_ranks=2"], "rl.async.generator_ranks", "leave none of the 2 to train on"),
    (1, [], "rl.async.generator_ranks", "run with --nproc 2 or more"),
    (3, ["train.global_batch_size=1", "rl.rollout.n=3"], "train.global_batch_size",
     "do not split over 2 data-parallel ranks"),
    (2, ["parallel.ulysses_size=2"], "parallel.ulysses_size", "does not divide the 1 training rank(s)"),
    (2, ["model.lora.enabled=true", "rl.rollout.engine=vllm", "rl.rollout.vllm.lora_sync=adapter"],
     "rl.rollout.vllm.lora_sync", "merged"),
    (2, ["rl.filter_groups=zero_variance", "rl.filter_groups_refill=true"], "rl.filter_groups_refill", "refill"),
    (2, ["rl.async.max_staleness=-1"], "rl.async.max_staleness", ">= 0"),
    (2, ["rl.async.reference_on=balanced", "rl.reference.enabled=false", "rl.actor.kl_loss.enabled=false"],
     "rl.async.reference_on", "rl.reference.enabled is false"),
], ids=["no_trainer_left", "one_rank", "rows", "ulysses_training_ranks", "lora_adapter_push", "refill", "staleness", "no_reference"])
def test_what_async_cannot_do_exits_2_before_ray(nproc, extra, key, words, tmp_path, capsys, monkeypatch):
    from shardwise.cli import main

    if "rl.rollout.engine=vllm" in extra and importlib.util.find_spec("vllm") is None:
        missing_optional("vllm", "vllm is not installed (make test installs it): the engine is checked first")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    code = main(["rl", GRPO, "--nproc", str(nproc), f"run.dir={tmp_path / 'run'}", "model.path=null", TINY_QWEN3,
                 *ASYNC[:1], *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"'{key}'" in err and words in err, err
    assert not (tmp_path / "run").exists()


def test_plan_shows_both_groups(capsys):
    from shardwise.cli import main

    assert main(["plan", GRPO, "--rl", "--world-size", "3", "model.path=null", TINY_QWEN3, *ASYNC,
                 "rl.reference.enabled=true"]) == 0
    out = capsys.readouterr().out
    assert "worker group rl (actor, ref) on 2 ranks; worker group gen (generator) on 1 rank" in out, out
    assert main(["plan", GRPO, "--rl", "--world-size", "3", "model.path=null", TINY_QWEN3, *ASYNC,
                 "rl.reference.enabled=true", "rl.async.reference_on=generator"]) == 0
    out = capsys.readouterr().out
    assert "worker group rl (actor) on 2 ranks; worker group gen (generator, ref) on 1 rank" in out, out
    assert main(["plan", GRPO, "--rl", "--world-size", "3", "--json", "model.path=null", TINY_QWEN3, *ASYNC]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(g["name"], g["ranks"]) for g in plan["worker_groups"]] == [("rl", 2), ("gen", 1)]
    assert plan["mesh"]["world_size"] == 2


# ------------------------------------------------- the schedule, on the controller alone


class Generated:
    """What `RayWorkerGroup.submit` hands back, for a generation made at once."""

    def __init__(self, batch):
        self.batch = batch

    def result(self, timeout_s=None, what=None):
        return self.batch


class GeneratorGroup:
    """A stand-in for the generator group that records each submitted generation and
    answers with `assemble_sequences` (every engine's output layout) from the policy
    version `versions(rows, call)` says, responses `width` tokens wide."""

    def __init__(self, versions, width):
        self.calls: list[tuple[list[str], int]] = []
        self.versions, self.width = versions, width

    def submit(self, name, prompts, min_version, reference_share, step=None):
        from shardwise.engine.generate import assemble_sequences

        # the reference stays on the actor: no share of it, and no rows scored while it is busy
        assert name == "generate_sequences" and reference_share == 0.0 and step is None
        self.calls.append((list(prompts.arrays["uid"]), min_version))
        n, width = len(prompts), self.width(len(self.calls))
        g = torch.Generator().manual_seed(len(self.calls))
        responses = torch.randint(3, 60, (n, width), generator=g)
        out = assemble_sequences(prompts, prompts.tensors["prompt_ids"], prompts.tensors["prompt_mask"], responses,
                                 -torch.rand(n, width, generator=g), torch.ones(n, width, dtype=torch.bool), 0, 1)
        out.arrays["version"] = np.asarray(self.versions(n, len(self.calls)), dtype=np.int64)
        return Generated(out)


def controller(tmp_path, *overrides: str):
    from shardwise.data.tokenizer import load_tokenizer, tokenizer_dir
    from shardwise.jobs import configs
    from shardwise.rl.async_trainer import AsyncController

    cfg, _ = configs.load(GRPO, ["model.path=null", TINY_QWEN3, f"run.dir={tmp_path}", *ASYNC,
                                 "train.global_batch_size=2", "rl.rollout.n=2", *overrides], None)
    tokenizer = load_tokenizer(tokenizer_dir(None, None, tmp_path, build=True))
    records = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(16)]
    return AsyncController(cfg, 2, records, tokenizer, str(tmp_path), None)


def test_throttle_submits_what_can_still_train_in_time_and_checkpoints_the_prompts_in_flight(tmp_path):
    ctl = controller(tmp_path, "rl.async.max_staleness=2", "train.max_steps=5")
    ctl.gen = gen = GeneratorGroup(lambda n, call: [0] * n, lambda call: 3)
    submitted = []
    for s in range(5):
        ctl.step = s
        before = len(gen.calls)
        ctl.submit_ahead()
        submitted.append([(uids[0].split("-")[0], least) for uids, least in gen.calls[before:]])
        if s == 1:  # a checkpoint after step 1: the sampler before step 1 drew, steps 1..3 in flight
            state = ctl.state_dict()
            assert state["sampler"] == {"epoch": 0, "position": 2} and state["async"]["in_flight"] == [1, 2, 3]
        pending, prompts = ctl.in_flight.pop(s)
        assert prompts.meta["seed"] == s and list(prompts.arrays["uid"]) == [f"{s}-0", f"{s}-0", f"{s}-1", f"{s}-1"]
    # AReaL's capacity rule: step t is submitted at step t - S, asking for version t - S (v0 at least)
    assert submitted == [[("0", 0), ("1", 0), ("2", 0)], [("3", 1)], [("4", 2)], [], []]


def test_drop_regenerates_the_rows_too_old_and_keeps_the_order(tmp_path):
    ctl = controller(tmp_path, "rl.async.max_staleness=1", "rl.async.on_stale=drop", "train.max_steps=4")
    # the first call's rows alternate versions 0 and 2; the regenerated ones are version 2
    ctl.gen = GeneratorGroup(lambda n, call: [0, 2] * (n // 2) if call == 1 else [2] * n, lambda call: 2 + call)
    ctl.step = ctl._next_step = 2  # as if steps 0 and 1 had trained
    ctl.submit_ahead()
    assert [least for _, least in ctl.gen.calls] == [0, 0]  # steps 2 and 3 (one further), never waiting
    first = ctl.in_flight[2][0].result()
    metrics: dict[str, float] = {}
    batch = ctl._take(2, metrics)
    assert metrics["async/dropped"] == 2 and ctl.gen.calls[-1] == (["2-0", "2-1"], 1)
    assert list(batch.arrays["uid"]) == ["2-0", "2-0", "2-1", "2-1"] and list(batch.arrays["version"]) == [2] * 4
    kept = batch.tensors["responses"][[1, 3]]
    assert torch.equal(kept[:, :first.tensors["responses"].shape[1]], first.tensors["responses"][[1, 3]])
    assert batch.tensors["input_ids"].shape == batch.tensors["attention_mask"].shape == \
        batch.tensors["rollout_log_probs"].shape


def test_balanced_reference_share_moves_toward_equal_waits():
    from shardwise.rl.async_trainer import rebalanced_share

    # the generator waited 0.4 s more than the trainer, the reference took 0.2 s in all: a
    # quarter of the (0.4 / (2 x 0.2)) = 1 share that would even the waits
    assert rebalanced_share(0.5, 0.4, 0.0, 0.2) == pytest.approx(0.75)
    assert rebalanced_share(0.5, 0.0, 0.4, 0.2) == pytest.approx(0.25)  # the trainer waited: the actor takes more
    assert rebalanced_share(0.9, 2.0, 0.0, 0.2) == 1.0 and rebalanced_share(0.1, 0.0, 2.0, 0.2) == 0.0
    assert rebalanced_share(0.3, 1.0, 0.0, 0.0) == 0.3  # no reference seconds measured: nothing to go by


def test_the_generator_scores_parts_only_while_the_trainer_is_busy():
    from shardwise.rl.workers.generator import steal_rows

    def never(*_):
        raise AssertionError("called")

    parts = []
    answers = iter([True, True, False])
    assert steal_rows(3, 20, 4, lambda: next(answers), lambda a, b: parts.append((a, b))) == 11
    assert parts == [(3, 7), (7, 11)]  # asked before each part; the third answer stopped it
    assert steal_rows(5, 20, 4, lambda: False, never) == 5  # the trainer waits: nothing more
    parts = []
    assert steal_rows(5, 20, 4, lambda: True, lambda a, b: parts.append((a, b))) == 20
    assert parts == [(5, 9), (9, 13), (13, 17), (17, 20)]  # every row once, the last part short
    assert steal_rows(20, 20, 4, never, never) == 20  # nothing left: the trainer is not even asked


def test_a_checkpoint_keeps_where_the_balance_moved_the_reference_share(tmp_path):
    ctl = controller(tmp_path / "a", "rl.async.reference_on=balanced", "rl.reference.enabled=true")
    assert ctl.reference_share == 0.5  # where it starts
    ctl.reference_share = 0.8125
    state = ctl.state_dict()
    assert state["async"]["reference_share"] == 0.8125
    resumed = controller(tmp_path / "b", "rl.async.reference_on=balanced", "rl.reference.enabled=true")
    resumed.load_state_dict(state)
    assert resumed.reference_share == 0.8125  # a resumed run splits the rows as the uninterrupted one would



def test_drop_at_staleness_1_keeps_what_a_generator_that_keeps_up_makes(tmp_path):
    """Issue 50: ``on_stale: drop`` at ``max_staleness: 1`` threw the whole batch away on
    every step from step 3 on. Drop submitted generation one step further than throttle
    (t <= s + S + 1) without waiting for weights, so a generator that keeps up made step t's
    batch at step t - S - 1 from the newest version then, t - S - 1: S + 1 old when t
    trains, always too old. A generator answering at once from the newest version
    published: nothing is dropped, and every row is at most S old."""
    ctl = controller(tmp_path, "rl.async.max_staleness=1", "rl.async.on_stale=drop", "train.max_steps=6")
    published = [0]
    ctl.gen = GeneratorGroup(lambda n, call: [published[0]] * n, lambda call: 2)
    dropped, staleness = [], []
    for s in range(6):
        ctl.step = s
        ctl.submit_ahead()
        metrics: dict[str, float] = {}
        batch = ctl._take(s, metrics)
        dropped.append(metrics["async/dropped"])
        staleness.append(int(s - batch.arrays["version"].min()))
        published[0] = s + 1  # the update of step s publishes version s + 1
    assert dropped == [0.0] * 6 and max(staleness) <= 1, (dropped, staleness)


class Failing:
    """A call whose result raises `error` (what a group's `Pending` raises for it)."""

    def __init__(self, error):
        self.error = error

    def result(self, timeout_s=None, what=None):
        raise self.error


def test_a_push_broken_by_a_dead_generator_rank_names_that_rank(tmp_path):
    """Issue 50: a generator rank killed while the actor pushed weights to it was reported as
    the actor's failure, in gloo's words (``rl.publishing the weights of version 2 failed on
    rank 0: BridgeError ... [gloo pair.cc] Connection closed by peer``), where a killed
    trainer rank reads ``lost rank 0 ... died (killed by SIGKILL)``. The controller now asks
    the generator group, and its line names the generator rank that died; a push that broke
    with every generator rank alive keeps its own line."""
    from shardwise.rl.cluster import WorkerError

    ctl = controller(tmp_path, "rl.async.max_staleness=1", "train.max_steps=4")
    broken = WorkerError("rl.publishing the weights of version 2 failed on rank 0: BridgeError: weights: the push "
                         "of version 1 failed (bucket 1 of 1): generator rank 0 did not answer: [gloo pair.cc] "
                         "Connection closed by peer")
    died = WorkerError("worker group 'gen' lost rank 0 in generate_sequences for step 3: its process (pid 4242 on "
                       "127.0.0.1) died (killed by SIGKILL)")

    class Groups:
        def __init__(self, name, answer):
            self.name, self.answer, self.calls = name, answer, []

        def submit(self, method, *args, **kwargs):
            self.calls.append(method)
            return self.answer

    ctl.groups["rl"] = Groups("rl", Failing(broken))
    ctl.step, ctl.gen = 1, Groups("gen", Generated(None))
    ctl.in_flight = {2: (Failing(died), None)}  # the step generating when the rank died
    with pytest.raises(WorkerError) as e:
        ctl.publish(2)
    assert str(e.value) == str(died) and e.value.__cause__ is broken
    ctl.in_flight = {}  # nothing in flight: a cheap call finds the dead rank
    ctl.gen = Groups("gen", Failing(died))
    with pytest.raises(WorkerError) as e:
        ctl.publish(2)
    assert str(e.value) == str(died) and ctl.gen.calls == ["weight_version"]
    ctl.gen = Groups("gen", Generated(0))  # every generator rank answers: the push's own line
    with pytest.raises(WorkerError) as e:
        ctl.publish(2)
    assert e.value is broken
