"""Every benchmark of `make bench` runs from a clean clone.

Each case runs one benchmark script with ``--smoke`` (its smallest settings: one
configuration, one or two steps, tiny sizes) into a temporary folder, as its own process,
and checks that it exits 0, wrote its results file, and that the rows it reports ran: a
benchmark shows a failed run as an `unavailable: <error>` row and still exits 0, so the
exit code alone would pass a benchmark whose every run fails. Speed is not checked here
(benchmarks/README.md: speed is measured there, not asserted).

plan_vs_published.py is smoked in test_projection.py. rl_vs_trl.py's TRL side runs in a
venv of its own that the benchmark installs on its first run, which make test cannot do:
its smoke runs shardwise's side (``--skip-trl``) and writes TRL's inputs, and
`test_trl_worker_needs_nothing_of_shardwise_that_trl_lacks` checks that the TRL workers'
imports of shardwise (rl_vs_trl's and agentic.py's, whose TRL side runs in the same venv and
is not in `make bench`: it runs for minutes) load without shardwise's own dependencies
(pillow was one: the TRL venv failed with `No module named 'PIL'`).
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dist.launcher import REPO_ROOT, run_python

BENCH = REPO_ROOT / "benchmarks"


def _no_errors(rows: list[dict[str, Any]]) -> None:
    assert rows, "no rows"
    failed = {r.get("name", r.get("setting", "?")): r["error"] for r in rows if "error" in r}
    assert not failed, f"rows that did not run: {failed}"


def _check_train_configs(out: Path) -> None:
    res = json.loads((out / "train_configs.json").read_text())
    _no_errors(res["configs"])
    (row,) = res["configs"]
    assert row["name"] == "full_shard" and row["measured_steps"] == 1
    assert math.isfinite(row["final_loss"]) and row["state_bytes"] > 0 and row["activation_bytes"] > 0
    assert "full_shard" in (out / "train_configs.md").read_text()


def _check_encoder_memory(out: Path) -> None:
    res = json.loads((out / "encoder_memory.json").read_text())
    _no_errors(res["rows"])
    (row,) = res["rows"]
    assert row["name"] == "full_shard" and len(row["ranks"]) == 2
    assert all(r["state_bytes"]["total"] > 0 for r in row["ranks"])


def _check_gpu_throughput(out: Path) -> None:
    res = json.loads((out / "gpu_throughput.json").read_text())
    _no_errors(res["rows"])
    (row,) = res["rows"]
    assert row["name"] == "shardwise_no_compile" and row["timed_steps"] == 1
    assert row["tokens_per_s"] > 0 and math.isfinite(row["final_loss"])


def _check_rollout_engines(out: Path) -> None:
    res = json.loads((out / "rollout_engines.json").read_text())
    _no_errors(res["rows"])
    (row,) = res["rows"]
    assert (row["engine"], row["steps"]) == ("hf", 2)
    assert row["step_s"] > 0 and row["response_length"] > 0


def _check_lora(out: Path) -> None:
    res = json.loads((out / "lora.json").read_text())
    demo = {r["run"]: r for r in res["rows"] if r["table"] == "demo"}
    assert set(demo) == {"full", "lora"}
    for r in demo.values():
        # the plan's bytes per rank are what a rank holds (the benchmark's memory claim)
        assert r["plan_total"] == r["held_total"] > 0, r
        assert r["sft_tokens_per_s"] > 0 and math.isfinite(r["sft_final_loss"])
    assert demo["lora"]["held_total"] < demo["full"]["held_total"]
    plan = {r["run"] for r in res["rows"] if r["table"] == "plan"}
    assert plan == {"full", "lora", "lora_bf16_base"}
    assert "unavailable" not in (out / "lora.md").read_text()


def _check_rl_packing(out: Path) -> None:
    res = json.loads((out / "rl_packing.json").read_text())
    assert [r["setting"] for r in res["rows"]] == ["padded", "packed", "packed+budget"]
    padded, packed, _ = res["rows"]
    assert packed["padding_share"] == 0.0 < padded["padding_share"]
    assert all(r["update_tokens_per_s"] > 0 and r["saved_bytes_peak"] > 0 for r in res["rows"])


def _check_rl_vs_trl(out: Path) -> None:
    res = json.loads((out / "rl_vs_trl.json").read_text())
    assert set(res["runs"]) == {"shardwise"}, res["runs"]
    sw = res["runs"]["shardwise"]
    assert "error" not in sw, sw
    assert [s["step"] for s in sw["steps"]] == [1, 2]
    assert sw["update_tokens_per_step"] > 0 and 0.0 <= sw["update_padding_share"] < 1.0
    # start-up and wall time, and the run's own count of where its start-up went
    assert 0 < sw["startup_s"] < sw["wall_s"] and {"worker_groups", "model_load", "total"} <= set(
        sw["startup_parts"]), sw["startup_parts"]
    # TRL's inputs: the same prompts shardwise's sampler drew, 2 prompts per step
    spec = json.loads((out / "trl" / "spec.json").read_text())
    assert len(Path(spec["records_path"]).read_text().splitlines()) == 2 * 2
    assert spec["grpo_config"]["max_steps"] == 2


def _check_rl_async(out: Path) -> None:
    res = json.loads((out / "rl_async.json").read_text())
    (runs,) = res["runs"].values()
    assert set(runs) == {"sync", "async_s1"}, runs
    _no_errors(list(runs.values()))
    sync, one = runs["sync"], runs["async_s1"]
    for r in (sync, one):
        assert [s["step"] for s in r["steps"]] == [1, 2] and r["samples_per_s"] > 0
        assert 0 < r["startup_s"] < r["wall_s"]
    # the asynchronous run's own figures: both sides' waits, staleness within the bound
    assert one["asynchronous"] and not sync["asynchronous"]
    assert one["trainer_idle"] is not None and one["generator_idle"] is not None
    assert 0 <= one["staleness_mean"] <= one["staleness_max"] <= 1
    assert one["samples_x"] > 0 and sync["samples_x"] == 1.0
    # the 8-GPU projection: projected step times, the best split named
    best = res["projection"]["best"]
    assert best["x_sync"] > 0 and 1 <= best["generator_gpus"] < 8
    assert "Projected, not measured" in (out / "rl_async.md").read_text()


def _check_algorithms(out: Path) -> None:
    res = json.loads((out / "algorithms.json").read_text())
    (runs,) = res["runs"].values()
    assert set(runs) == {"gspo"}, runs
    _no_errors(list(runs.values()))
    r = runs["gspo"]
    assert [s["step"] for s in r["steps"]] == [1] and r["step_s"] > 0 and 0 < r["startup_s"] < r["wall_s"]
    # the held-out accuracy at step 0 and after the step: what the benchmark's figures are read from
    assert [e["step"] for e in r["evals"]] == [0, 1] and all(0 <= e["accuracy"] <= 1 for e in r["evals"])
    assert r["overrides"][0].startswith("model.path=") and "eval.num_prompts=4" in r["overrides"]
    assert "| gspo | `examples/gspo.yaml` | 1 |" in (out / "algorithms.md").read_text()


@dataclass(frozen=True)
class Smoke:
    """One benchmark's smoke: its script, extra arguments, its main results file, what to check."""

    script: str
    result: str
    check: Callable[[Path], None]
    args: tuple[str, ...] = ()
    needs_sft_model: bool = False
    """--model: the SFT demo model (the session's `sft_demo_model`; a clean clone has no runs/)."""


SMOKES = {
    "train_configs": Smoke("train_configs.py", "train_configs.json", _check_train_configs),
    "encoder_memory": Smoke("encoder_memory.py", "encoder_memory.json", _check_encoder_memory),
    "gpu_throughput": Smoke("gpu_throughput.py", "gpu_throughput.json", _check_gpu_throughput),
    "rollout_engines": Smoke("rollout_engines.py", "rollout_engines.json", _check_rollout_engines),
    "lora": Smoke("lora.py", "lora.json", _check_lora),
    "rl_packing": Smoke("rl_packing.py", "rl_packing.json", _check_rl_packing),
    "rl_vs_trl": Smoke("rl_vs_trl.py", "rl_vs_trl.json", _check_rl_vs_trl, needs_sft_model=True),
    "rl_async": Smoke("rl_async.py", "rl_async.json", _check_rl_async, ("--task", "reverse"), needs_sft_model=True),
    "algorithms": Smoke("algorithms.py", "algorithms.json", _check_algorithms, needs_sft_model=True),
}


def test_every_benchmark_of_make_bench_has_a_smoke() -> None:
    """A benchmark added to `make bench` without a smoke here fails this test."""
    bench = (REPO_ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    scripts = {Path(w).name for w in bench.split() if w.startswith("benchmarks/") and w.endswith(".py")}
    assert scripts, bench
    smoked = {s.script for s in SMOKES.values()} | {"plan_vs_published.py"}  # that one: test_projection.py
    assert scripts <= smoked, f"benchmarks of make bench without a smoke: {sorted(scripts - smoked)}"


@pytest.mark.parametrize("name", list(SMOKES))
def test_benchmark_smoke(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    smoke = SMOKES[name]
    out = tmp_path / "out"
    argv = [BENCH / smoke.script, "--smoke", "--out", out, *smoke.args]
    if smoke.needs_sft_model:
        argv += ["--model", request.getfixturevalue("sft_demo_model")]
    res = run_python(argv, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert (out / smoke.result).is_file(), res.stdout[-3000:]
    smoke.check(out)


# Packages shardwise depends on that TRL's venv (torch, trl, accelerate, datasets,
# transformers and what they require) does not promise. pydantic is in a TRL 1.16 venv only
# through typer (huggingface_hub's CLI), so the worker must not lean on it either.
NOT_IN_TRL_VENV = ("PIL", "pydantic", "peft", "matplotlib", "ray", "vllm", "tensorboard", "wandb", "mlflow")
_BLOCKER = """
import importlib, importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
for module in sys.argv[2:]:
    importlib.import_module(module)
"""


def _shardwise_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             and n.module and n.module.partition(".")[0] == "shardwise"}
            | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
               if a.name.partition(".")[0] == "shardwise"})


def test_trl_worker_needs_nothing_of_shardwise_that_trl_lacks() -> None:
    """The shardwise modules benchmarks/_trl_grpo_worker.py and _trl_agentic_worker.py
    import (and the tools the agentic one imports: the built-in calculator and
    benchmarks/_agentic_tools.py's) load with shardwise's dependencies that TRL's venv lacks
    hidden; and hiding them is what fails when a module does need one
    (shardwise.data.visual's drawing needs pillow)."""
    per_worker = {w: _shardwise_imports(BENCH / w) for w in ("_trl_grpo_worker.py", "_trl_agentic_worker.py")}
    assert all(per_worker.values()), f"a worker imports no shardwise module: update this test ({per_worker})"
    modules = sorted(set().union(*per_worker.values(), _shardwise_imports(BENCH / "_agentic_tools.py"),
                                 {"shardwise.agents.builtin"}))
    env_args = [sys.executable, "-c", _BLOCKER, ",".join(NOT_IN_TRL_VENV)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    res = subprocess.run([*env_args, *modules], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    # the blocker works: an image is drawn with pillow, hidden here
    draw = subprocess.run([*env_args[:2], _BLOCKER + "\nfrom shardwise.data import visual\n"
                           "visual.colour_examples(1, 0)", ",".join(NOT_IN_TRL_VENV)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert draw.returncode != 0 and "No module named 'PIL'" in draw.stderr, draw.stderr[-2000:]
