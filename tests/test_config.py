"""Config strings and arithmetic as tables: dtype names, override parsing, YAML + overrides,
the `checkpoint.async` alias, mesh shapes per world size, and batch-size arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from shardwise.config import Config, apply_overrides, load_config
from shardwise.config.dtypes import canonical_dtype, dtype_bytes, to_torch_dtype
from shardwise.config.load import parse_override_value
from shardwise.config.schema import ParallelConfig, TrainConfig
from shardwise.config.validate import check_sft_batch, mesh_spec
from shardwise.errors import ConfigError

# ---------------------------------------------------------------------------- dtype names


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"), ("torch.float32", "fp32"),
        ("torch.float", "fp32"),
        ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"),
        ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("torch.float16", "fp16"),
        ("torch.half", "fp16"),
        # case and surrounding blanks do not matter
        ("FP32", "fp32"), ("Float32", "fp32"), ("BF16", "bf16"), ("BFloat16", "bf16"),
        ("HALF", "fp16"), ("Torch.Float16", "fp16"), ("  bf16 ", "bf16"),
        # torch dtypes themselves
        (torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16"),
    ],
)
def test_canonical_dtype(name, canonical: str) -> None:
    assert canonical_dtype(name) == canonical


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("bf61", "did you mean bf16?"),
        ("fp33", "did you mean fp32?"),
        ("flaot32", "did you mean float32?"),
        ("halff", "did you mean half?"),
        ("int8", "use fp32, bf16 or fp16"),
        ("", "unknown dtype"),
        (16, "a dtype name is a string, got int 16"),
        (None, "a dtype name is a string"),
        (torch.int8, "unsupported dtype torch.int8"),
        (torch.float64, "unsupported dtype torch.float64"),
    ],
)
def test_canonical_dtype_rejects(name, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        canonical_dtype(name)
    assert fragment in str(info.value)
    if isinstance(name, str) and name:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    ("name", "dtype", "nbytes"),
    [("float32", torch.float32, 4), ("BF16", torch.bfloat16, 2), ("half", torch.float16, 2)],
)
def test_torch_dtype_and_bytes(name: str, dtype: torch.dtype, nbytes: int) -> None:
    assert to_torch_dtype(name) is dtype
    assert dtype_bytes(name) == nbytes


def test_to_torch_dtype_keeps_none() -> None:
    assert to_torch_dtype(None) is None


@pytest.mark.parametrize(
    ("override", "attr", "canonical"),
    [
        ("model.dtype=BFloat16", ("model", "dtype"), "bf16"),
        ("fsdp.mixed_precision.param_dtype=torch.float32", ("fsdp", "mixed_precision", "param_dtype"), "fp32"),
        ("fsdp.mixed_precision.reduce_dtype=half", ("fsdp", "mixed_precision", "reduce_dtype"), "fp16"),
        ("fsdp.mixed_precision.output_dtype=float", ("fsdp", "mixed_precision", "output_dtype"), "fp32"),
        ("fsdp.mixed_precision.output_dtype=", ("fsdp", "mixed_precision", "output_dtype"), None),
    ],
)
def test_config_stores_canonical_dtype(override: str, attr: tuple[str, ...], canonical: str | None) -> None:
    value = load_config(None, [override])
    for a in attr:
        value = getattr(value, a)
    assert value == canonical


def test_module_precision_values_are_canonical() -> None:
    cfg = load_config(None, ["fsdp.module_precision={model.norm: float32, "
                             "lm_head: {param_dtype: BF16, reduce_dtype: torch.float32}}"])
    mp = cfg.fsdp.module_precision
    assert mp["model.norm"] == "fp32"
    assert mp["lm_head"].param_dtype == "bf16"
    assert mp["lm_head"].reduce_dtype == "fp32"
    assert mp["lm_head"].output_dtype is None


# ------------------------------------------------------------------------ overrides


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3", 3),
        ("-2", -2),
        ("0.5", 0.5),
        ("1.0e-4", 1.0e-4),
        ("true", True),
        ("false", False),
        ("null", None),
        ("", None),
        ("   ", None),
        ("abc", "abc"),
        ('"3"', "3"),
        ("[x,y]", ["x", "y"]),
        ("[1, 2]", [1, 2]),
        ("[]", []),
        ("{k: v}", {"k": "v"}),
        ("{forward: 2, backward: 0}", {"forward": 2, "backward": 0}),
        ("{}", {}),
        ("[a, [b, c]]", ["a", ["b", "c"]]),
        ("a=b", "a=b"),
        # brace patterns: a bare one is a string, a list of them is not flow YAML but still works
        ("model.layers.{0-3}", "model.layers.{0-3}"),
        ("[model.layers.{0-1}, lm_head]", ["model.layers.{0-1}", "lm_head"]),
        ("[model.layers.{0,2}, model.norm]", ["model.layers.{0,2}", "model.norm"]),
        ("[model.layers.{0-3,8,10-11}.mlp.experts.{*}]", ["model.layers.{0-3,8,10-11}.mlp.experts.{*}"]),
        ("[model.layers.{*}]", ["model.layers.{*}"]),
        ("[{*}]", ["{*}"]),
        ('{"model.layers.{0-1}": fp32}', {"model.layers.{0-1}": "fp32"}),
    ],
)
def test_parse_override_value(text: str, value) -> None:
    assert parse_override_value(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("{model.layers.{0-1}: fp32}", {"model.layers.{0-1}": "fp32"}),
        ("{modules: [model.layers.{1,3}], use_reentrant: true}",
         {"modules": ["model.layers.{1,3}"], "use_reentrant": True}),
    ],
)
def test_parse_override_value_mapping_with_brace_patterns(text: str, value) -> None:
    assert parse_override_value(text) == value


def test_apply_overrides_sets_nested_keys_without_touching_input() -> None:
    raw = {"train": {"max_steps": 5, "micro_batch_size": 2}}
    out = apply_overrides(raw, ["train.max_steps=7", "fsdp.prefetch.forward=2", "run.dir=", "a.b.c=[1, 2]"])
    assert out == {
        "train": {"max_steps": 7, "micro_batch_size": 2},
        "fsdp": {"prefetch": {"forward": 2}},
        "run": {"dir": None},
        "a": {"b": {"c": [1, 2]}},
    }
    assert raw == {"train": {"max_steps": 5, "micro_batch_size": 2}}


def test_apply_overrides_later_wins_and_value_may_hold_equals() -> None:
    out = apply_overrides({}, ["train.max_steps=1", "train.max_steps=2", "data.source=a=b.jsonl"])
    assert out == {"train": {"max_steps": 2}, "data": {"source": "a=b.jsonl"}}


def test_mapping_override_replaces_the_whole_section() -> None:
    cfg = load_config(None, ["fsdp.prefetch={forward: 3}"])
    assert (cfg.fsdp.prefetch.forward, cfg.fsdp.prefetch.backward) == (3, 1)  # backward: default


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("train.max_steps", "train.max_steps", "an override must look like key.sub=value"),
        ("=3", "", "empty key in override"),
        ("train..max_steps=3", "train..max_steps", "empty key in override"),
        (".x=3", ".x", "empty key in override"),
        ("model.dtype.x=1", "model.dtype", "is a str, cannot set model.dtype.x"),
    ],
)
def test_apply_overrides_rejects(override: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({"model": {"dtype": "fp32"}}, [override])
    assert info.value.key == key
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("override", "path", "value"),
    [
        ("train.max_steps=3", ("train", "max_steps"), 3),
        ("fsdp.wrap.embeddings=true", ("fsdp", "wrap", "embeddings"), True),
        ("model.freeze=[model.embed_tokens, lm_head]", ("model", "freeze"), ["model.embed_tokens", "lm_head"]),
        ("fsdp.recompute.modules=[model.layers.{0-1}, lm_head]", ("fsdp", "recompute", "modules"),
         ["model.layers.{0-1}", "lm_head"]),
        ("fsdp.ignored_modules=[model.layers.{1,3}.mlp]", ("fsdp", "ignored_modules"), ["model.layers.{1,3}.mlp"]),
        ("parallel.fsdp_size=2", ("parallel", "fsdp_size"), 2),
        ("parallel.fsdp_size=auto", ("parallel", "fsdp_size"), "auto"),
        ("fsdp.reshard_after_forward=2", ("fsdp", "reshard_after_forward"), 2),
        ("fsdp.reshard_after_forward=false", ("fsdp", "reshard_after_forward"), False),
        ("train.grad_clip=", ("train", "grad_clip"), None),
        ("model.config={model_type: qwen3, hidden_size: 8}", ("model", "config"),
         {"model_type": "qwen3", "hidden_size": 8}),
        ("train.optimizer.betas=[0.8, 0.9]", ("train", "optimizer", "betas"), (0.8, 0.9)),
    ],
)
def test_override_reaches_typed_config(override: str, path: tuple[str, ...], value) -> None:
    got = load_config(None, [override])
    for p in path:
        got = getattr(got, p)
    assert got == value
    assert type(got) is type(value)


# ------------------------------------------------------------------- YAML + overrides

YAML_TEXT = """
run: {dir: runs/x, seed: 3}
train:
  max_steps: 7
  micro_batch_size: 2
  global_batch_size: 8
fsdp:
  prefetch: {forward: 1, backward: 2}
  recompute: {modules: ["model.layers.{0-1}"]}
"""


def test_yaml_then_overrides_precedence(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(YAML_TEXT)
    from_file = load_config(path)
    assert (from_file.train.max_steps, from_file.run.seed) == (7, 3)

    cfg = load_config(path, ["train.max_steps=9", "fsdp.prefetch.backward=0", "run.seed=4"])
    assert cfg.train.max_steps == 9                      # override beats file
    assert cfg.fsdp.prefetch.backward == 0               # override beats file inside a mapping
    assert cfg.fsdp.prefetch.forward == 1                # file key next to an override survives
    assert cfg.run.seed == 4
    assert cfg.run.dir == "runs/x"                       # file beats default
    assert cfg.train.global_batch_size == 8
    assert cfg.fsdp.recompute.modules == ["model.layers.{0-1}"]
    assert cfg.train.log_every == 1                      # default where neither says anything
    assert cfg.train.optimizer.lr == 1.0e-4


def test_empty_yaml_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()
    assert load_config(None) == Config()


def test_example_config_loads() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "tiny_qwen3.yaml")
    assert cfg.model.config["model_type"] == "qwen3"
    assert cfg.fsdp.module_precision == {"model.norm": "fp32", "lm_head": "fp32"}
    assert cfg.fsdp.recompute.modules == ["model.layers.{0-1}"]
    assert (cfg.fsdp.prefetch.forward, cfg.fsdp.prefetch.backward) == (1, 1)


# ---------------------------------------------------------------- checkpoint.async alias


def test_checkpoint_async_alias_round_trip(tmp_path: Path) -> None:
    assert Config().checkpoint.async_save is True
    cfg = load_config(None, ["checkpoint.async=false"])
    assert cfg.checkpoint.async_save is False

    dumped = cfg.model_dump(mode="json", by_alias=True)
    assert dumped["checkpoint"]["async"] is False
    assert "async_save" not in dumped["checkpoint"]
    assert Config.model_validate(dumped) == cfg

    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(dumped))
    assert load_config(path) == cfg
    # the field name works too (populate_by_name), and means the same key
    assert load_config(None, ["checkpoint.async_save=false"]) == cfg


def test_checkpoint_async_typo_suggests_the_alias() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["checkpoint.asynk=true"])
    assert info.value.key == "checkpoint.asynk"
    assert "did you mean checkpoint.async?" in str(info.value)


# ------------------------------------------------------------------------- mesh shapes


@pytest.mark.parametrize(
    ("world", "fsdp_size", "strategy", "dim_names", "shape", "dp_size"),
    [
        # plain FSDP: auto, 1 (seed 001: <= 1) or >= world -> one shard group over all ranks
        (1, "auto", "full_shard", ("shard",), (1,), 1),
        (2, "auto", "full_shard", ("shard",), (2,), 2),
        (4, "auto", "full_shard", ("shard",), (4,), 4),
        (8, "auto", "full_shard", ("shard",), (8,), 8),
        (1, 1, "full_shard", ("shard",), (1,), 1),
        (4, 1, "full_shard", ("shard",), (4,), 4),
        (8, 1, "full_shard", ("shard",), (8,), 8),
        (2, 2, "full_shard", ("shard",), (2,), 2),
        (4, 4, "full_shard", ("shard",), (4,), 4),
        (2, 8, "full_shard", ("shard",), (2,), 2),
        (4, 16, "full_shard", ("shard",), (4,), 4),
        # HSDP: 1 < fsdp_size < world -> (world / n replicas, n shards)
        (4, 2, "full_shard", ("replicate", "shard"), (2, 2), 4),
        (8, 2, "full_shard", ("replicate", "shard"), (4, 2), 8),
        (8, 4, "full_shard", ("replicate", "shard"), (2, 4), 8),
        # shard_grad_op has the same mesh arithmetic
        (2, "auto", "shard_grad_op", ("shard",), (2,), 2),
        (8, 4, "shard_grad_op", ("replicate", "shard"), (2, 4), 8),
        (4, 1, "shard_grad_op", ("shard",), (4,), 4),
        # hybrid_shard: always (replicate, shard)
        (4, 2, "hybrid_shard", ("replicate", "shard"), (2, 2), 4),
        (8, 2, "hybrid_shard", ("replicate", "shard"), (4, 2), 8),
        (8, 4, "hybrid_shard", ("replicate", "shard"), (2, 4), 8),
        (4, 1, "hybrid_shard", ("replicate", "shard"), (4, 1), 4),
        (1, 1, "hybrid_shard", ("shard",), (1,), 1),
        # no_shard: every rank a replica, shard dim of 1
        (1, "auto", "no_shard", ("replicate", "shard"), (1, 1), 1),
        (2, "auto", "no_shard", ("replicate", "shard"), (2, 1), 2),
        (4, 1, "no_shard", ("replicate", "shard"), (4, 1), 4),
        (8, "auto", "no_shard", ("replicate", "shard"), (8, 1), 8),
    ],
)
def test_mesh_spec(world: int, fsdp_size, strategy: str, dim_names, shape, dp_size: int) -> None:
    spec = mesh_spec(ParallelConfig(fsdp_size=fsdp_size, sharding_strategy=strategy), world)
    assert spec.dim_names == dim_names
    assert spec.shape == shape
    assert spec.dp_size == dp_size
    assert spec.replicate * spec.shard == world
    assert spec.to_json()["shape"] == list(shape)
    assert spec.to_json()["dim_names"] == list(dim_names)


def test_mesh_spec_with_ulysses_keeps_fsdp_over_all_ranks() -> None:
    spec = mesh_spec(ParallelConfig(ulysses_size=2), 4)
    assert (spec.dim_names, spec.shape, spec.ulysses, spec.dp_size) == (("shard",), (4,), 2, 2)
    hsdp = mesh_spec(ParallelConfig(ulysses_size=4, fsdp_size=2), 8)
    assert (hsdp.shape, hsdp.dp_size) == ((4, 2), 2)


@pytest.mark.parametrize(
    ("world", "overrides", "key", "fragment"),
    [
        (4, {"fsdp_size": 3}, "parallel.fsdp_size", "3 does not divide the world size 4"),
        (8, {"fsdp_size": 3}, "parallel.fsdp_size", "use one of [1, 2, 4, 8] or auto"),
        (6, {"fsdp_size": 4}, "parallel.fsdp_size", "4 does not divide the world size 6"),
        (4, {"fsdp_size": 4, "sharding_strategy": "hybrid_shard"}, "parallel.fsdp_size",
         "hybrid_shard needs fsdp_size < world size (4)"),
        (4, {"fsdp_size": 8, "sharding_strategy": "hybrid_shard"}, "parallel.fsdp_size", "use one of [1, 2]"),
        (0, {}, "world_size", "must be >= 1, got 0"),
        (-2, {}, "world_size", "must be >= 1"),
        (3, {"ulysses_size": 2}, "parallel.ulysses_size", "2 does not divide the world size 3"),
    ],
)
def test_mesh_spec_rejects(world: int, overrides: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        mesh_spec(ParallelConfig(**overrides), world)
    assert info.value.key == key
    assert fragment in str(info.value)


# --------------------------------------------------------------------- batch arithmetic


@pytest.mark.parametrize(
    ("micro", "global_", "dp", "accum"),
    [
        (4, 16, 1, 4),
        (4, 16, 2, 2),
        (4, 16, 4, 1),
        (1, 8, 8, 1),
        (2, 24, 3, 4),
        (3, 48, 4, 4),
        (16, 16, 1, 1),
    ],
)
def test_check_sft_batch(micro: int, global_: int, dp: int, accum: int) -> None:
    assert check_sft_batch(TrainConfig(micro_batch_size=micro, global_batch_size=global_), dp) == accum


@pytest.mark.parametrize(
    ("micro", "global_", "dp", "fragments"),
    [
        (4, 16, 8, ["16 is not a multiple", "(4 x 8 = 32)", "try 32 or 64"]),
        (4, 24, 4, ["(4 x 4 = 16)", "try 16 or 32"]),
        (2, 12, 4, ["(2 x 4 = 8)", "try 8 or 16"]),
        (1, 10, 4, ["(1 x 4 = 4)", "try 8 or 12"]),
    ],
)
def test_check_batch_sizes_rejects(micro: int, global_: int, dp: int, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        check_sft_batch(TrainConfig(micro_batch_size=micro, global_batch_size=global_), dp)
    assert info.value.key == "train.global_batch_size"
    for f in fragments:
        assert f in str(info.value)


def test_global_batch_not_a_multiple_of_micro_is_an_sft_error_not_a_schema_error() -> None:
    # The RL job counts prompts in global_batch_size and rows in micro_batch_size, so the
    # schema accepts any pair; the SFT job (and `plan`) check it with the world size.
    cfg = load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=18"])
    with pytest.raises(ConfigError) as info:
        check_sft_batch(cfg.train, 1)
    assert info.value.key == "train.global_batch_size"
    assert "18 is not a multiple of micro_batch_size x data-parallel size (4 x 1 = 4)" in str(info.value)
    assert "try 16" in str(info.value)


def test_exponent_numbers_without_a_dot_are_floats(tmp_path):
    """PyYAML (YAML 1.1) reads `1e-5` as a string; a user means a number, and inside
    model.config it would reach transformers as text."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  config: {model_type: llama, rms_norm_eps: 1e-5}\ntrain:\n  optimizer: {lr: 3e-4}\n")
    cfg = load_config(path, ["model.config.initializer_range=2E-2"])
    assert cfg.model.config["rms_norm_eps"] == 1e-5 and isinstance(cfg.model.config["rms_norm_eps"], float)
    assert cfg.model.config["initializer_range"] == 0.02 and cfg.train.optimizer.lr == 3e-4
    assert load_config(path, ["run.dir=1e5x"]).run.dir == "1e5x"  # not a number: stays text
