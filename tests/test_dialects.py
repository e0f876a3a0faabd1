"""Config dialects (`shardwise convert`, `--dialect`): every YAML example of the design
documents in the ROLL, MindSpeed and RLinf dialects converts, plans and trains on a tiny
model; bad dialect input exits 2 with one line naming the file and key.

The fixtures under tests/dialects/ are the seeds' snippets as written (MindSpeed's seed is a
table without a YAML example: its fixtures use every key of the table and its pattern
syntax). Plans run on them as they are, at the device count the seed states. Training runs
2 ranks, so `TRAIN_EDITS` fits each to that: device lists of 2, fewer accumulation steps,
and the module paths of the model the seed was written for (RLinf's pi0, a Qwen-VL vision
tower) replaced by paths of the tiny text model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from dist.common import (
    TINY_QWEN3,
    TINY_QWEN3_MOE,
    TINY_QWEN25_VL,
    loss_tokens,
    make_global_batch,
    make_vl_batch,
    micro_batches_of,
)
from dist.launcher import run_cli, run_ranks

from shardwise.cli import main
from shardwise.config import apply_overrides, config_from_dict, load_config
from shardwise.config.dialects import (
    convert,
    load_dialect_config,
    parse_device_mapping,
    read_dialect,
)
from shardwise.config.load import _yaml
from shardwise.errors import ConfigError

FIXTURES = Path(__file__).parent / "dialects"
# MindSpeed's seed patterns reach layer 23 ({0-23}) and 5 ({1,3,5}).
TINY_QWEN3_24 = TINY_QWEN3.replace("num_hidden_layers: 2", "num_hidden_layers: 24")

RLINF_PATHS = (  # pi0's modules -> modules of the tiny Qwen3 with the same role
    ("'normalize_inputs.buffer_observation_state'", "'model.norm'"),
    ("'normalize_targets.buffer_action'", "'model.rotary_emb'"),  # a module holding only buffers
    ("'model.state_proj'", "'model.layers.0.mlp'"),
    ("'model.action_proj'", "'model.layers.0.self_attn'"),
    ("'model.value_proj'", "'model.embed_tokens'"),
    ("'model.lm_head'", "'lm_head'"),
    ("'model.paligemma_with_expert.paligemma'", "'model.layers.1'"),
)


BATCH_16 = ("train.micro_batch_size=1", "train.global_batch_size=16")


@dataclass(frozen=True)
class Example:
    """One seed example: its fixture, the tiny model, the world size of its plan, what the
    conversion must hold, and the text edits that fit it to a 2-rank training run."""

    file: str
    dialect: str
    model: str = TINY_QWEN3
    world: int | None = None
    """--world-size of the plan when the file names no devices (the count the seed states)."""
    converted: dict = field(default_factory=dict)
    """Dotted shardwise keys the conversion must write, with their values."""
    plan_edits: tuple[tuple[str, str], ...] = ()
    overrides: tuple[str, ...] = ()
    """What the file leaves to shardwise's own keys besides the model (plan and training)."""
    plan_overrides: tuple[str, ...] = ()
    """Batch sizes for a fragment that names none at a large world (shardwise's default
    global batch of 16 does not split over 16 ranks x micro-batch 4)."""
    train_edits: tuple[tuple[str, str], ...] = ()


EXAMPLES = [
    Example("roll_train.yaml", "roll", converted={
        "model.dtype": "bf16", "parallel.fsdp_size": 16, "fsdp.mixed_precision.reduce_dtype": "fp32",
        "fsdp.recompute.modules": ["model.layers.{*}"], "train.optimizer.lr": 1e-6,
        "train.optimizer.betas": [0.9, 0.999], "train.scheduler.warmup_steps": 20, "train.scheduler.name": "linear",
        "train.micro_batch_size": 1, "train.global_batch_size": 1 * 32 * 16, "infer.batch_size": 4},
        train_edits=(("list(range(0,16))", "list(range(0,2))"), ("gradient_accumulation_steps: 32",
                                                                 "gradient_accumulation_steps: 4"))),
    Example("roll_infer.yaml", "roll", plan_overrides=("train.micro_batch_size=1", "train.global_batch_size=8"),
            converted={
        "parallel.fsdp_size": 4, "fsdp.recompute.modules": [], "rl.reference.enabled": True, "infer.batch_size": 1},
        train_edits=(("list(range(0,8))", "list(range(0,2))"), ("fsdp_size: 4", "fsdp_size: 2"))),
    Example("roll_ulysses.yaml", "roll", converted={
        "parallel.ulysses_size": 2, "parallel.fsdp_size": 4, "train.optimizer.weight_decay": 0.01,
        "train.global_batch_size": 1 * 256 * 4},  # 8 devices / ulysses 2 = 4 data-parallel ranks
        train_edits=(("list(range(0,8))", "list(range(0,2))"), ("gradient_accumulation_steps: 256",
                                                                "gradient_accumulation_steps: 4"))),
    Example("roll_mesh_fsdp.yaml", "roll", world=16, plan_overrides=BATCH_16, converted={"parallel.fsdp_size": 16}),
    Example("roll_mesh_hsdp.yaml", "roll", world=16, plan_overrides=BATCH_16, converted={"parallel.fsdp_size": 8}),
    Example("roll_mesh_ulysses.yaml", "roll", world=8, converted={"parallel.ulysses_size": 2,
                                                                  "parallel.fsdp_size": 4}),
    Example("roll_text.yaml", "roll", world=16, plan_overrides=BATCH_16, converted={
        "fsdp.wrap.classes": ["Qwen3DecoderLayer"], "fsdp.recompute.modules": ["Qwen3DecoderLayer"]}),
    Example("roll_vl.yaml", "roll", model=TINY_QWEN25_VL, world=8,
            converted={"model.freeze": ["vision_model"], "parallel.ulysses_size": 2},
            # ROLL's gradient checkpointing converts to model.layers.{*} (decoder-only LMs); a VL
            # model's decoder layers sit under model.language_model
            overrides=("fsdp.recompute.modules=[model.language_model.layers.{*}]",),
            plan_edits=(("vision_model", "model.visual"),),  # ROLL's prefix -> HF Qwen2.5-VL's tower
            # Ulysses does not split image tokens: `shardwise train` refuses it for a VL model
            # (tests/test_vl.py), so the training run takes the seed's other keys on 2 ranks.
            train_edits=(("vision_model", "model.visual"), ("ulysses_size: 2", "ulysses_size: 1"))),
    Example("roll_moe.yaml", "roll", model=TINY_QWEN3_MOE, world=16, plan_overrides=BATCH_16, converted={
        "fsdp.moe_expert_patch": True, "fsdp.wrap.moe_experts": ["Qwen3MoeMLP"]}),
    Example("rlinf_layered.yaml", "rlinf", world=2, converted={
        "fsdp.mixed_precision.param_dtype": "bf16",
        "fsdp.module_precision": {"normalize_inputs.buffer_observation_state": "fp32",
                                  "normalize_targets.buffer_action": "fp32", "model.state_proj": "fp32",
                                  "model.value_proj": "fp32", "model.paligemma_with_expert.paligemma": "bf16"}},
            plan_edits=RLINF_PATHS, train_edits=RLINF_PATHS),
    Example("rlinf_full.yaml", "rlinf", world=2, converted={
        "parallel.sharding_strategy": "no_shard", "train.micro_batch_size": 8, "train.global_batch_size": 64},
            plan_edits=RLINF_PATHS, train_edits=RLINF_PATHS),
    # MindSpeed takes the model's dtype from Megatron's --bf16, outside its fsdp2 table: the
    # ignored MLPs keep it and so compute in bf16 like the units around them.
    Example("mindspeed_fsdp2.yaml", "mindspeed", model=TINY_QWEN3_24, world=2, overrides=("model.dtype=bf16",),
            converted={
        "parallel.fsdp_size": "auto", "fsdp.mixed_precision.output_dtype": "bf16",
        "fsdp.wrap.modules": ["model.layers.{*}"], "fsdp.ignored_modules": ["model.layers.{1,3,5}.mlp"],
        "fsdp.recompute.use_reentrant": True, "fsdp.offload.pin_memory": False, "fsdp.prefetch.backward": 1}),
    Example("mindspeed_defaults.yaml", "mindspeed", model=TINY_QWEN3_24, world=2, converted={
        # MindSpeed's defaults, where shardwise's differ: sharding_size 1 (replicas), param_dtype
        # the model's, reduce_dtype none (= param_dtype), use_reentrant true, pin_memory false
        "parallel.sharding_strategy": "no_shard", "fsdp.mixed_precision.param_dtype": "fp32",
        "fsdp.mixed_precision.reduce_dtype": "fp32", "fsdp.recompute.use_reentrant": True,
        "fsdp.offload.pin_memory": False}),
]
IDS = [e.file.removesuffix(".yaml") for e in EXAMPLES]


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _edited(example: Example, edits: tuple[tuple[str, str], ...], tmp: Path) -> Path:
    text = (FIXTURES / example.file).read_text()
    for old, new in edits:  # RLINF_PATHS covers both RLinf examples; the first lacks two of them
        text = text.replace(old, new)
    out = tmp / example.file
    out.write_text(text)
    return out


# ---------------------------------------------------------------------- conversion


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_every_seed_example_converts_with_a_comment_naming_each_source_key(example: Example) -> None:
    conv = read_dialect(FIXTURES / example.file, example.dialect)
    for key, want in example.converted.items():
        assert _get(conv.config, key) == want, key

    text = conv.to_yaml()
    # the written file is the same config (shardwise's YAML loader reads it back) ...
    assert _yaml(text) == conv.config
    # ... and every key line names where it came from
    body = [ln for ln in text.splitlines() if not ln.startswith("#")]
    leaf_lines = [ln for ln in body if not ln.rstrip().endswith(":")]
    assert len(leaf_lines) == len(conv.origins)
    for ln in leaf_lines:
        assert "  # <- " in ln, ln
    assert sorted(ln.split("  # <- ", 1)[1] for ln in leaf_lines) == sorted(conv.origins.values())
    assert text.startswith(f"# shardwise config converted from {FIXTURES / example.file}")


def test_comments_name_the_dialect_keys_and_the_dialect_defaults() -> None:
    lines = read_dialect(FIXTURES / "roll_train.yaml", "roll").to_yaml().splitlines()
    assert "  fsdp_size: 16  # <- actor_train.strategy_args.strategy_config.fsdp_size" in lines
    assert "  dtype: bf16  # <- actor_train.model_args.dtype" in lines
    assert ("  global_batch_size: 512  # <- actor_train.training_args.per_device_train_batch_size x "
            "actor_train.training_args.gradient_accumulation_steps x 16 data-parallel ranks "
            "(device_mapping / ulysses_size)") in lines
    assert ("    name: linear  # <- actor_train.training_args.lr_scheduler_type "
            "(HF TrainingArguments default: linear)") in lines
    assert any(ln.startswith("# not converted: actor_train.training_args.num_train_epochs: 50") for ln in lines)
    ms = read_dialect(FIXTURES / "mindspeed_defaults.yaml", "mindspeed").to_yaml().splitlines()
    assert "    use_reentrant: true  # <- use_reentrant (MindSpeed default: true)" in ms
    assert "    pin_memory: false  # <- pin_memory (MindSpeed default: false)" in ms


def test_convert_cli_writes_the_config_that_dialect_loads(tmp_path, capsys) -> None:
    out = tmp_path / "converted.yaml"
    src = FIXTURES / "roll_ulysses.yaml"
    assert main(["convert", "--from", "roll", str(src), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "num_train_epochs" in err and str(out) in err
    written = load_config(out, [TINY_QWEN3])
    loaded, conv = load_dialect_config(src, "roll", [TINY_QWEN3])
    assert written == loaded
    assert conv.world_size == 8
    assert main(["convert", "--from", "rlinf", str(FIXTURES / "rlinf_full.yaml")]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["parallel"] == {"sharding_strategy": "no_shard"}


def test_overrides_complete_and_win_over_the_converted_keys() -> None:
    cfg, _ = load_dialect_config(FIXTURES / "roll_text.yaml", "roll",
                                 [TINY_QWEN3, "parallel.fsdp_size=auto", "data.max_length=16"])
    assert cfg.model.config["model_type"] == "qwen3"
    assert cfg.parallel.fsdp_size == "auto"  # the file said 16
    assert cfg.fsdp.wrap.classes == ["Qwen3DecoderLayer"] and cfg.data.max_length == 16


@pytest.mark.parametrize(("text", "want"), [
    ("list(range(0,16))", list(range(16))),
    ("list(range(8))", list(range(8))),
    (" list( range( 0 , 8 , 2 ) ) ", [0, 2, 4, 6]),
    ("[0, 1, 2]", [0, 1, 2]),
    ([0, 1], [0, 1]),
])
def test_device_mapping_grammar(text, want) -> None:
    assert parse_device_mapping(text) == want


@pytest.mark.parametrize("text", [
    "os.system('touch PWNED')", "__import__('os').system('id')", "list(range(0,8)) + list(range(8,16))",
    "list(range(8,0))", "range(0,8)", "[0, 1, x]", "", 8, [True], [-1],
])
def test_device_mapping_grammar_refuses_everything_else(text) -> None:
    with pytest.raises(ConfigError, match="is not a device list.*never evaluates code.*list\\(range\\(0,8\\)\\)"):
        parse_device_mapping(text)


# ---------------------------------------------------------------------- plan


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_plan_of_every_seed_example(example: Example, tmp_path, capsys) -> None:
    path = _edited(example, example.plan_edits, tmp_path)
    world = ["--world-size", str(example.world)] if example.world else []
    assert main(["plan", str(path), "--dialect", example.dialect, example.model, *example.overrides,
                 *example.plan_overrides,
                 "--json", *world]) == 0
    plan = json.loads(capsys.readouterr().out)
    units = {u["path"]: u for u in plan["units"]}
    mesh = plan["mesh"]
    name = example.file.removesuffix(".yaml")
    expected_mesh = {  # the meshes the seeds describe
        "roll_train": [16], "roll_infer": [2, 4], "roll_ulysses": [2, 4], "roll_mesh_fsdp": [16],
        "roll_mesh_hsdp": [2, 8], "roll_mesh_ulysses": [2, 4], "roll_text": [16], "roll_vl": [2, 4],
        "roll_moe": [16], "rlinf_layered": [2], "rlinf_full": [2, 1], "mindspeed_fsdp2": [2],
        "mindspeed_defaults": [2, 1]}[name]
    assert mesh["shape"] == expected_mesh
    assert mesh["ulysses"] == (2 if name in ("roll_ulysses", "roll_mesh_ulysses", "roll_vl") else 1)
    layers = [p for p in units if re.fullmatch(r"model\.(language_model\.)?layers\.\d+", p)]
    if example.dialect == "roll":
        gc = name != "roll_infer"
        assert layers and all(units[p]["recompute"] is gc for p in layers)
        assert all(units[p]["param_dtype"] == "bf16" and units[p]["reduce_dtype"] == "fp32" for p in layers)
    if name == "roll_train":
        assert plan["model_dtype"] == "bf16" and plan["world_size"] == 16  # from device_mapping
    if name == "roll_text":
        assert all(units[p]["sources"] == ["class:Qwen3DecoderLayer"] for p in layers)
    if name == "roll_vl":  # the tower frozen, its blocks units that do not cast their inputs
        assert plan["frozen"] and all(p.startswith("model.visual.") for p in plan["frozen"])
        vision = [u for p, u in units.items() if p.startswith("model.visual.blocks.")]
        assert len(vision) == 2 and not any(u["cast_forward_inputs"] for u in vision)
    if name == "roll_moe":
        experts = [p for p, u in units.items() if u["sources"] == ["moe_experts:Qwen3MoeMLP"]]
        assert len(experts) == 2 * 8  # 2 layers x 8 experts, each its own unit
    if name.startswith("rlinf"):
        fp32 = ["model.norm", "model.embed_tokens", "model.layers.0.mlp"]
        fp32 += ["model.layers.0.self_attn", "lm_head"] if name == "rlinf_full" else []
        assert [p for p, u in units.items() if u["param_dtype"] == "fp32"] == sorted(fp32, key=list(units).index)
        assert units["model.layers.1"]["param_dtype"] == "bf16" and units[""]["param_dtype"] == "bf16"
        assert plan["buffer_casts"]["model.rotary_emb"] == "fp32"
    if name == "mindspeed_fsdp2":
        assert len(layers) == 24 and all(units[p]["sources"] == ["modules:model.layers.{*}"] for p in layers)
        assert plan["ignored_modules"] == ["model.layers.1.mlp", "model.layers.3.mlp", "model.layers.5.mlp"]
        assert units[""]["output_dtype"] == "bf16" and plan["use_reentrant"] is True
        assert all(units[p]["recompute"] for p in layers)
    if name == "mindspeed_defaults":
        assert len(layers) == 24 and plan["use_reentrant"] is True
        assert [p for p in layers if units[p]["recompute"]] == ["model.layers.1", "model.layers.3", "model.layers.5"]
        assert all(u["param_dtype"] == "fp32" and u["reduce_dtype"] == "fp32" for u in units.values())


# ---------------------------------------------------------------------- training


def _train_examples(rank: int, world: int, cases: list[tuple[str, str, str, list[str]]]) -> dict:
    """Each rank: two optimizer steps of every converted example, one engine after the other."""
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine
    from shardwise.models import vision

    runtime = init_distributed(timeout_s=60)
    out = {}
    for name, path, dialect, overrides in cases:
        print(f"example {name}", flush=True)  # names the example in the rank log tail on a failure
        cfg, _ = load_dialect_config(path, dialect, overrides)
        engine = TrainEngine(cfg, runtime)
        steps = []
        for step in range(2):
            if vision.is_vision_language(engine.model.config):  # every forward of a VL model has its images
                rows = make_vl_batch(step, cfg.train.global_batch_size, engine.model.config)
            else:
                rows = make_global_batch(step, cfg.train.global_batch_size)
            res = engine.train_step(micro_batches_of(rows, engine.dp_rank, engine.dp_size, cfg.train.micro_batch_size),
                                    loss_tokens(rows))
            steps.append([res.loss, res.grad_norm, res.lr, res.skipped])
        out[name] = {"steps": steps, "mesh": list(engine.spec.shape), "dp": engine.dp_size,
                     "dtypes": sorted({str(p.dtype) for p in engine.model.parameters()})}
        del engine
    teardown()
    return out


def test_every_seed_example_trains_two_steps_on_two_ranks(tmp_path) -> None:
    cases = [(e.file.removesuffix(".yaml"), str(_edited(e, e.train_edits, tmp_path)), e.dialect,
              [e.model, *e.overrides, "train.max_steps=2"]) for e in EXAMPLES]
    results = run_ranks(_train_examples, 2, cases, timeout=240)
    for name, got in results[0].items():
        for loss, grad_norm, _, skipped in got["steps"]:
            assert math.isfinite(loss) and 2.0 < loss < 6.0, (name, loss)  # ln(64) = 4.16 at random init
            assert math.isfinite(grad_norm) and grad_norm > 0 and not skipped, (name, grad_norm)
        assert results[1][name]["steps"] == got["steps"], name  # every rank reports the same global step
    r = results[0]
    # what the conversion said reached the engine
    assert r["roll_train"]["dtypes"] == ["torch.bfloat16"]  # model_args.dtype: bf16 master weights
    assert r["mindspeed_fsdp2"]["dtypes"] == ["torch.bfloat16"] and r["mindspeed_defaults"]["dtypes"] == ["torch.float32"]
    # learning_rate 1e-6 with warmup_steps 20: the steps' learning rates
    assert [lr for _, _, lr, _ in r["roll_train"]["steps"]] == pytest.approx([1e-6 / 20, 2e-6 / 20])
    assert r["roll_ulysses"]["dp"] == 1 and r["roll_ulysses"]["mesh"] == [2]
    assert r["rlinf_full"]["mesh"] == [2, 1] and r["mindspeed_defaults"]["mesh"] == [2, 1]  # replicas
    assert r["roll_infer"]["mesh"] == [2]


def test_train_cli_with_a_roll_file_runs_its_device_count(tmp_path) -> None:
    example = EXAMPLES[0]
    path = _edited(example, example.train_edits, tmp_path)
    run_dir = tmp_path / "run"
    # no --nproc: device_mapping list(range(0,2)) starts 2 ranks
    res = run_cli(["train", str(path), "--dialect", "roll", TINY_QWEN3, f"run.dir={run_dir}", "train.max_steps=2",
                   "data.max_length=16", "checkpoint.async=false", "checkpoint.export_hf=false"], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2]
    ckpt = run_dir / "checkpoints" / "step_00000002"
    assert len(list(ckpt.rglob("*.distcp"))) == 2  # one shard file per rank
    assert res.stderr.count("not converted: actor_train.training_args.num_train_epochs") == 1


# ---------------------------------------------------------------------- bad input


@dataclass(frozen=True)
class Bad:
    dialect: str
    text: str
    key: str
    """The dialect key the one line must name (after the file name)."""
    says: tuple[str, ...]
    """Fragments of the problem and of the nearest valid choice."""


BAD = {
    "roll-unknown-key": Bad("roll", "actor_train:\n  strategy_args:\n    strategy_config:\n      fsdp_sise: 4\n",
                            "actor_train.strategy_args.strategy_config.fsdp_sise",
                            ("unknown ROLL key", "did you mean actor_train.strategy_args.strategy_config.fsdp_size?")),
    "roll-key-without-meaning": Bad("roll", "actor_train:\n  training_args:\n    logging_steps: 1\n"
                                    "  device_mapping: list(range(0,2))\n",
                                    "actor_train.training_args.logging_steps",
                                    ("without a shardwise meaning", "did you mean")),
    "roll-device-mapping-code": Bad("roll", "actor_train:\n  device_mapping: os.system('touch PWNED')\n",
                                    "actor_train.device_mapping",
                                    ("os.system('touch PWNED')", "never evaluates code", "e.g. list(range(0,8))")),
    "roll-device-mapping-offset": Bad("roll", "actor_train:\n  device_mapping: list(range(4,8))\n",
                                      "actor_train.device_mapping",
                                      ("devices 0..N-1", "list(range(0,4))", "CUDA_VISIBLE_DEVICES")),
    "roll-dtype": Bad("roll", "strategy_config:\n  param_dtype: bfloat15\n", "strategy_config.param_dtype",
                      ("'bfloat15' is not a ROLL dtype", "did you mean bfloat16?")),
    "roll-fp64": Bad("roll", "model_args:\n  dtype: fp64\n", "model_args.dtype", ("fp32, bf16 or fp16", "use fp32")),
    "roll-strategy": Bad("roll", "actor_train:\n  strategy_args:\n    strategy_name: megatron_train\n",
                         "actor_train.strategy_args.strategy_name", ("FSDP2", "valid: fsdp2_train, fsdp2_infer")),
    "roll-batch-without-devices": Bad("roll", "actor_train:\n  training_args:\n    learning_rate: 1.0e-5\n",
                                      "actor_train.training_args", ("per device", "device_mapping: list(range(0,N))")),
    "roll-two-workers": Bad("roll", "actor_train: {}\nreference: {}\n", "reference",
                            ("one model", "one worker section at a time")),
    "mindspeed-dtype": Bad("mindspeed", "param_dtype: float32\n", "param_dtype",
                           ("'float32' is not a MindSpeed dtype", "did you mean fp32?")),
    "mindspeed-unknown-key": Bad("mindspeed", "num_to_forward_prefetchs: 1\n", "num_to_forward_prefetchs",
                                 ("unknown MindSpeed key", "did you mean num_to_forward_prefetch?")),
    "mindspeed-sharding-size": Bad("mindspeed", "sharding_size: all\n", "sharding_size", ("'all'", "e.g. auto")),
    "rlinf-dtype": Bad("rlinf", "actor:\n  model:\n    precision: fp8\n", "actor.model.precision",
                       ("'fp8' is not a RLinf dtype", "did you mean")),
    "rlinf-layering-off": Bad("rlinf", "actor:\n  model:\n    modules_precision: {model.norm: fp32}\n",
                              "actor.model.modules_precision", ("enable_layered_fsdp is false",
                                                                "set enable_layered_fsdp: true")),
    "rlinf-unknown-section": Bad("rlinf", "actor: {}\nrollout: {}\n", "rollout", ("unknown RLinf key", "valid: actor")),
    "rlinf-strategy": Bad("rlinf", "actor:\n  model:\n    sharding_strategy: full_sharded\n",
                          "actor.model.sharding_strategy", ("not an RLinf sharding strategy",
                                                            "did you mean full_shard?")),
}


@pytest.mark.parametrize("command", ["convert", "plan", "train", "rl"])
@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_dialect_input_exits_2_with_one_line(case: Bad, command: str, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(case.text)
    run_dir = tmp_path / "run"
    argv = (["convert", "--from", case.dialect, str(path)] if command == "convert" else
            [command, str(path), "--dialect", case.dialect, TINY_QWEN3, f"run.dir={run_dir}"]
            + (["--nproc", "2"] if command != "plan" else []))
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"shardwise: config error at '{path}:{case.key}': "), lines[0]
    for fragment in case.says:
        assert fragment in lines[0], (fragment, lines[0])
    assert captured.out == ""
    assert not run_dir.exists() and not (tmp_path / "PWNED").exists()  # nothing ran, nothing was evaluated


def test_unknown_dialect_is_refused_by_the_cli_and_the_library(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--from", "verl", str(FIXTURES / "roll_text.yaml")])
    assert exc.value.code == 2 and "invalid choice: 'verl'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown dialect 'Roll'.*did you mean roll"):
        convert({}, "Roll")


def test_converted_config_errors_still_name_the_shardwise_key() -> None:
    cfg_raw = read_dialect(FIXTURES / "roll_text.yaml", "roll").config
    with pytest.raises(ConfigError, match="parallel.fsdp_sizee.*did you mean parallel.fsdp_size"):
        config_from_dict(apply_overrides(cfg_raw, ["parallel.fsdp_sizee=2"]))
