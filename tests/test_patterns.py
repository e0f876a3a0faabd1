"""The module path pattern grammar (`shardwise.models.patterns`), as tables of inputs and outputs.

All cases run against one fixed list of module paths: a synthetic 24-layer model whose layers
0-3 and 12 hold 8 experts each (`model.layers.{i}.mlp.experts.{j}`), the other layers a dense
`up_proj`, plus a ModuleDict (`model.heads`, children `policy` and `value`).
"""

from __future__ import annotations

import pytest

from shardwise.errors import PatternError
from shardwise.models.patterns import compress_indices, match_pattern

NUM_LAYERS = 24
MOE_LAYERS = (0, 1, 2, 3, 12)
NUM_EXPERTS = 8


def _module_paths() -> list[str]:
    """`named_modules()` names of the synthetic model, in model order (root "" first)."""
    out = ["", "model", "model.embed_tokens", "model.layers"]
    for i in range(NUM_LAYERS):
        b = f"model.layers.{i}"
        out += [b, f"{b}.self_attn", f"{b}.self_attn.q_proj", f"{b}.mlp"]
        if i in MOE_LAYERS:
            out += [f"{b}.mlp.gate", f"{b}.mlp.experts"]
            out += [f"{b}.mlp.experts.{j}" for j in range(NUM_EXPERTS)]
        else:
            out += [f"{b}.mlp.up_proj"]
    out += ["model.norm", "model.heads", "model.heads.policy", "model.heads.value", "lm_head"]
    return out


MODULES = _module_paths()
# every leaf module owns one parameter called `weight`
PARAMS = [f"{p}.weight" for p in MODULES if p and not any(q.startswith(p + ".") for q in MODULES)]


def layers(*idx: int, suffix: str = "") -> list[str]:
    return [f"model.layers.{i}{suffix}" for i in idx]


def experts(layer_idx, expert_idx) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{j}" for i in layer_idx for j in expert_idx]


MATCHES = [
    # (pattern, expected module paths in model order)
    pytest.param("model.layers.{*}", layers(*range(24)), id="star-every-layer"),
    pytest.param("model.layers.{5}", layers(5), id="one-index"),
    pytest.param("model.layers.{0}", layers(0), id="index-zero"),
    pytest.param("model.layers.{23}", layers(23), id="last-index"),
    pytest.param("model.layers.{0-3}", layers(0, 1, 2, 3), id="range-inclusive"),
    pytest.param("model.layers.{7-7}", layers(7), id="range-of-one"),
    pytest.param("model.layers.{0-23}", layers(*range(24)), id="range-full"),
    pytest.param("model.layers.{1,3,5}", layers(1, 3, 5), id="list"),
    pytest.param("model.layers.{5,1,3}", layers(1, 3, 5), id="list-unsorted-gives-model-order"),
    pytest.param("model.layers.{2,2,2}", layers(2), id="list-duplicates-once"),
    pytest.param("model.layers.{0-3,8,10-11}", layers(0, 1, 2, 3, 8, 10, 11), id="mixed-list"),
    pytest.param("model.layers.{0-2,1-3}", layers(0, 1, 2, 3), id="overlapping-ranges"),
    pytest.param("model.layers.{*}.self_attn", layers(*range(24), suffix=".self_attn"), id="suffix-after-star"),
    pytest.param("model.layers.{4-5}.self_attn.q_proj", layers(4, 5, suffix=".self_attn.q_proj"),
                 id="two-segment-suffix"),
    pytest.param("model.layers.{*}.mlp.experts", layers(*MOE_LAYERS, suffix=".mlp.experts"),
                 id="star-where-only-some-have-suffix"),
    pytest.param("model.layers.{*}.mlp.up_proj",
                 layers(*[i for i in range(24) if i not in MOE_LAYERS], suffix=".mlp.up_proj"),
                 id="star-dense-layers-only"),
    pytest.param("model.layers.{0-3}.mlp.experts.{*}", experts(range(4), range(8)), id="two-groups-range-star"),
    pytest.param("model.layers.{*}.mlp.experts.{0,7}", experts(MOE_LAYERS, (0, 7)), id="two-groups-star-list"),
    pytest.param("model.layers.{2,12}.mlp.experts.{1-2}", experts((2, 12), (1, 2)), id="two-groups-list-range"),
    pytest.param("model.layers.{12}.mlp.experts.{*}", experts((12,), range(8)), id="experts-of-one-layer"),
    pytest.param("model.heads.{*}", ["model.heads.policy", "model.heads.value"], id="star-over-moduledict"),
    pytest.param("model.heads.value", ["model.heads.value"], id="literal-moduledict-child"),
    pytest.param("{*}", ["model", "lm_head"], id="star-at-top-never-root"),
    pytest.param("lm_head", ["lm_head"], id="literal-top"),
    pytest.param("model", ["model"], id="literal-parent"),
    pytest.param("model.norm", ["model.norm"], id="literal-nested"),
    pytest.param("model.layers.3.mlp.experts.7", ["model.layers.3.mlp.experts.7"], id="literal-deep-index"),
    pytest.param("model.layers", ["model.layers"], id="literal-container"),
]


@pytest.mark.parametrize(("pattern", "expected"), MATCHES)
def test_match_pattern(pattern: str, expected: list[str]) -> None:
    assert match_pattern(pattern, MODULES, PARAMS) == expected


ERRORS = [
    # (pattern, fragments the message must hold besides the pattern itself)
    pytest.param("model.layer.{0}", ["matches no module", "model.layers.{*}"], id="typo-nearest-collapsed"),
    pytest.param("model.nrom", ["matches no module", "model.norm"], id="typo-nearest-literal"),
    pytest.param("model.heads.valeu", ["matches no module", "model.heads.value"], id="typo-moduledict-child"),
    pytest.param("model.layers.{5}.mlp.experts.{0}", ["matches no module", "model.layers.{*}.mlp.experts.{*}"],
                 id="dense-layer-has-no-experts"),
    pytest.param("model.layers.{24}", ["index 24", "out of range", "model.layers has {0-23}"],
                 id="index-past-end"),
    pytest.param("model.layers.{20-30}", ["index 24-30", "out of range", "model.layers has {0-23}"],
                 id="range-partly-out"),
    pytest.param("model.layers.{0,99,100}", ["index 99-100", "out of range", "{0-23}"], id="list-partly-out"),
    pytest.param("model.layers.{0-3}.mlp.experts.{8}",
                 ["index 8", "out of range", "model.layers.0.mlp.experts has {0-7}"], id="second-group-out"),
    pytest.param("model.heads.{0}", ["index 0", "out of range", "model.heads"], id="index-into-moduledict"),
    pytest.param("lm_head.weight", ["names a parameter", "'lm_head'"], id="parameter-top"),
    pytest.param("model.layers.5.mlp.up_proj.weight", ["names a parameter", "'model.layers.5.mlp.up_proj'"],
                 id="parameter-deep"),
    pytest.param("model.layers.{}", ["empty brace group", "{*}"], id="empty-group"),
    pytest.param("model.layers.{ }", ["empty brace group"], id="blank-group"),
    pytest.param("model.layers.{3-1}", ["runs backwards", "{1-3}"], id="backwards-range"),
    pytest.param("model.layers.{a}", ["bad item 'a'", "{0-3,8}"], id="letter-item"),
    pytest.param("model.layers.{1,}", ["bad item ''"], id="trailing-comma"),
    pytest.param("model.layers.{-1}", ["bad item '-1'"], id="negative-index"),
    pytest.param("model.layers.{1-}", ["bad item '1-'"], id="open-range"),
    pytest.param("model.layers.{**}", ["bad item '**'"], id="double-star"),
    pytest.param("model.layers.x{1}", ["mixes text and a brace group"], id="text-before-group"),
    pytest.param("model.layers.{1}x", ["mixes text and a brace group"], id="text-after-group"),
    pytest.param("model.layers.{{0}}", ["mixes text and a brace group"], id="nested-braces"),
    pytest.param("model.layers.{0-3", ["unbalanced braces"], id="unclosed-brace"),
    pytest.param("model.layers.0-3}", ["unbalanced braces"], id="unopened-brace"),
    pytest.param("model..layers", ["empty segment"], id="double-dot"),
    pytest.param(".model", ["empty segment"], id="leading-dot"),
    pytest.param("model.", ["empty segment"], id="trailing-dot"),
    pytest.param("model.layers.*", ["bare '*'", "{*}"], id="bare-star"),
    pytest.param("*", ["bare '*'", "{*}"], id="bare-star-alone"),
    pytest.param("", ["empty module pattern"], id="empty-pattern"),
]


@pytest.mark.parametrize(("pattern", "fragments"), ERRORS)
def test_match_pattern_errors(pattern: str, fragments: list[str]) -> None:
    with pytest.raises(PatternError) as info:
        match_pattern(pattern, MODULES, PARAMS, key="fsdp.wrap.modules[3]")
    msg = str(info.value)
    assert info.value.key == "fsdp.wrap.modules[3]"
    assert msg.startswith("config error at 'fsdp.wrap.modules[3]': ")
    assert repr(pattern) in msg, msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


def test_parameter_hint_needs_param_paths() -> None:
    """Without the parameter list a parameter path is just a path that matches nothing."""
    with pytest.raises(PatternError, match="matches no module"):
        match_pattern("lm_head.weight", MODULES)


@pytest.mark.parametrize(
    ("indices", "expected"),
    [
        ([], ""),
        ([5], "5"),
        ([0, 1], "0-1"),
        ([0, 2, 4], "0,2,4"),
        ([0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"),
        ([11, 10, 8, 3, 2, 1, 0], "0-3,8,10-11"),
        ([3, 1, 2, 2, 1], "1-3"),
        (list(range(24)), "0-23"),
        ([24, 25, 26, 27, 28, 29, 30], "24-30"),
        ([0, 23], "0,23"),
    ],
)
def test_compress_indices(indices: list[int], expected: str) -> None:
    assert compress_indices(indices) == expected
