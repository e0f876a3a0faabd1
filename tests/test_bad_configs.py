"""Every user mistake in a config ends the CLI with status 2 and one clear line on stderr.

One table of bad configs, each run through `shardwise plan` with the tiny Qwen3 example (or a
YAML file written for the row). For each row: exit status 2, stderr names the key path and
holds the expected fragment of the hint (the nearest valid name or value) where there is one,
no traceback, nothing on stdout.

Every row runs in-process through `shardwise.cli.main` (the CLI's own entry point, stderr
captured); a few rows also run through the real `python -m shardwise.cli` subprocess, to prove
the exit status and the absence of a traceback end to end (~4 s each: torch + transformers import).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from dist.common import cli_status
from dist.launcher import REPO_ROOT, run_cli

from shardwise.fsdp.projection import profiles

EXAMPLE = "examples/tiny_qwen3.yaml"  # 4 layers, untied, global batch 16, micro 4

TINY_MODEL_YAML = ("model: {config: {model_type: qwen3, hidden_size: 32, intermediate_size: 64, "
                   "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, "
                   "vocab_size: 64, max_position_embeddings: 64, tie_word_embeddings: false}}\n")


PROFILE_WITHOUT_INTER_NODE_BANDWIDTH = yaml.safe_dump(
    {k: v for k, v in profiles()["h100"].items() if k != "inter_node_bandwidth"})
PROFILE_WITH_ZERO_BANDWIDTH = yaml.safe_dump({**profiles()["h100"], "inter_node_bandwidth": 0})
PROFILE_WITH_NEGATIVE_FLOPS = yaml.safe_dump({**profiles()["h100"], "peak_flops": {"bf16": -1.0e12, "fp32": 67.0e12}})


@dataclass(frozen=True)
class Bad:
    overrides: tuple[str, ...] = ()
    key: str = ""
    """Must appear in stderr: the dotted key path ("{cfg}" = the config file's path)."""
    hint: str | None = None
    """Expected fragment of the message's hint, where there is one."""
    world: int = 2
    yaml: str | None = None
    """Config file text written for the row; None: the tiny Qwen3 example."""
    config: str | None = None
    """Config path relative to tmp_path, for rows about the file itself (e.g. a missing one)."""
    files: tuple[tuple[str, str], ...] = ()
    """(relative path, text) written under tmp_path before the run; "{tmp}" in overrides is tmp_path."""
    command: str = "plan"
    """`train` for rows about the data or tokenizer, which only a job's `prepare` reads
    (``--nproc`` = world, run.dir under tmp_path; refused before any rank starts)."""


ROWS = [
    # ---- unknown keys, at several depths, with the nearest valid name
    pytest.param(Bad(("trian.max_steps=3",), "trian", "did you mean train?"), id="unknown-section"),
    pytest.param(Bad(("fsdp.reshard_after_foward=true",), "fsdp.reshard_after_foward",
                     "did you mean fsdp.reshard_after_forward?"), id="unknown-key-depth2"),
    pytest.param(Bad(("fsdp.wrap.embedings=true",), "fsdp.wrap.embedings",
                     "did you mean fsdp.wrap.embeddings?"), id="unknown-key-depth3"),
    pytest.param(Bad(("rl.actor.kl_loss.coeff=0.1",), "rl.actor.kl_loss.coeff",
                     "did you mean rl.actor.kl_loss.coef?"), id="unknown-key-depth4"),
    pytest.param(Bad(("checkpoint.asynk=false",), "checkpoint.asynk", "did you mean checkpoint.async?"),
                 id="unknown-key-near-alias"),
    pytest.param(Bad(key="fsdp.mixed_precision.param_dtpye", hint="did you mean fsdp.mixed_precision.param_dtype?",
                     yaml=TINY_MODEL_YAML + "fsdp: {mixed_precision: {param_dtpye: bf16}}\n"),
                 id="unknown-key-in-yaml-file"),
    pytest.param(Bad(key="fsdp.module_precision.model.norm.param_dtyp", hint="param_dtype",
                     yaml=TINY_MODEL_YAML + "fsdp: {module_precision: {model.norm: {param_dtyp: fp32}}}\n"),
                 id="unknown-key-in-module-precision-entry"),
    # ---- wrong types
    pytest.param(Bad(("train.max_steps=abc",), "train.max_steps", "expected an integer"), id="str-for-int"),
    pytest.param(Bad(key="train.micro_batch_size", hint="expected an integer",
                     yaml=TINY_MODEL_YAML + 'train: {micro_batch_size: "4"}\n'), id="quoted-int-in-yaml"),
    pytest.param(Bad(("fsdp.wrap.embeddings=maybe",), "fsdp.wrap.embeddings", "expected true/false"),
                 id="str-for-bool"),
    pytest.param(Bad(("fsdp.wrap=[a]",), "fsdp.wrap", "must be a mapping, got list"), id="list-for-mapping"),
    pytest.param(Bad(("fsdp=3",), "fsdp", "must be a mapping, got int"), id="scalar-for-section"),
    pytest.param(Bad(("fsdp.ignored_modules={a: 1}",), "fsdp.ignored_modules", "expected a list"),
                 id="mapping-for-list"),
    pytest.param(Bad(("model.freeze=lm_head",), "model.freeze", "expected a list"), id="str-for-list"),
    pytest.param(Bad(("train.optimizer.betas=[0.9]",), "train.optimizer.betas", "is required"),
                 id="short-pair"),
    # ---- dtype names
    pytest.param(Bad(("model.dtype=bf61",), "model.dtype", "did you mean bf16?"), id="bad-dtype"),
    pytest.param(Bad(("fsdp.mixed_precision.reduce_dtype=fp33",), "fsdp.mixed_precision.reduce_dtype",
                     "did you mean fp32?"), id="bad-reduce-dtype"),
    pytest.param(Bad(("fsdp.mixed_precision.output_dtype=flaot32",), "fsdp.mixed_precision.output_dtype",
                     "did you mean float32?"), id="bad-optional-dtype"),
    pytest.param(Bad(("model.dtype=int8",), "model.dtype", "use fp32, bf16 or fp16"), id="dtype-nothing-near"),
    # ---- enumerations
    pytest.param(Bad(("parallel.sharding_strategy=full_shards",), "parallel.sharding_strategy",
                     "did you mean full_shard?"), id="bad-strategy"),
    pytest.param(Bad(("model.attn_implementation=sdpaa",), "model.attn_implementation", "did you mean sdpa?"),
                 id="bad-attn-implementation"),
    pytest.param(Bad(("train.scheduler.name=cosin",), "train.scheduler.name", "did you mean cosine?"),
                 id="bad-scheduler"),
    pytest.param(Bad(("rl.algorithm=ppoo",), "rl.algorithm", "did you mean ppo?"), id="bad-rl-algorithm"),
    pytest.param(Bad(("rl.advantage=rlooo",), "rl.advantage", "did you mean rloo?"), id="bad-rl-advantage"),
    pytest.param(Bad(("parallel.fsdp_size=autoo",), "parallel.fsdp_size", "one of 'auto' or an integer"),
                 id="bad-fsdp-size-word"),
    # ---- sizes
    pytest.param(Bad(("train.micro_batch_size=0",), "train.micro_batch_size", "a value >= 1"), id="zero-micro"),
    pytest.param(Bad(("train.max_steps=-5",), "train.max_steps", "a value >= 1"), id="negative-steps"),
    pytest.param(Bad(("fsdp.prefetch.forward=-1",), "fsdp.prefetch.forward", "a value >= 0"),
                 id="negative-prefetch"),
    pytest.param(Bad(("parallel.fsdp_size=0",), "parallel.fsdp_size", "a value >= 1"), id="zero-fsdp-size"),
    pytest.param(Bad(("train.optimizer.lr=0",), "train.optimizer.lr", "a value > 0"), id="zero-lr"),
    pytest.param(Bad(world=-1, key="world_size", hint="must be >= 1, got -1"), id="negative-world-size"),
    pytest.param(Bad(world=0, key="world", hint=">= 1"), id="zero-world-size"),
    # ---- sizes that must agree with each other or with the world size
    pytest.param(Bad(("parallel.fsdp_size=3",), "parallel.fsdp_size", "use one of [1, 2, 4] or auto", world=4),
                 id="fsdp-size-not-dividing-world"),
    pytest.param(Bad(("parallel.sharding_strategy=hybrid_shard",), "parallel.fsdp_size", "fsdp_size=2", world=4),
                 id="hybrid-shard-with-auto"),
    pytest.param(Bad(("parallel.sharding_strategy=hybrid_shard", "parallel.fsdp_size=4"), "parallel.fsdp_size",
                     "use one of [1, 2]", world=4), id="hybrid-shard-one-group"),
    pytest.param(Bad(("parallel.sharding_strategy=no_shard", "parallel.fsdp_size=2"), "parallel.fsdp_size",
                     "set fsdp_size to auto or 1", world=4), id="no-shard-with-fsdp-size"),
    pytest.param(Bad(("parallel.sharding_strategy=shard_grad_op", "fsdp.reshard_after_forward=true"),
                     "fsdp.reshard_after_forward", "set it to false"), id="shard-grad-op-with-reshard"),
    pytest.param(Bad(("fsdp.reshard_after_forward=3",), "fsdp.reshard_after_forward",
                     "use true, false or one of [1, 2, 4]", world=4), id="reshard-int-not-dividing"),
    pytest.param(Bad(("parallel.fsdp_size=2", "fsdp.reshard_after_forward=4"), "fsdp.reshard_after_forward",
                     "one of [1, 2]", world=4), id="reshard-int-beyond-hsdp-group"),
    pytest.param(Bad(("train.global_batch_size=18",), "train.global_batch_size", "try 16"),
                 id="global-not-multiple-of-micro"),
    pytest.param(Bad(key="train.global_batch_size", hint="try 32 or 64", world=8),
                 id="global-not-multiple-of-micro-x-dp"),
    pytest.param(Bad(("parallel.ulysses_size=3",), "parallel.ulysses_size", "use one of [1, 2]"),
                 id="ulysses-not-dividing"),
    pytest.param(Bad(("fsdp.tiled_mlp.enabled=true", "fsdp.tiled_mlp.modules=[model.layers.{*}.mpl]"),
                     "fsdp.tiled_mlp.modules[0]", "model.layers.{*}.mlp"), id="tiled-mlp-pattern-matches-nothing"),
    pytest.param(Bad(("fsdp.tiled_mlp.shards=0",), "fsdp.tiled_mlp.shards", None), id="tiled-mlp-zero-shards"),
    pytest.param(Bad(("fsdp.moe_expert_patch=true",), "fsdp.moe_expert_patch", "set fsdp.moe_expert_patch=false"),
                 id="moe-expert-patch-on-a-dense-model"),
    # ---- module path patterns and class names
    pytest.param(Bad(("fsdp.recompute.modules=[model.layerz.{0}]",), "fsdp.recompute.modules[0]",
                     "model.layers.{*}"), id="pattern-matches-nothing"),
    pytest.param(Bad(("fsdp.wrap.modules=[model.layers.{0-5}]",), "fsdp.wrap.modules[0]",
                     "model.layers has {0-3}"), id="index-out-of-range"),
    pytest.param(Bad(("fsdp.ignored_modules=[lm_head.weight]",), "fsdp.ignored_modules[0]",
                     "use the module path 'lm_head'"), id="parameter-path-ignored"),
    pytest.param(Bad(("model.freeze=[model.norm.weight]",), "model.freeze[0]",
                     "use the module path 'model.norm'"), id="parameter-path-freeze"),
    pytest.param(Bad(("fsdp.wrap.modules=[model.layers.{3-1}]",), "fsdp.wrap.modules[0]", "write {1-3}"),
                 id="malformed-backwards-range"),
    pytest.param(Bad(("fsdp.wrap.modules=[model.layers.{*}, model.layers.{}]",), "fsdp.wrap.modules[1]",
                     "use {*}"), id="malformed-empty-group-second-item"),
    pytest.param(Bad(("fsdp.recompute.modules=[model.layers.*]",), "fsdp.recompute.modules[0]", "write {*}"),
                 id="malformed-bare-star"),
    pytest.param(Bad(("fsdp.ignored_modules=[model.layers.{0-1]",), "fsdp.ignored_modules[0]",
                     "unbalanced braces"), id="malformed-unbalanced"),
    pytest.param(Bad(("fsdp.wrap.classes=[Qwen3Decoder]",), "fsdp.wrap.classes[0]",
                     "did you mean Qwen3DecoderLayer?"), id="wrap-class-matches-nothing"),
    pytest.param(Bad(("fsdp.recompute.modules=[Qwen3Layer]",), "fsdp.recompute.modules[0]",
                     "did you mean Qwen3DecoderLayer?"), id="recompute-class-matches-nothing"),
    # ---- layered precision
    pytest.param(Bad(("fsdp.module_precision={model.norm: fp33}",), "fsdp.module_precision.model.norm",
                     "did you mean fp32?"), id="module-precision-bad-dtype"),
    pytest.param(Bad(("fsdp.module_precision={model.nrm: fp32}",), "fsdp.module_precision.model.nrm",
                     "model.norm"), id="module-precision-bad-pattern"),
    pytest.param(Bad(key="fsdp.module_precision.model.norm.reduce_dtype", hint="did you mean",
                     yaml=TINY_MODEL_YAML + "fsdp: {module_precision: {model.norm: "
                                            "{param_dtype: fp32, reduce_dtype: fp61}}}\n"),
                 id="module-precision-entry-bad-dtype"),
    pytest.param(Bad(('fsdp.module_precision={"model.layers.{0-1}": fp32, model.layers.1: bf16}',),
                     "fsdp.module_precision.model.layers.1", "keep one entry per module"),
                 id="module-precision-two-values-one-module"),
    pytest.param(Bad(("fsdp.module_precision={lm_head: fp32}", "model.config.tie_word_embeddings=true"),
                     "fsdp.module_precision.lm_head", "cannot have two precisions"),
                 id="module-precision-on-tied-head"),
    # ---- the model
    pytest.param(Bad(("model.path=/nonexistent",), "model.config", "keep one"), id="model-path-and-config"),
    pytest.param(Bad(("model.config.model_type=qwen4",), "model.config.model_type", "did you mean qwen3?"),
                 id="unknown-model-type"),
    pytest.param(Bad(("model.config={hidden_size: 8}",), "model.config.model_type", "model_type: qwen3"),
                 id="model-config-without-model-type"),
    pytest.param(Bad(("model.config=", "model.path={tmp}/empty_dir"), "model.path", "save_pretrained",
                     files=(("empty_dir/README", "no config here"),)), id="model-path-without-config-json"),
    pytest.param(Bad(key="model", hint="set model.path", yaml="train: {max_steps: 3}\n"), id="no-model-at-all"),
    pytest.param(Bad(("model.config.num_hidden_layers=two",), "model.config", "num_hidden_layers"),
                 id="model-config-field-wrong-type"),
    pytest.param(Bad(("model.config=", "model.path={tmp}/m"), "model.path", None,
                     files=(("m/config.json", '{"model_type": "qwen4"}'),)),
                 id="model-path-unknown-model-type"),
    pytest.param(Bad(("model.config=", "model.path={tmp}/m"), "model.path", None,
                     files=(("m/config.json", "{not json"),)),
                 id="model-path-config-json-not-json"),
    pytest.param(Bad(("model.attn_implementation=flash_attention_2",), "model.attn_implementation", None),
                 id="flash-attention-not-installed",
                 marks=[pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                                           reason="flash_attn is installed: the choice is valid here")]),
    # ---- found only inside the ranks before (issue 22, item 14); now in `prepare`
    pytest.param(Bad(("data.max_length=1",), "data.max_length", "set data.max_length >= ", command="train"),
                 id="max-length-keeps-no-response-token"),
    pytest.param(Bad(("model.config.vocab_size=1",), "model.config.vocab_size", "set vocab_size >= 60",
                     command="train"), id="vocab-smaller-than-tokenizer"),
    # ---- evaluation (issue 29): the validation data and the best checkpoint, in `prepare`
    pytest.param(Bad(("eval.source={tmp}/nope.jsonl",), "eval.source", "does not exist", command="train"),
                 id="eval-source-missing"),
    pytest.param(Bad(("eval.source={tmp}/val.jsonl",), "data.response_key", "val.jsonl' line 2",
                     files=(("val.jsonl", '{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2="}\n'),),
                     command="train"), id="eval-row-without-ground-truth"),
    pytest.param(Bad(("checkpoint.keep_best=val/los",), "checkpoint.keep_best", "did you mean val/loss?",
                     command="train"), id="keep-best-unknown-metric"),
    pytest.param(Bad(("checkpoint.export_from=best",), "checkpoint.export_from", "needs checkpoint.keep_best",
                     command="train"), id="export-best-without-keep-best"),
    # ---- the config file and the command line
    pytest.param(Bad(key="{cfg}", hint="does not exist", config="missing.yaml"), id="config-file-missing"),
    pytest.param(Bad(key="{cfg}", hint="must hold a mapping of sections, got list", yaml="- a\n- b\n"),
                 id="config-file-a-list"),
    pytest.param(Bad(key="{cfg}", hint="must hold a mapping of sections, got str", yaml="just words\n"),
                 id="config-file-a-scalar"),
    pytest.param(Bad(key="{cfg}", hint="is not valid YAML", yaml="model: {dtype: fp32\ntrain: [\n"),
                 id="invalid-yaml"),
    pytest.param(Bad(("train.max_steps",), "train.max_steps", "key.sub=value"), id="override-without-equals"),
    pytest.param(Bad(("model.dtype.x=1",), "model.dtype", "cannot set model.dtype.x"), id="override-into-scalar"),
    pytest.param(Bad(("rl.advantage=gae",), "rl.critic.enabled", "set rl.critic.enabled=true"),
                 id="gae-without-critic"),
    # ---- the step-time projection (`plan --hardware`)
    pytest.param(Bad(("--hardware", "h1000"), "--hardware", "known: h100, h200, a100-80gb"), id="unknown-hardware"),
    pytest.param(Bad(("--hardware", "{tmp}/gpu.yaml"), "--hardware", "the profile lacks inter_node_bandwidth",
                     files=(("gpu.yaml", PROFILE_WITHOUT_INTER_NODE_BANDWIDTH),)), id="profile-missing-field"),
    pytest.param(Bad(("--hardware", "{tmp}/gpu.yaml"), "--hardware",
                     "inter_node_bandwidth is 0, not a positive number of bytes/s (the h100 profile has "
                     "inter_node_bandwidth: 5e+10)", files=(("gpu.yaml", PROFILE_WITH_ZERO_BANDWIDTH),)),
                 id="profile-zero-bandwidth"),
    pytest.param(Bad(("--hardware", "{tmp}/gpu.yaml"), "--hardware",
                     "peak_flops.bf16 is -1000000000000.0, not a positive number of FLOP/s (the h100 profile has "
                     "peak_flops.bf16: 9.89e+14)", files=(("gpu.yaml", PROFILE_WITH_NEGATIVE_FLOPS),)),
                 id="profile-negative-flops"),
    pytest.param(Bad(("--hardware", "h100", "train.global_batch_size=48"), "--world-size",
                     "use a multiple of 8", world=12), id="world-not-filling-nodes"),
    pytest.param(Bad(("--hardware", "h100", "--scan", "8,12", "--gpus-per-node", "4", "parallel.fsdp_size=8",
                      "train.global_batch_size=32"), "parallel.fsdp_size", "or auto"), id="scan-mesh-cannot-tile"),
    pytest.param(Bad(("--hardware", "h100", "--mfu", "1.5"), "--mfu", "e.g. --mfu 0.35"), id="mfu-above-one"),
    pytest.param(Bad(("--mfu", "0.4",), "--hardware", "add --hardware h100"), id="mfu-without-hardware"),
]

SUBPROCESS_ROWS = {"invalid-yaml", "max-length-keeps-no-response-token"}
"""Rows also run through the real command (a fresh process: its exit status, empty stdout and
lone stderr line, the imports' warnings included): one refused while the file is read, one
by the job's checks after it. Every row runs in this process too; each subprocess costs a
process start (~9 s of CPU), so the others are not repeated there."""


def _argv(bad: Bad, tmp_path: Path, example: str) -> tuple[list[str], str]:
    """The `shardwise plan` (or `train`) argv for a row, and the config path it uses."""
    for rel, text in bad.files:
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    if bad.config is not None:
        cfg = str(tmp_path / bad.config)
    elif bad.yaml is not None:
        cfg = str(tmp_path / "bad.yaml")
        Path(cfg).write_text(bad.yaml)
    else:
        cfg = example
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in bad.overrides]
    if bad.command == "train":
        return ["train", cfg, *overrides, f"run.dir={tmp_path / 'run'}", "--nproc", str(bad.world)], cfg
    return ["plan", cfg, *overrides, "--world-size", str(bad.world)], cfg


def _check(bad: Bad, cfg: str, code: int, out: str, err: str) -> None:
    report = f"exit {code}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
    assert "Traceback" not in err, report
    assert code == 2, report
    assert out == "", report
    assert err.startswith("shardwise: ") and err.count("shardwise: ") == 1, report  # one message
    key = bad.key.replace("{cfg}", cfg)
    assert key in err, f"key {key!r} not named\n{report}"
    if bad.hint is not None:
        assert bad.hint in err, f"hint {bad.hint!r} missing\n{report}"


@pytest.mark.parametrize("bad", ROWS)
def test_bad_config_in_process(bad: Bad, tmp_path: Path, capsys, monkeypatch) -> None:
    # cmd_plan forces the HF libraries offline through os.environ; keep that inside this test
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    argv, cfg = _argv(bad, tmp_path, str(REPO_ROOT / EXAMPLE))
    code = cli_status(argv)
    out, err = capsys.readouterr()
    _check(bad, cfg, code, out, err)


@pytest.mark.parametrize("bad", [r for r in ROWS if r.id in SUBPROCESS_ROWS])
def test_bad_config_cli_subprocess(bad: Bad, tmp_path: Path) -> None:
    argv, cfg = _argv(bad, tmp_path, EXAMPLE)
    proc = run_cli(argv, timeout=120, cwd=REPO_ROOT, fresh=True)
    _check(bad, cfg, proc.returncode, proc.stdout, proc.stderr)


def test_table_is_large_and_subprocess_rows_exist() -> None:
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 30
    assert SUBPROCESS_ROWS <= set(ids)
