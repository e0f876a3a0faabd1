"""The step-time projection of `shardwise plan --hardware` (`shardwise.fsdp.projection`):
its formulas on hand-computed values, the hardware profiles, and bad input through the
CLI (exit 2, one line). No timing is measured or asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from dist.common import cli_status
from dist.launcher import REPO_ROOT, run_cli

from shardwise.config import load_config
from shardwise.config.validate import check_sft_batch, mesh_spec
from shardwise.errors import ConfigError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.comm import Collective, _crosses, step_comm
from shardwise.fsdp.projection import (
    REQUIRED,
    collective_seconds,
    default_mfu,
    flops_per_token,
    load_hardware,
    profiles,
    project,
    unit_flops_per_token,
)

LLAMA_8B = str(REPO_ROOT / "benchmarks" / "plan_configs" / "torchtitan_llama3_8b.yaml")
TINY = ["model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 64, max_position_embeddings: 64, "
        "tie_word_embeddings: false}", "train.micro_batch_size=2", "train.global_batch_size=16", "data.max_length=32"]


def tiny_plan(world: int, *overrides: str, gpus_per_node: int = 8):
    cfg = load_config(None, [*TINY, *overrides])
    spec = mesh_spec(cfg.parallel, world)
    model, plan = plan_for(cfg, spec)
    plan.comm = step_comm(model, plan, spec, accumulation=check_sft_batch(cfg.train, spec.dp_size),
                          micro_batch_size=cfg.train.micro_batch_size, max_length=cfg.data.max_length,
                          gpus_per_node=gpus_per_node)
    return model, plan


# ----------------------------------------------------------------------- formulas


def test_flops_per_token_is_torchtitans_count_for_llama_8b() -> None:
    """6 x (params - input embedding) + 12 l h q t: 8,030,261,248 parameters, 525,336,576
    of them the input embedding, 32 layers of 32 heads of 128, seq 8192."""
    cfg = load_config(LLAMA_8B, [])
    model, _ = plan_for(cfg, mesh_spec(cfg.parallel, 8))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    want = 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(model, 8192) == want
    assert abs(want / 57.92e9 - 1) < 1e-3


def test_unit_flops_add_up_to_the_model() -> None:
    model, plan = tiny_plan(2)
    per_unit = unit_flops_per_token(model, plan, 32)
    assert sum(per_unit.values()) == flops_per_token(model, 32)
    layer = 6 * sum(p.numel() for p in model.model.layers[0].parameters()) + 12 * 4 * 8 * 32
    assert per_unit["model.layers.0"] == per_unit["model.layers.1"] == layer


def test_ring_seconds_latency_plus_wire_bytes_over_effective_bandwidth() -> None:
    hw = load_hardware("h100")
    ag = Collective("all_gather", "forward", buffer_bytes=8 * 2**20, calls=3, group_size=8, inter_node=False)
    assert ag.wire_bytes == 3 * 8 * 2**20 * 7 // 8
    assert collective_seconds(ag, hw) == pytest.approx(3 * 7 * 2e-6 + 3 * 7 * 2**20 / (450e9 * 0.8))
    ar = Collective("all_reduce", "step", buffer_bytes=2**20, calls=1, group_size=4, inter_node=True)
    assert ar.wire_bytes == 2 * 2**20 * 3 // 4  # twice: reduce-scatter then all-gather
    assert collective_seconds(ar, hw) == pytest.approx(6 * 5e-6 + 1.5 * 2**20 / (50e9 * 0.9))


def test_groups_cross_nodes_by_rank_blocks() -> None:
    blocks8 = [list(range(s, s + 8)) for s in range(0, 16, 8)]
    assert not _crosses(blocks8, 8) and _crosses(blocks8, 4)
    assert _crosses([[0, 8], [1, 9]], 8)  # replicas of an HSDP 2x8 mesh: one per node


def test_hsdp_keeps_the_shard_group_inside_a_node_and_sends_replicas_between() -> None:
    _, plan = tiny_plan(16, "parallel.fsdp_size=8", "train.global_batch_size=32")
    for uc in plan.comm.units:
        assert {c.kind: c.inter_node for c in uc.collectives} == {
            "all_gather": False, "reduce_scatter": False, "all_reduce": True}


def test_default_mfu_lowered_by_recompute_forward() -> None:
    hw = load_hardware("h100")
    assert default_mfu(hw, 0.0) == hw.mfu["none"]
    assert default_mfu(hw, 1.0) == pytest.approx(hw.mfu["none"] * 3 / 4)
    assert hw.mfu["full"] == pytest.approx(hw.mfu["none"] * 3 / 4, abs=1e-3)
    model, plan = tiny_plan(2, "fsdp.recompute.modules=[model.layers.{*}]")
    assert project(model, plan, plan.comm, hw).mfu == pytest.approx(hw.mfu["none"] * 3 / 4)


def test_projection_compute_and_exposed_communication() -> None:
    """Compute = tokens x FLOPs / (peak x MFU); one rank has no collective, so nothing is
    exposed; across nodes the exposed part grows and the step is at least compute."""
    hw = load_hardware("h100")
    model, plan = tiny_plan(1)
    p = project(model, plan, plan.comm, hw, mfu=0.5)
    tokens = 2 * 32 * 8  # micro 2 x seq 32 x 8 micro-batches (global 16 on one rank)
    assert p.tokens_per_step_per_gpu == tokens
    assert p.compute_s == pytest.approx(tokens * flops_per_token(model, 32) / (989e12 * 0.5))
    assert p.comm_s == 0 and p.exposed_comm_s == pytest.approx(0, abs=1e-15)
    assert p.step_s == pytest.approx(p.compute_s + p.optimizer_s)
    _, many = tiny_plan(16, "train.global_batch_size=32", gpus_per_node=8)
    q = project(model, many, many.comm, hw, mfu=0.5)
    assert q.exposed_comm_s > 0 and q.step_s >= q.compute_s


def test_projection_hides_layer_gathers_behind_compute_of_a_large_model() -> None:
    """Llama 3.1 8B on 8 GPUs: the layers' all-gathers and reduce-scatters hide behind
    compute; what stays exposed is at most the root's gather and reduce-scatter and the
    first layer's gather (queued behind the root's before anything computes)."""
    cfg = load_config(LLAMA_8B, [])
    spec = mesh_spec(cfg.parallel, 8)
    model, plan = plan_for(cfg, spec)
    plan.comm = step_comm(model, plan, spec, accumulation=1, micro_batch_size=2, max_length=8192, gpus_per_node=8)
    hw = load_hardware("h100")
    p = project(model, plan, plan.comm, hw)
    root = sum(collective_seconds(c, hw) for c in plan.comm.unit("").collectives)
    first = next(c for c in plan.comm.unit("model.layers.0").collectives if c.phase == "forward")
    assert 0 < p.exposed_comm_s <= (root + collective_seconds(first, hw)) * 1.001
    assert p.exposed_comm_s < p.comm_s / 5


# ------------------------------------------------------------------------ profiles


@pytest.mark.parametrize("field, value, words", [
    ("memory_bandwidth", -3.35e12, "memory_bandwidth is -3350000000000.0, not a positive number of bytes/s"),
    ("intra_node_latency_s", -1e-6, "intra_node_latency_s is -1e-06, not a number of seconds >= 0"),
    ("inter_node_efficiency", 1.5, "inter_node_efficiency is 1.5, not a fraction in (0, 1]"),
    ("gpus_per_node", 0, "gpus_per_node is 0, not a whole number of GPUs, at least 1"),
    ("gpus_per_node", 2.5, "gpus_per_node is 2.5, not a whole number of GPUs"),
    ("memory_bytes", float("nan"), "memory_bytes is nan, not a positive number of bytes"),
    ("memory_bytes", True, "memory_bytes is True, not a positive number"),
    ("mfu", {"none": 0.3, "full": 0}, "mfu.full is 0, not a fraction in (0, 1]"),
    ("mfu", {"none": 0.3}, "mfu needs both 'none' and 'full'"),
    ("peak_flops", "fast", "peak_flops needs a FLOP/s per compute dtype"),
])
def test_a_profile_value_out_of_range_is_refused_naming_the_field(tmp_path, field, value, words) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump({**profiles()["h100"], field: value}))
    with pytest.raises(ConfigError) as e:
        load_hardware(str(path))
    assert e.value.key == f"--hardware {path}" and words in str(e.value), str(e.value)
    assert "the h100 profile has" in str(e.value)


def test_a_profile_with_quoted_numbers_still_loads(tmp_path) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump({k: str(v) if isinstance(v, float) else v for k, v in profiles()["h100"].items()}))
    assert load_hardware(str(path)).memory_bytes == 80.0e9


@pytest.mark.parametrize("name", ["h100", "h200", "a100-80gb"])
def test_builtin_profiles_have_every_field_and_a_source_for_each(name: str) -> None:
    data = profiles()[name]
    assert set(REQUIRED) <= set(data)
    assert set(REQUIRED) - {"description"} <= set(data["sources"])
    load_hardware(name)


def test_unknown_hardware_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown hardware 'h1000'.*h100, h200, a100-80gb"):
        load_hardware("h1000")


# ---------------------------------------------------------------- the CLI, end to end


def _profile_without(tmp_path, field: str):
    data = dict(profiles()["h100"])
    del data[field]
    path = tmp_path / f"no_{field}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch) -> None:
    cfg = str(REPO_ROOT / "examples" / "tiny_qwen3.yaml")
    no_bw = _profile_without(tmp_path, "inter_node_bandwidth")
    binary = tmp_path / "gpu.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    calls = {
        "unknown hardware": (["plan", cfg, "--world-size", "2", "--hardware", "h1000"],
                             "unknown hardware 'h1000' (known: h100, h200, a100-80gb"),
        "profile lacks a field": (["plan", cfg, "--world-size", "2", "--hardware", str(no_bw)],
                                  "the profile lacks inter_node_bandwidth"),
        "mesh cannot tile": (["plan", cfg, "--hardware", "h100", "--gpus-per-node", "4", "--scan", "8,12",
                              "train.global_batch_size=32", "parallel.fsdp_size=8"],
                             "parallel.fsdp_size': 8 does not divide the world size 12"),
        "nodes not filled": (["plan", cfg, "--hardware", "h100", "--world-size", "12",
                              "train.global_batch_size=48"], "12 ranks do not fill whole nodes of 8 GPUs"),
        # a profile read with the config loader's bounds, its numbers range-checked
        "binary profile": (["plan", cfg, "--world-size", "2", "--hardware", str(binary)],
                           f"'--hardware {binary}:2': is not UTF-8 text (byte 0x80 at offset 128)"),
        # 0 is a value given, not "not given" (the profile's 8)
        "zero gpus per node": (["plan", cfg, "--world-size", "2", "--hardware", "h100", "--gpus-per-node", "0"],
                               "'--gpus-per-node': 0 is not a positive number of GPUs"),
    }
    # One through the real command (the exit status and the lone line of a fresh process,
    # its imports' warnings included); the others in this process, where each costs no
    # process start (~9 s of CPU) and `main` returns the same status and line.
    argv, want = calls.pop("binary profile")
    proc = run_cli(argv, timeout=120, cwd=REPO_ROOT, fresh=True)
    assert proc.returncode == 2 and proc.stdout == "", f"exit {proc.returncode}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], proc.stderr
    monkeypatch.chdir(REPO_ROOT)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # the command sets them
        monkeypatch.setenv(var, "1")
    for name, (argv, want) in calls.items():
        code = cli_status(argv)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1 and want in lines[0], f"{name}: exit {code}\n{err}"


def test_cli_json_has_comm_bytes_and_projection() -> None:
    cfg = str(REPO_ROOT / "examples" / "tiny_qwen3.yaml")
    proc = run_cli(["plan", cfg, "--world-size", "2", "--hardware", "h100", "--json"], timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    kinds = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    assert all(set(u["comm_bytes"]) == kinds for u in out["units"])
    assert out["comm_bytes_per_step"] == {k: sum(u["comm_bytes"][k] for u in out["units"]) for k in kinds}
    assert out["comm_bytes_per_step"]["all_gather"] > 0
    assert {"tokens_per_s_per_gpu", "step_s", "compute_s", "exposed_comm_s", "fits"} <= set(out["projection"])


def test_plan_vs_published_benchmark_runs_and_passes_its_checks(tmp_path) -> None:
    """benchmarks/plan_vs_published.py (a few seconds): torchtitan's 8B rows within 25% of
    the published tokens/s per GPU, the 128 / 8 GPU ratio within 5%."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "plan_vs_published.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "plan_vs_published.json").read_text())
    assert all(out["checks"].values()) and len(out["rows"]) == 6
