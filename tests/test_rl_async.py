"""Asynchronous RL (``rl.async``) end to end through the real CLI: a training group and a
generator group of Ray workers, the weight bridge between them, the single controller in
the CLI process.

- exact at zero: ``--nproc 2`` with one generator rank and ``max_staleness: 0`` equals the
  synchronous ``--nproc 1`` run on the same seed: the same batches (samples, log-probs,
  scores, advantages), the same metrics, bitwise the same exported weights;
- ``max_staleness: 1`` (with ``on_stale: drop``, which runs ahead without waiting for
  weights) measures the held-out accuracy through the generator group, logs its staleness
  (never above 1) and the idle figures of both sides, and checkpoints the policy version and
  the steps in flight; its generator rank, killed mid-run, ends the run with exit 1 and one
  line naming the group, the rank, what it was doing and the last checkpoint, and leaves no
  process of the run behind;
- what the asynchronous run cannot do is refused before Ray starts (exit 2, one line), and
  ``shardwise plan --rl`` shows both groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, SRC_DIR, _kill_tree, alive, at_once, run_cli

pytest.importorskip("ray")

GRPO = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")
TOY_REWARD = "def ones(prompt, response, ground_truth):\n    return response.count('1') / 4\n"
COMMON = ["model.path=null", TINY_QWEN3, "train.global_batch_size=4", "train.micro_batch_size=8",
          "rl.rollout.n=4", "rl.rollout.max_new_tokens=4", "train.optimizer.lr=1e-3",
          "rl.reward.function=toy_reward:ones", "checkpoint.every_steps=0"]
ASYNC = ["rl.async.enabled=true", "rl.async.generator_ranks=1"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The synchronous run on 1 rank, the asynchronous one at staleness 0 on 1 + 1 and at
    staleness 1 on 1 + 1, side by side (each its own command and Ray cluster)."""
    tmp = tmp_path_factory.mktemp("async_runs")
    (tmp / "toy_reward.py").write_text(TOY_REWARD)

    def rl(name: str, nproc: int, *overrides: str):
        res = run_cli(["rl", GRPO, "--nproc", str(nproc), f"run.dir={tmp / name}", *COMMON, *overrides],
                      timeout=400, cwd=tmp)
        return tmp / name, res

    exact = ["train.max_steps=2", "rl.record_batches=2", "rl.heldout_eval=false"]
    sync, zero, killed = at_once(
        lambda: rl("sync", 1, *exact),
        lambda: rl("zero", 2, *exact, *ASYNC, "rl.async.max_staleness=0"),
        lambda: kill_the_generator(tmp))
    return {"sync": sync, "zero": zero, "killed": killed}


def kill_the_generator(tmp: Path) -> dict:
    """A long asynchronous run at max_staleness 1 (on_stale drop: generation runs ahead
    without waiting for weights; the held-out accuracy measured through the generator group
    first) whose generator rank is killed by SIGKILL once three steps were logged and a
    checkpoint committed; its exit status, output, the rank's pid and the run's mark (an
    environment variable every process of the run inherits)."""
    run = tmp / "killed"
    mark = f"shardwise-test-{os.getpid()}-{time.monotonic_ns()}"
    out = open(tmp / "killed.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "rl", GRPO, "--nproc", "2", f"run.dir={run}", *COMMON, *ASYNC,
         "rl.async.max_staleness=1", "rl.async.on_stale=drop", "train.max_steps=100000", "checkpoint.every_steps=1",
         "checkpoint.async=false"],
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


def test_async_at_staleness_zero_equals_the_synchronous_run(runs):
    from shardwise.data.batch import Batch

    sync, zero = finished(runs, "sync"), finished(runs, "zero")
    a, b = metrics(sync), metrics(zero)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    assert a[1]["actor/grad_norm"] > 0  # the toy reward varies within groups: real updates
    for m, n in zip(a, b):
        for key, value in m.items():
            if not key.startswith(("time", "perf/")):
                assert n[key] == value, key
        assert n["async/staleness_max"] == 0 and n["async/dropped"] == 0
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
    assert lines[0]["async/staleness_max"] == 0  # the first step has no older policy to come from
    assert lines[0]["time/startup/eval"] > 0  # the held-out accuracy, through the generator group
    # a checkpoint holds the policy version and the steps in flight (generated again on resume)
    last = sorted((k["run"] / "checkpoints").glob("step_*/COMMITTED"))[-1].parent
    extra = json.loads((last / "meta.json").read_text())["extra"]
    step = int(last.name.removeprefix("step_"))
    assert extra["async"]["policy_version"] == step and extra["step"] == step, extra
    assert extra["async"]["in_flight"] and all(t >= step for t in extra["async"]["in_flight"]), extra


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
                      if _environ(p).get("SHARDWISE_TEST_MARK") == mark])
        if not left:
            break
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


@pytest.mark.parametrize("nproc,extra,key,words", [
    (2, ["rl.async.generator_ranks=2"], "rl.async.generator_ranks", "leave none of the 2 to train on"),
    (1, [], "rl.async.generator_ranks", "run with --nproc 2 or more"),
    (3, ["train.global_batch_size=1", "rl.rollout.n=3"], "train.global_batch_size",
     "do not split over 2 data-parallel ranks"),
    (3, ["parallel.ulysses_size=2"], "parallel.ulysses_size", "does not run Ulysses"),
    (2, ["model.lora.enabled=true"], "model.lora.enabled", "LoRA"),
    (2, ["rl.filter_groups=zero_variance", "rl.filter_groups_refill=true"], "rl.filter_groups_refill", "refill"),
    (2, ["rl.async.max_staleness=-1"], "rl.async.max_staleness", ">= 0"),
], ids=["no_trainer_left", "one_rank", "rows", "ulysses", "lora", "refill", "staleness"])
def test_what_async_cannot_do_exits_2_before_ray(nproc, extra, key, words, tmp_path, capsys, monkeypatch):
    from shardwise.cli import main

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
    assert main(["plan", GRPO, "--rl", "--world-size", "3", "--json", "model.path=null", TINY_QWEN3, *ASYNC]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(g["name"], g["ranks"]) for g in plan["worker_groups"]] == [("rl", 2), ("gen", 1)]
    assert plan["mesh"]["world_size"] == 2
