"""The sharding plan (`shardwise.fsdp.plan`), computed on meta-device models: which modules
become units and with which dtypes, reshard, recompute and prefetch settings, and the bytes
each rank holds. No process group, no weights."""

from __future__ import annotations

import json

import pytest
from dist.common import TINY_LLAMA, TINY_QWEN3
from dist.launcher import REPO_ROOT, run_cli
from torch import nn

from shardwise.config import load_config
from shardwise.config.validate import check_sft_batch, mesh_spec
from shardwise.errors import ConfigError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.comm import step_comm
from shardwise.jobs import plan as plan_job

QWEN_LAYERS = ["model.layers.0", "model.layers.1"]
QWEN_LAYER_PARAMS = 9296   # q 32x32 + k,v 16x32 + o 32x32 + q/k norm 8 + gate/up/down 64x32 + 2 norms 32
EMBED_PARAMS = 64 * 32


def plan_of(*overrides: str, world: int = 1, base: str = TINY_QWEN3):
    cfg = load_config(None, [base, *overrides])
    return plan_for(cfg, mesh_spec(cfg.parallel, world))


def paths(plan) -> list[str]:
    return [u.path for u in plan.units]


def owner_unit(plan, param: str) -> str:
    """The innermost unit whose module holds `param`."""
    best = ""
    for u in plan.units:
        if u.path and param.startswith(u.path + ".") and len(u.path) > len(best):
            best = u.path
    return best


# ------------------------------------------------------------------------- unit lists


@pytest.mark.parametrize(("base", "cls"), [(TINY_QWEN3, "Qwen3DecoderLayer"), (TINY_LLAMA, "LlamaDecoderLayer")])
def test_default_wrap_is_no_split_modules_root_last(base: str, cls: str) -> None:
    model, plan = plan_of(base=base)
    assert set(model._no_split_modules) == {cls}
    assert paths(plan) == [*QWEN_LAYERS, ""]
    assert [u.sources for u in plan.units] == [[f"class:{cls}"], [f"class:{cls}"], ["root"]]
    assert {type(model.get_submodule(p)).__name__ for p in QWEN_LAYERS} == {cls}
    assert sum(u.num_params for u in plan.units) == sum(p.numel() for p in model.parameters())
    assert plan.warnings == []


def test_pattern_wrap_replaces_the_default_classes() -> None:
    _, plan = plan_of("fsdp.wrap.modules=[model.layers.{*}.mlp, model.layers.1.self_attn]")
    # apply order: nested before parents, in model order otherwise; root last
    assert paths(plan) == ["model.layers.0.mlp", "model.layers.1.self_attn", "model.layers.1.mlp", ""]
    assert plan.unit("model.layers.0.mlp").sources == ["modules:model.layers.{*}.mlp"]
    assert plan.unit("model.layers.1.self_attn").sources == ["modules:model.layers.1.self_attn"]
    assert plan.unit("model.layers.0.mlp").num_params == 3 * 64 * 32
    # everything not in a unit stays with the root
    assert plan.unit("").num_params == 2 * QWEN_LAYER_PARAMS + 2 * EMBED_PARAMS + 32 - 2 * 6144 - 3088


def test_classes_and_modules_naming_one_module_make_one_unit() -> None:
    _, plan = plan_of("fsdp.wrap.classes=[Qwen3DecoderLayer]", "fsdp.wrap.modules=[model.layers.{0}]")
    assert paths(plan) == [*QWEN_LAYERS, ""]
    assert plan.unit("model.layers.0").sources == ["class:Qwen3DecoderLayer", "modules:model.layers.{0}"]
    assert plan.unit("model.layers.1").sources == ["class:Qwen3DecoderLayer"]


def test_embeddings_and_lm_head_units() -> None:
    _, plan = plan_of("fsdp.wrap.embeddings=true", "fsdp.wrap.lm_head=true")
    assert paths(plan) == ["model.embed_tokens", *QWEN_LAYERS, "lm_head", ""]
    assert plan.unit("model.embed_tokens").sources == ["embeddings"]
    assert plan.unit("lm_head").sources == ["lm_head"]
    assert plan.unit("model.embed_tokens").num_params == EMBED_PARAMS
    assert plan.unit("lm_head").num_params == EMBED_PARAMS
    assert plan.unit("").num_params == 32  # model.norm only
    assert plan.warnings == []


def test_tied_llama_drops_embeddings_and_lm_head_with_a_note() -> None:
    model, plan = plan_of("fsdp.wrap.embeddings=true", "fsdp.wrap.lm_head=true", base=TINY_LLAMA)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert paths(plan) == [*QWEN_LAYERS, ""]
    assert len(plan.warnings) == 1
    assert "ties input and output embeddings" in plan.warnings[0]
    assert "fsdp.wrap.embeddings/lm_head are ignored" in plan.warnings[0]
    assert plan.unit("").num_params == EMBED_PARAMS + 32  # the shared weight once, and model.norm


@pytest.mark.parametrize("override", ["fsdp.wrap.modules=[model]", "fsdp.module_precision={model: fp32}"])
def test_tied_weight_never_leaves_the_root_unit(override: str) -> None:
    try:
        _, plan = plan_of(override, base=TINY_LLAMA)
    except ConfigError as e:  # refusing the config is a fine answer too
        assert e.key.startswith(("fsdp.wrap.modules", "fsdp.module_precision"))
        return
    assert owner_unit(plan, "model.embed_tokens.weight") == ""


@pytest.mark.parametrize("override", ["fsdp.module_precision={model.layers: fp32}",
                                      "fsdp.wrap.modules=[model.layers]"])
def test_no_unit_is_a_container_without_forward(override: str) -> None:
    try:
        model, plan = plan_of(override)
    except ConfigError as e:
        assert e.key.startswith(("fsdp.wrap.modules", "fsdp.module_precision"))
        return
    containers = [u.path for u in plan.units
                  if u.path and isinstance(model.get_submodule(u.path), (nn.ModuleList, nn.ModuleDict))]
    assert containers == []


# --------------------------------------------------------------------- layered precision

# (overrides, unit, (param, reduce, output, cast_forward_inputs, storage), sources)
PRECISION = [
    pytest.param(["fsdp.module_precision={model.norm: fp32}"], "model.norm",
                 ("fp32", "fp32", "bf16", True, "fp32"), ["module_precision:fp32"], id="fp32-norm-in-bf16"),
    pytest.param(["model.dtype=bf16", "fsdp.module_precision={model.norm: fp32}"], "model.norm",
                 ("fp32", "fp32", "bf16", True, "fp32"), ["module_precision:fp32"],
                 id="fp32-norm-in-bf16-master-keeps-fp32-storage"),
    pytest.param(["model.dtype=bf16", "fsdp.module_precision={model.norm: fp32}"], "model.layers.0",
                 ("bf16", "fp32", None, True, "bf16"), ["class:Qwen3DecoderLayer"], id="others-keep-global"),
    pytest.param(["fsdp.mixed_precision.reduce_dtype=bf16", "fsdp.module_precision={lm_head: fp32}"], "lm_head",
                 ("fp32", "fp32", "bf16", True, "fp32"), ["module_precision:fp32"],
                 id="fp32-entry-reduces-in-fp32-whatever-the-global"),
    pytest.param(["fsdp.module_precision={lm_head: {param_dtype: fp32, reduce_dtype: bf16, output_dtype: fp32, "
                  "cast_forward_inputs: false}}"], "lm_head",
                 ("fp32", "bf16", "fp32", False, "fp32"), ["module_precision:fp32"], id="entry-sets-every-field"),
    pytest.param(["fsdp.mixed_precision.param_dtype=fp32", "fsdp.module_precision={lm_head: bf16}"], "lm_head",
                 ("bf16", "fp32", "fp32", True, "fp32"), ["module_precision:bf16"], id="bf16-entry-in-fp32-compute"),
    pytest.param(["fsdp.mixed_precision.reduce_dtype=bf16", "fsdp.module_precision={lm_head: bf16}"], "lm_head",
                 ("bf16", "bf16", None, True, "fp32"), ["module_precision:bf16"],
                 id="entry-equal-to-global-no-output-cast"),
    pytest.param(["fsdp.module_precision={model.layers.1: fp32}"], "model.layers.1",
                 ("fp32", "fp32", "bf16", True, "fp32"), ["class:Qwen3DecoderLayer", "module_precision:fp32"],
                 id="entry-on-a-class-unit"),
]


@pytest.mark.parametrize(("overrides", "unit", "dtypes", "sources"), PRECISION)
def test_module_precision_units(overrides, unit, dtypes, sources) -> None:
    _, plan = plan_of(*overrides)
    u = plan.unit(unit)
    assert (u.param_dtype, u.reduce_dtype, u.output_dtype, u.cast_forward_inputs, u.storage_dtype) == dtypes
    assert u.sources == sources
    root = plan.unit("")
    assert root.param_dtype == load_config(None, [TINY_QWEN3, *overrides]).fsdp.mixed_precision.param_dtype
    assert root.output_dtype is None


def test_module_precision_without_parameters_casts_buffers_only() -> None:
    _, plan = plan_of("fsdp.module_precision={model.rotary_emb: fp32, model.norm: fp32}")
    assert plan.buffer_casts == {"model.rotary_emb": "fp32", "model.norm": "fp32"}
    assert paths(plan) == [*QWEN_LAYERS, "model.norm", ""]


def test_nearest_enclosing_module_precision_entry_wins() -> None:
    _, plan = plan_of("fsdp.module_precision={model.layers.1: fp32, model.layers.1.mlp: bf16}")
    assert paths(plan) == ["model.layers.0", "model.layers.1.mlp", "model.layers.1", ""]
    by = {u.path: (u.param_dtype, u.reduce_dtype, u.output_dtype) for u in plan.units}
    assert by == {
        "model.layers.0": ("bf16", "fp32", None),          # no entry: global
        "model.layers.1.mlp": ("bf16", "fp32", None),      # its own bf16 entry beats the fp32 one above it
        "model.layers.1": ("fp32", "fp32", "bf16"),         # class unit made fp32 by its entry
        "": ("bf16", "fp32", None),                         # the root never takes an entry
    }


def test_entry_above_units_makes_them_all_fp32() -> None:
    _, plan = plan_of("fsdp.module_precision={model: fp32}")
    assert paths(plan) == [*QWEN_LAYERS, "model", ""]
    assert [u.param_dtype for u in plan.units] == ["fp32", "fp32", "fp32", "bf16"]
    assert plan.unit("model").num_params == EMBED_PARAMS + 32  # embed_tokens + norm
    assert plan.unit("").num_params == EMBED_PARAMS            # lm_head


def test_two_entries_on_one_module_with_different_values_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        plan_of('fsdp.module_precision={"model.layers.{*}": bf16, model.layers.1: fp32}')
    assert info.value.key == "fsdp.module_precision.model.layers.1"
    assert "'model.layers.1' is also named by another module_precision entry" in str(info.value)
    assert "keep one entry per module" in str(info.value)


def test_two_entries_on_one_module_with_equal_values_agree() -> None:
    _, plan = plan_of('fsdp.module_precision={"model.layers.{*}": fp32, model.layers.1: {param_dtype: fp32}}')
    assert [plan.unit(p).param_dtype for p in QWEN_LAYERS] == ["fp32", "fp32"]


# ------------------------------------------------------------------ ignored, recompute


def test_ignored_module_drops_units_inside_it() -> None:
    _, plan = plan_of("fsdp.ignored_modules=[model.layers.1]", world=2)
    assert paths(plan) == ["model.layers.0", ""]
    assert plan.ignored == ["model.layers.1"]
    assert plan.warnings == [
        "unit 'model.layers.1' lies inside ignored module; not wrapped",
        "ignored module 'model.layers.1' keeps its fp32 parameters while the unit around it (root) "
        "computes in bf16; its inputs may arrive in another dtype",
    ]
    assert sum(u.num_params for u in plan.units) == QWEN_LAYER_PARAMS + 2 * EMBED_PARAMS + 32


def test_ignored_module_in_fp32_compute_needs_no_dtype_note() -> None:
    _, plan = plan_of("fsdp.ignored_modules=[model.layers.1]", "fsdp.mixed_precision.param_dtype=fp32")
    assert paths(plan) == ["model.layers.0", ""]
    assert plan.warnings == ["unit 'model.layers.1' lies inside ignored module; not wrapped"]


def test_ignored_module_inside_a_unit_keeps_the_unit_smaller() -> None:
    _, plan = plan_of("fsdp.ignored_modules=[model.layers.{*}.mlp, model.layers.0.mlp.up_proj]")
    assert paths(plan) == [*QWEN_LAYERS, ""]
    assert plan.ignored == ["model.layers.0.mlp", "model.layers.1.mlp"]  # outermost only
    assert [plan.unit(p).num_params for p in QWEN_LAYERS] == [QWEN_LAYER_PARAMS - 3 * 2048] * 2
    # the dtype note names the innermost unit around each ignored module
    assert len(plan.warnings) == 2
    for i, w in enumerate(plan.warnings):
        assert w.startswith(f"ignored module 'model.layers.{i}.mlp' keeps its fp32 parameters while the unit "
                            f"around it (model.layers.{i}) computes in bf16"), w


def test_recompute_flags_units_and_lists_inner_modules() -> None:
    _, plan = plan_of("model.config.num_hidden_layers=4", "fsdp.recompute.modules=[model.layers.{1,3}, Qwen3MLP]",
                      "fsdp.recompute.use_reentrant=true")
    assert [u.recompute for u in plan.units] == [False, True, False, True, False]
    assert plan.recompute == ["model.layers.1", "model.layers.3",
                              "model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp", "model.layers.3.mlp"]
    assert plan.use_reentrant is True


def test_offload_marks_every_unit() -> None:
    _, plan = plan_of("fsdp.offload.enabled=true")
    assert [u.offload for u in plan.units] == [True, True, True]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], []),
        (["train.compile=true"], QWEN_LAYERS),
        # every non-root unit, nested ones and the embeddings / head included; never the root
        (["train.compile=true", "fsdp.wrap.embeddings=true", "fsdp.wrap.lm_head=true",
          "fsdp.module_precision={model.layers.0.mlp: fp32}"],
         ["model.embed_tokens", "model.layers.0.mlp", *QWEN_LAYERS, "lm_head"]),
    ],
)
def test_compile_marks_every_non_root_unit(overrides: list[str], expected: list[str]) -> None:
    from shardwise.cli import format_plan

    _, plan = plan_of(*overrides)
    assert [u.path for u in plan.units if u.compiled] == plan.compiled == expected
    assert plan.unit("").compiled is False
    assert [u["compiled"] for u in plan.to_json()["units"]] == [u.path in expected for u in plan.units]
    lines = [ln for ln in format_plan(plan).splitlines() if ln.startswith("compiled")]
    assert lines == ([f"compiled (torch.compile, one per unit): {', '.join(expected)}"] if expected else [])


# ---------------------------------------------------------------------------- prefetch


def test_prefetch_forward_2_backward_1_on_4_layers() -> None:
    _, plan = plan_of("model.config.num_hidden_layers=4", "fsdp.prefetch={forward: 2, backward: 1}")
    got = {u.path: (u.prefetch_forward, u.prefetch_backward) for u in plan.units}
    assert got == {
        "model.layers.0": (["model.layers.1", "model.layers.2"], []),
        "model.layers.1": (["model.layers.2", "model.layers.3"], ["model.layers.0"]),
        "model.layers.2": (["model.layers.3"], ["model.layers.1"]),
        "model.layers.3": ([], ["model.layers.2"]),
        "": ([], []),
    }


def test_prefetch_follows_forward_order_over_top_level_units_only() -> None:
    _, plan = plan_of("fsdp.wrap.embeddings=true", "fsdp.wrap.lm_head=true",
                      "fsdp.module_precision={model.layers.0.mlp: fp32}", "fsdp.prefetch={forward: 1, backward: 2}")
    got = {u.path: (u.prefetch_forward, u.prefetch_backward) for u in plan.units}
    assert got == {
        "model.embed_tokens": (["model.layers.0"], []),
        "model.layers.0.mlp": ([], []),  # nested in model.layers.0: no prefetch of its own
        "model.layers.0": (["model.layers.1"], ["model.embed_tokens"]),
        "model.layers.1": (["lm_head"], ["model.layers.0", "model.embed_tokens"]),
        "lm_head": ([], ["model.layers.1", "model.layers.0"]),
        "": ([], []),
    }


def test_prefetch_zero_is_empty_lists() -> None:
    _, plan = plan_of("fsdp.prefetch={forward: 0, backward: 0}")
    assert all(u.prefetch_forward == [] and u.prefetch_backward == [] for u in plan.units)


# ---------------------------------------------------------------------------- reshard


@pytest.mark.parametrize(
    ("world", "overrides", "expected"),
    [
        (4, [], True),
        (4, ["fsdp.reshard_after_forward=false"], False),
        (4, ["fsdp.reshard_after_forward=4"], True),     # == shard group size: full reshard
        (4, ["fsdp.reshard_after_forward=2"], 2),
        (4, ["fsdp.reshard_after_forward=1"], False),    # a group of one: keep parameters
        (8, ["fsdp.reshard_after_forward=4"], 4),
        (4, ["parallel.fsdp_size=2", "fsdp.reshard_after_forward=2"], True),  # HSDP: shard group is 2
        (4, ["parallel.fsdp_size=2", "fsdp.reshard_after_forward=1"], False),
        (4, ["parallel.sharding_strategy=hybrid_shard", "parallel.fsdp_size=2"], True),
        (2, ["parallel.sharding_strategy=shard_grad_op"], False),
        (2, ["parallel.sharding_strategy=shard_grad_op", "fsdp.reshard_after_forward=false"], False),
        (2, ["parallel.sharding_strategy=no_shard"], False),
        (4, ["parallel.sharding_strategy=no_shard", "parallel.fsdp_size=1"], False),
    ],
)
def test_reshard_after_forward(world: int, overrides: list[str], expected) -> None:
    _, plan = plan_of(*overrides, world=world)
    for u in plan.units[:-1]:
        assert u.reshard_after_forward == expected and type(u.reshard_after_forward) is type(expected), u
    root = plan.unit("")
    assert root.reshard_after_forward is False


# ----------------------------------------------------------------------- plan --json


def test_plan_json_from_the_cli() -> None:
    example = "examples/tiny_qwen3.yaml"
    proc = run_cli(["plan", example, "--world-size", "2", "--json"], timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)

    assert got["world_size"] == 2
    assert got["mesh"] == {"world_size": 2, "replicate": 1, "shard": 2, "ulysses": 1, "strategy": "full_shard",
                           "dim_names": ["shard"], "shape": [2], "dp_size": 2}
    units = got["units"]
    assert [u["path"] for u in units] == ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
                                          "model.norm", "lm_head", ""]
    for u in units:
        assert {"path", "param_dtype", "reduce_dtype", "reshard_after_forward", "offload", "recompute",
                "compiled"} <= set(u)
    assert [u["recompute"] for u in units] == [True, True, False, False, False, False, False]
    assert [u["compiled"] for u in units] == [False] * 7  # the example leaves train.compile off
    assert [u["param_dtype"] for u in units] == ["bf16"] * 4 + ["fp32", "fp32", "bf16"]
    assert units[-1]["reshard_after_forward"] is False
    mem = got["memory_per_rank_bytes"]
    assert set(mem) == {"params", "grads", "optimizer", "total", "by_rank"}
    assert len(mem["by_rank"]) == 2
    assert mem["total"] == mem["params"] + mem["grads"] + mem["optimizer"]

    # the same object the library computes in-process
    cfg = load_config(REPO_ROOT / example)
    spec = mesh_spec(cfg.parallel, 2)
    model, plan = plan_for(cfg, spec)
    # the CLI adds the step's communication (shardwise.fsdp.comm; tests/test_plan_comm.py)
    plan.comm = step_comm(model, plan, spec, accumulation=check_sft_batch(cfg.train, spec.dp_size),
                          micro_batch_size=cfg.train.micro_batch_size, max_length=cfg.data.max_length, gpus_per_node=8)
    assert got == json.loads(json.dumps(plan.to_json()))


# ---------------------------------------------------------------------- memory estimate

# One layer, hidden 8, heads 2 x head_dim 4, one kv head, intermediate 12, vocab 10. Parameters
# (rows x cols): embed 10x8, q 8x8, k 4x8, v 4x8, o 8x8, q_norm 4, k_norm 4, gate 12x8, up 12x8,
# down 8x12, 2 layer norms 8, final norm 8, lm_head 10x8: 672 elements in 14 tensors.
MICRO = ("model.config={model_type: qwen3, hidden_size: 8, intermediate_size: 12, num_hidden_layers: 1, "
         "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 4, vocab_size: 10, "
         "max_position_embeddings: 16, tie_word_embeddings: false}")


def mem(params: int, grads: int, optimizer: int) -> dict[str, int]:
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


# fp32 master, world 1: params = grads = 672 x 4 = 2688; AdamW = 2 x 2688 + 14 steps x 4 = 5432.
W1 = mem(2688, 2688, 5432)
# world 2: every dim0 is even: 336 elements per rank -> 1344; AdamW 2 x 1344 + 56 = 2744.
W2 = mem(1344, 1344, 2744)
# world 4: padded rows ceil(dim0/4): embed and lm_head 3 rows (24 el.), q/o 16, k/v 8, norms of 4 -> 1,
# gate/up 24, down 2x12 = 24, norms of 8 -> 2: 176 elements -> 704 bytes on every rank. AdamW state
# follows torch.chunk: embed/lm_head rows 3,3,3,1, so rank 3 holds 176 - 2 x 2 x 8 = 144 elements.
W4 = mem(704, 704, 2 * 176 * 4 + 56)
W4_LAST = mem(704, 704, 2 * 144 * 4 + 56)


@pytest.mark.parametrize(
    ("world", "overrides", "expected"),
    [
        pytest.param(1, [], [W1], id="world1"),
        pytest.param(2, [], [W2, W2], id="world2"),
        pytest.param(4, [], [W4, W4, W4, W4_LAST], id="world4-uneven-rows"),
        pytest.param(4, ["parallel.fsdp_size=2"], [W2] * 4, id="hsdp-4x2-holds-like-world2"),
        pytest.param(2, ["parallel.sharding_strategy=no_shard"], [W1, W1], id="no-shard-holds-everything"),
        # bf16 master with an fp32 norm: 664 x 2 + 8 x 4 = 1360; AdamW 2 x 1360 + 56
        pytest.param(1, ["model.dtype=bf16", "fsdp.module_precision={model.norm: fp32}"], [mem(1360, 1360, 2776)],
                     id="bf16-master-fp32-norm"),
        # frozen lm_head: no grads, no AdamW state for its 80 elements (13 trainable tensors)
        pytest.param(1, ["model.freeze=[lm_head]"], [mem(2688, 592 * 4, 2 * 592 * 4 + 13 * 4)], id="frozen-head"),
        # ignored lm_head on 2 ranks: 592 elements sharded -> 296 x 4 = 1184, plus the whole head 320;
        # AdamW 2 x 1184 + 13 x 4 sharded and 2 x 320 + 4 for the head
        pytest.param(2, ["fsdp.ignored_modules=[lm_head]"], [mem(1504, 1504, 2420 + 644)] * 2, id="ignored-head"),
    ],
)
def test_memory_per_rank(world: int, overrides: list[str], expected: list[dict[str, int]]) -> None:
    _, plan = plan_of("fsdp.mixed_precision.param_dtype=bf16", *overrides, world=world, base=MICRO)
    assert plan.memory_per_rank_bytes == expected
    peak = plan.to_json()["memory_per_rank_bytes"]
    for k in ("params", "grads", "optimizer", "total"):
        assert peak[k] == max(r[k] for r in expected)
    assert peak["by_rank"] == expected


# ------------------------------------------------------------------------------- LoRA

LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj]"]
LORA_LAYER = 4 * (32 + 32) + 4 * (32 + 16)  # r x (in + out): q_proj 32 -> 32, v_proj 32 -> 16 (2 kv heads x 8)
ROOT_PARAMS = 2 * EMBED_PARAMS + 32          # embed_tokens, lm_head, model.norm


def test_lora_trainable_and_frozen_params_per_unit() -> None:
    model, plan = plan_of(*LORA)
    assert paths(plan) == [*QWEN_LAYERS, ""]  # adapters live in the units of the modules they adapt
    assert [u.trainable_params for u in plan.units] == [LORA_LAYER, LORA_LAYER, 0]
    assert [u.frozen_params for u in plan.units] == [QWEN_LAYER_PARAMS, QWEN_LAYER_PARAMS, ROOT_PARAMS]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(u.trainable_params for u in plan.units) == trainable == plan.lora.trainable_params == 2 * LORA_LAYER
    assert plan.lora.total_params == 2 * QWEN_LAYER_PARAMS + ROOT_PARAMS + 2 * LORA_LAYER
    assert (plan.lora.r, plan.lora.alpha) == (4, 16.0)
    assert plan.lora.targets == [f"model.layers.{i}.self_attn.{m}_proj" for i in (0, 1) for m in "qv"]
    assert plan.lora.units == QWEN_LAYERS
    units = plan.to_json()["units"]
    assert [(u["trainable_params"], u["frozen_params"]) for u in units] == [
        (LORA_LAYER, QWEN_LAYER_PARAMS), (LORA_LAYER, QWEN_LAYER_PARAMS), (0, ROOT_PARAMS)]


def test_without_lora_every_parameter_trains_and_no_lora_section() -> None:
    _, plan = plan_of("model.freeze=[model.layers.1]")
    assert [(u.trainable_params, u.frozen_params) for u in plan.units] == [
        (QWEN_LAYER_PARAMS, 0), (0, QWEN_LAYER_PARAMS), (ROOT_PARAMS, 0)]
    assert plan.lora is None and plan.to_json()["lora"] is None


@pytest.mark.parametrize(
    ("world", "overrides"),
    [
        pytest.param(1, [], id="fp32"),
        pytest.param(2, ["model.freeze=[model.layers.0]"], id="freeze-a-layer"),
        # modules to save are fp32 with LoRA, the bf16 master without; an fp32 norm either way
        pytest.param(4, ["model.dtype=bf16", "model.lora.modules_to_save=[lm_head]",
                         "fsdp.module_precision={model.norm: fp32}"], id="bf16-saved-head-uneven-rows"),
        pytest.param(2, ["model.lora.target_modules=[all-linear]", "fsdp.ignored_modules=[model.layers.1.mlp]"],
                     id="all-linear-ignored-mlp"),
        pytest.param(4, ["parallel.fsdp_size=2", "fsdp.wrap.lm_head=true"], id="hsdp-head-unit"),
    ],
)
def test_lora_memory_without_lora_is_the_plan_with_lora_off(world: int, overrides: list[str]) -> None:
    _, with_lora = plan_of(*LORA, *overrides, world=world)
    _, off = plan_of(*LORA, *overrides, "model.lora.enabled=false", world=world)
    assert with_lora.lora.memory_per_rank_bytes_without_lora == off.memory_per_rank_bytes
    for lora_rank, full_rank in zip(with_lora.memory_per_rank_bytes, off.memory_per_rank_bytes, strict=True):
        assert lora_rank["total"] < full_rank["total"] and lora_rank["grads"] < full_rank["grads"]
    assert paths(with_lora) == paths(off)


def test_lora_adapters_keep_fp32_in_a_bf16_model() -> None:
    # MICRO, bf16 master, r=2 on q_proj (8 -> 8): A 2x8 + B 8x2 = 32 fp32 elements in 2 tensors beside
    # 672 bf16 ones (frozen). tests/test_memory_estimate.py's measurement holds the same bytes.
    _, plan = plan_of("model.dtype=bf16", "model.lora.enabled=true", "model.lora.r=2",
                      "model.lora.target_modules=[q_proj]", base=MICRO)
    assert plan.memory_per_rank_bytes == [mem(672 * 2 + 32 * 4, 32 * 4, 2 * 32 * 4 + 2 * 4)]
    # without LoRA: 672 bf16 elements, all trained, 14 tensors
    assert plan.lora.memory_per_rank_bytes_without_lora == [mem(1344, 1344, 2 * 1344 + 14 * 4)]


def test_lora_json_and_table_line() -> None:
    from shardwise.cli import format_plan

    _, plan = plan_of(*LORA, world=2)
    lora = json.loads(json.dumps(plan.to_json()))["lora"]
    assert set(lora) == {"r", "alpha", "targets", "units", "trainable_params", "total_params",
                         "memory_per_rank_bytes", "memory_per_rank_bytes_without_lora"}
    assert lora["memory_per_rank_bytes"] == plan.to_json()["memory_per_rank_bytes"]
    without = lora["memory_per_rank_bytes_without_lora"]
    assert set(without) == {"params", "grads", "optimizer", "total", "by_rank"} and len(without["by_rank"]) == 2

    table = format_plan(plan).splitlines()
    head = next(ln for ln in table if ln.startswith("#  unit"))
    col = head.index("trainable")
    rows = [ln for ln in table if ln.startswith(("0  ", "1  ", "2  "))]
    assert [r[col:].strip() for r in rows] == [f"{LORA_LAYER:,}", f"{LORA_LAYER:,}", "-"]
    total = 2 * QWEN_LAYER_PARAMS + ROOT_PARAMS + 2 * LORA_LAYER
    w, wo = lora["memory_per_rank_bytes"]["total"], without["total"]
    line = next(ln for ln in table if ln.startswith("LoRA"))
    assert line.startswith(f"LoRA (r=4, 4 adapters on 2 units): trainable {2 * LORA_LAYER:,} of {total:,} "
                           f"parameters ({2 * LORA_LAYER / total:.1%}); per-rank memory with LoRA "), line
    assert line.endswith(f" without (saves {1 - w / wo:.0%})"), line
    assert not any(ln.startswith("LoRA") for ln in format_plan(plan_of(world=2)[1]).splitlines())


def test_a_config_with_an_rl_section_is_planned_with_the_rl_batch_rules(capsys) -> None:
    # `shardwise plan examples/grpo_reverse.yaml` refused the config by SFT's batch rule (32
    # prompts is no multiple of 128 rows x 2 ranks) unless --rl was given
    rl_rows = ["rl.rollout.n=8", "train.global_batch_size=32", "train.micro_batch_size=128"]
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        check_sft_batch(load_config(None, [TINY_QWEN3, *rl_rows]).train, 2)
    plan_job.show(load_config(None, [TINY_QWEN3, *rl_rows]), 2)
    assert "world size 2" in capsys.readouterr().out
