"""`shardwise config`: the resolved config with each value's origin (default, file:line,
dialect key, override), `--json` that loads back as the same Config, and `--defaults`: every
key of the schema once, with its type, default and doc. In process (`main([...])`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from dist.common import TINY_QWEN3
from test_hostile_config import DEEP_FLOW, MODEL_BOMB, bomb_lines

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.config.describe import schema_keys, type_text
from shardwise.config.dialects import load_dialect_config
from shardwise.config.schema import Config

FIXTURES = Path(__file__).parent / "dialects"

CONFIG = """\
run:
  dir: runs/cmd
model:
  dtype: BFloat16
fsdp:
  module_precision:
    lm_head: {param_dtype: fp32}
    model.norm: fp32
  offload: {enabled: true}
train:
  max_steps: 7
  optimizer: {lr: 3.0e-4, betas: [0.8, 0.9]}
checkpoint:
  async: false
"""
LINES = {"run.dir": 2, "model.dtype": 4, "fsdp.module_precision": 6, "fsdp.offload.enabled": 9,
         "train.max_steps": 11, "train.optimizer.lr": 12, "train.optimizer.betas": 12, "checkpoint.async": 14}

LINE = re.compile(r"^(?P<key>\S+): (?P<value>.*?)\s+# (?P<origin>default|file|dialect|override)(?: (?P<where>.*))?$")


def _run(capsys, *argv: str) -> str:
    code = main(["config", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _lines(out: str) -> dict[str, dict[str, str | None]]:
    parsed = {}
    for line in out.splitlines():
        m = LINE.match(line)
        assert m, line
        assert m["key"] not in parsed, f"{m['key']} printed twice"
        parsed[m["key"]] = m.groupdict()
    return parsed


def _nested(flat: dict[str, object]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *head, last = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _leaf_keys(config: Config) -> list[str]:
    """Leaf keys found by flattening a dump (sections are non-empty mappings), independent
    of the schema walk under test."""
    def walk(node: object, prefix: str):
        for k, v in node.items():
            if isinstance(v, dict) and v and k != "module_precision":
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield prefix + k
    return list(walk(config.model_dump(by_alias=True), ""))


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "my.yaml"
    path.write_text(CONFIG)
    return path


def test_each_value_names_its_origin(config_file, capsys):
    out = _run(capsys, str(config_file), "train.max_steps=9", "rl.rollout.n=8", "fsdp.offload={pin_memory: false}")
    got = _lines(out)
    assert [*got] == [k.name for k in schema_keys() if not k.section]
    # from the file, with the line of the key (block and flow mappings alike)
    for key in ("run.dir", "model.dtype", "train.optimizer.lr", "train.optimizer.betas", "checkpoint.async"):
        assert (got[key]["origin"], got[key]["where"]) == ("file", f"{config_file}:{LINES[key]}"), key
    assert got["model.dtype"]["value"] == "bf16"  # as validated: the canonical name
    assert got["train.optimizer.betas"]["value"] == "[0.8, 0.9]"
    assert got["checkpoint.async"]["value"] == "false"  # the alias, not async_save
    assert got["fsdp.module_precision"]["value"] == (
        "{lm_head: {param_dtype: fp32, reduce_dtype: null, output_dtype: null, cast_forward_inputs: true}, "
        "model.norm: fp32}")
    # an override beats the file; one that replaces a section leaves its other keys at their default
    assert got["train.max_steps"] == {"key": "train.max_steps", "value": "9", "origin": "override",
                                      "where": "train.max_steps=9"}
    assert (got["rl.rollout.n"]["value"], got["rl.rollout.n"]["where"]) == ("8", "rl.rollout.n=8")
    assert (got["fsdp.offload.pin_memory"]["value"], got["fsdp.offload.pin_memory"]["origin"]) == ("false", "override")
    assert (got["fsdp.offload.enabled"]["value"], got["fsdp.offload.enabled"]["origin"]) == ("false", "default")
    # nothing set these
    assert got["train.optimizer.eps"] == {"key": "train.optimizer.eps", "value": "1.0e-08", "origin": "default",
                                          "where": None}
    assert got["infer.temperature"]["value"] == "0.0" and got["rl.rollout.temperature"]["value"] == "1.0"
    counts = {o: sum(g["origin"] == o for g in got.values()) for o in ("file", "override", "default")}
    assert counts == {"file": 6, "override": 3, "default": len(got) - 9}


def test_an_override_into_a_mapping_of_the_file_names_both(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  config: {model_type: qwen3, hidden_size: 64}\n")
    got = _lines(_run(capsys, str(path), "model.config.hidden_size=32"))["model.config"]
    assert got["value"] == "{model_type: qwen3, hidden_size: 32}"
    assert (got["origin"], got["where"]) == ("override", f"model.config.hidden_size=32 over file {path}:2")


def test_a_key_given_by_its_python_name_still_has_its_origin(tmp_path, capsys):
    path = tmp_path / "a.yaml"
    path.write_text("checkpoint:\n  async_save: false\n")
    got = _lines(_run(capsys, str(path), "checkpoint.keep_last=3"))
    assert got["checkpoint.async"] == {"key": "checkpoint.async", "value": "false", "origin": "file",
                                       "where": f"{path}:2"}
    got = _lines(_run(capsys, "checkpoint.async_save=false"))["checkpoint.async"]
    assert (got["value"], got["origin"]) == ("false", "override")


def test_overrides_alone_resolve_without_a_file(capsys):
    got = _lines(_run(capsys, "train.max_steps=3"))
    assert (got["train.max_steps"]["value"], got["train.max_steps"]["origin"]) == ("3", "override")
    assert {g["origin"] for k, g in got.items() if k != "train.max_steps"} == {"default"}


def test_a_dialect_file_names_the_dialect_key_and_its_line(capsys):
    src = FIXTURES / "roll_train.yaml"
    text = src.read_text().splitlines()
    line_of = {key: next(i for i, ln in enumerate(text, 1) if ln.strip().startswith(key + ":"))
               for key in ("fsdp_size", "learning_rate")}
    assert main(["config", str(src), "--dialect", "roll", "parallel.fsdp_size=8", TINY_QWEN3]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("shardwise: note: not converted: actor_train.training_args.num_train_epochs: 50")
    got = _lines(out)
    lr = got["train.optimizer.lr"]
    assert (lr["value"], lr["origin"]) == ("1.0e-06", "dialect")
    assert lr["where"] == f"actor_train.training_args.learning_rate ({src}:{line_of['learning_rate']})"
    # the dialect's own default (not in the file): the converter's words, no line
    assert got["train.scheduler.name"]["where"] == ("actor_train.training_args.lr_scheduler_type "
                                                    "(HF TrainingArguments default: linear)")
    assert (got["parallel.fsdp_size"]["value"], got["parallel.fsdp_size"]["origin"]) == ("8", "override")
    assert got["model.config"]["origin"] == "override" and got["run.dir"]["origin"] == "default"
    # every key the converter wrote is a dialect value, unless overridden
    _, conv = load_dialect_config(src, "roll", [TINY_QWEN3])
    written = {".".join(p) for p in conv.origins}
    assert {k for k, g in got.items() if g["origin"] == "dialect"} == written - {"parallel.fsdp_size"}
    # the file's fsdp_size (overridden) is the origin of nothing
    assert f"actor_train.strategy_args.strategy_config.fsdp_size ({src}:{line_of['fsdp_size']})" in \
        _run(capsys, str(src), "--dialect", "roll")
    assert "strategy_config.fsdp_size" not in out


def test_json_loads_back_as_the_same_config(config_file, capsys):
    overrides = ["train.max_steps=9", "fsdp.reshard_after_forward=2", TINY_QWEN3]
    table = json.loads(_run(capsys, str(config_file), *overrides, "--json"))
    want = load_config(config_file, overrides)
    assert [*table] == [k.name for k in schema_keys() if not k.section]
    assert Config.model_validate(_nested({k: v["value"] for k, v in table.items()})) == want
    # what was set, without the defaults, is the same config too
    set_only = {k: v["value"] for k, v in table.items() if v["origin"] != "default"}
    assert len(set_only) == 10
    assert Config.model_validate(_nested(set_only)) == want
    assert table["train.max_steps"] == {"value": 9, "origin": "override", "where": "train.max_steps=9"}

    src = FIXTURES / "mindspeed_fsdp2.yaml"
    table = json.loads(_run(capsys, str(src), "--dialect", "mindspeed", TINY_QWEN3, "--json"))
    cfg, _ = load_dialect_config(src, "mindspeed", [TINY_QWEN3])
    assert {v["origin"] for v in table.values()} == {"default", "dialect", "override"}
    assert Config.model_validate(_nested({k: v["value"] for k, v in table.items() if v["origin"] != "default"})) == cfg


def test_defaults_list_every_key_once_with_its_type_default_and_doc(capsys):
    out = _run(capsys, "--defaults")
    blocks: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line and not line.startswith(" "):
            name = line.split(":", 1)[0]
            assert name not in blocks, f"{name} printed twice"
            blocks[name] = [line]
        elif line:
            blocks[name].append(line)
    keys = list(schema_keys())
    assert [*blocks] == [k.name for k in keys]
    assert [k for k in blocks if not blocks[k][0].endswith(":")] == _leaf_keys(Config())
    for key in keys:
        head, *doc = blocks[key.name]
        assert " ".join(" ".join(doc).split()) == " ".join(key.field.description.split()) != "", key.name
        if not key.section:
            assert head.startswith(f"{key.name}: {type_text(key.field)} = "), head
    assert blocks["train.optimizer.lr"][0] == "train.optimizer.lr: float > 0 = 0.0001"
    assert blocks["checkpoint.async"][0] == "checkpoint.async: bool = true"

    table = json.loads(_run(capsys, "--defaults", "--json"))
    assert [*table] == [k.name for k in keys]
    leaves = {k: v["default"] for k, v in table.items() if v["type"] != "section"}
    assert Config.model_validate(_nested(leaves)) == Config()


def test_defaults_with_a_config_show_what_it_sets(config_file, capsys):
    out = _run(capsys, str(config_file), "--defaults", "train.max_steps=9")
    lines = out.splitlines()
    i = lines.index("train.max_steps: int >= 1 = 100")
    assert lines[i + 2] == "    -> 9  (override train.max_steps=9)"
    i = lines.index("model.dtype: dtype (fp32 | bf16 | fp16) = fp32")
    assert lines[i + 2] == f"    -> bf16  (file {config_file}:4)"
    assert sum(ln.startswith("    -> ") for ln in lines) == 8


def test_only_keeps_a_section_and_its_keys(config_file, capsys):
    got = _lines(_run(capsys, str(config_file), "--only", "train.optimizer"))
    assert [*got] == ["train.optimizer." + k for k in ("name", "lr", "weight_decay", "betas", "eps", "fused")]
    table = json.loads(_run(capsys, "--defaults", "--json", "--only", "rl.rollout.vllm"))
    assert [*table] == ["rl.rollout.vllm"] + [f"rl.rollout.vllm.{k}" for k in (
        "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "enforce_eager",
        "enable_prefix_caching", "dtype", "free_cache_engine", "sync_bucket_mb", "lora_sync")]
    assert [*json.loads(_run(capsys, "--defaults", "--json", "--only", "train.max_steps"))] == ["train.max_steps"]


@pytest.mark.parametrize(("key", "text"), [
    ("train.micro_batch_size", "int >= 1"),
    ("train.max_tokens_per_micro_batch", "int >= 1 | null"),
    ("train.grad_clip", "float > 0 | null"),
    ("train.scheduler.min_lr_ratio", "0 <= float <= 1"),
    ("model.lora.dropout", "0 <= float < 1"),
    ("train.optimizer.betas", "[float, float]"),
    ("model.freeze", "list[str]"),
    ("model.config", "mapping | null"),
    ("model.dtype", "dtype (fp32 | bf16 | fp16)"),
    ("parallel.fsdp_size", "auto | int >= 1"),
    ("parallel.sharding_strategy", "full_shard | shard_grad_op | no_shard | hybrid_shard"),
    ("fsdp.reshard_after_forward", "bool | int >= 1"),
    ("rl.actor.policy_loss", "ppo_clip | vanilla | dppo_tv | dppo_kl | gspo | sapo | gpg | cispo | clip_cov | kl_cov | "
                             "geo_mean | dro | module:function (registered names)"),
    ("rl.packing", "bool | null"),
    ("fsdp.module_precision",
     "{str: dtype (fp32 | bf16 | fp16) | {param_dtype, reduce_dtype, output_dtype, cast_forward_inputs}}"),
])
def test_type_text(key: str, text: str) -> None:
    field = next(k.field for k in schema_keys() if k.name == key)
    assert type_text(field) == text


@pytest.mark.parametrize(("text", "argv", "fragments"), [
    (MODEL_BOMB, (), ("alias bomb",)),
    (bomb_lines(), ("--dialect", "roll"), ("alias bomb",)),
    (DEEP_FLOW, ("--defaults",), ("{cfg}:1", "more than 64 deep")),
    ("train:\n  optimizer:\n    lr: 1.0e-4\n    lr: 3.0\n", (), ("{cfg}:4", "duplicate key 'train.optimizer.lr'")),
], ids=["alias-bomb", "alias-bomb-dialect", "deep-flow", "duplicate-key"])
def test_hostile_files_are_refused_before_any_walk(text, argv, fragments, tmp_path, capsys):
    cfg = tmp_path / "hostile.yaml"
    cfg.write_text(text)
    assert main(["config", str(cfg), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    for fragment in fragments:
        assert fragment.replace("{cfg}", str(cfg)) in err


@pytest.mark.parametrize(("argv", "message"), [
    (["missing.yaml"], "config error: config file 'missing.yaml' does not exist"),
    (["{file}", "train.max_stepz=3"], "config error at 'train.max_stepz': unknown key (did you mean train.max_steps?)"),
    (["{file}", "train.max_steps=0"], "config error at 'train.max_steps': got 0 (int), expected a value >= 1"),
    (["{file}", "--dialect", "rlinf"], "config error at '{file}:run': unknown RLinf key"),
    ([], "config error at 'CONFIG': name the config file to resolve"),
    (["--defaults", "--dialect", "roll"], "config error at '--dialect': needs CONFIG"),
    (["--defaults", "--only", "train.optimiser"],
     "config error at '--only': 'train.optimiser' is no key or section (did you mean train.optimizer?)"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, config_file, capsys):
    """Every refusal of the other commands (they load the config the same way) is one line."""
    argv = [a.replace("{file}", str(config_file)) for a in argv]
    assert main(["config", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("shardwise: " + message.replace("{file}", str(config_file)))
