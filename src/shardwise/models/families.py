"""Which model families keep a state along the sequence, and what that means for packing.

A packed row holds several documents end to end, each with position ids restarting at 0.
Attention layers keep them apart through the block-diagonal mask transformers builds from
those restarts. Layers that carry a state from token to token (linear attention such as
Gated DeltaNet, Mamba / Mamba2 SSMs, short convolutions) see no mask: in transformers 5.19
their torch code runs the whole row as one sequence, so each document starts from the
state the previous one left (Qwen3.5's second document: logits 0.33 off on a tiny model).

Three answers, from the HF config alone (so a job can decide before launch):

- ``"attention"``: no layer keeps a sequence state; packing is exact as transformers does it.
- ``"bounded"``: the sequence-state layers are in `BOUNDED` and
  `shardwise.models.patches.documents` gives them the documents' boundaries, so packing is
  exact (each document's logits are those it has alone).
- ``"refused"``: a sequence-state layer shardwise cannot give boundaries to, or attention
  that does not see the restarts (`RESTARTS_IGNORED`): ``data.packing`` (and an explicit
  ``rl.packing: true``) are refused before launch; RL's own packing falls back to unpacked
  rows (`packs`).

Checked on transformers 5.19.0.
"""

from __future__ import annotations

from typing import Literal

from shardwise.errors import ConfigError

__all__ = ["BOUNDED", "RESTARTS_IGNORED", "PackingRule", "bounded_mixers", "check_packing", "packing_rule", "packs",
           "rl_packing_note", "sequence_state"]

PackingRule = Literal["attention", "bounded", "refused"]

STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba"})
"""Entries of a config's ``layer_types`` whose layers keep a state along the sequence
(transformers 5.19's names: Mamba and Gated DeltaNet layers are ``linear_attention``, LFM2's
short convolutions ``conv``, Falcon-H1's attention-plus-Mamba layers ``hybrid``)."""

STATEFUL_TYPES: dict[str, str] = {
    "rwkv": "RWKV time mixing",
    "recurrent_gemma": "RG-LRU recurrence",
    "xlstm": "xLSTM cells",
}
"""Model types with a sequence state that their config's ``layer_types`` does not show."""

RESTARTS_IGNORED: dict[str, str] = {
    "gpt_oss": "its attention mask is built without the position ids",
    "granitemoehybrid": "its attention mask is built without the position ids",
}
"""Model types whose attention layers let packed documents see each other: transformers
5.19 builds their causal mask without ``position_ids`` (``create_causal_mask(...)`` gets
none), so the restarts that mark a packed row's documents are never seen (measured: the
second document's logits 0.15-0.3 away from the document alone)."""

BOUNDED: dict[str, tuple[str, ...]] = {
    "qwen3_5": ("Qwen3_5GatedDeltaNet",),
    "qwen3_5_text": ("Qwen3_5GatedDeltaNet",),
    "qwen3_next": ("Qwen3NextGatedDeltaNet",),
    "lfm2": ("Lfm2ShortConv",),
    "falcon_h1": ("FalconH1Mixer",),
    "granitemoehybrid": ("GraniteMoeHybridMambaLayer",),
    "nemotron_h": ("NemotronHMamba2Mixer",),
}
"""model_type -> its sequence-state layer classes that `shardwise.models.patches.documents`
runs one document at a time (each was compared, packed against alone, in
tests/test_families.py)."""


def _text_config(hf_config):
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def sequence_state(hf_config) -> str | None:
    """What keeps a state along the sequence in this model (a short description: the layer
    types, e.g. ``"linear_attention"``), or None when every layer is attention / MLP."""
    text = _text_config(hf_config)
    for model_type in (getattr(hf_config, "model_type", None), getattr(text, "model_type", None)):
        if model_type in STATEFUL_TYPES:
            return STATEFUL_TYPES[model_type]
    kinds = sorted(set(getattr(text, "layer_types", None) or ()) & STATE_LAYER_TYPES)
    return ", ".join(kinds) + " layers" if kinds else None


def _types(hf_config) -> set[str]:
    return {getattr(hf_config, "model_type", None), getattr(_text_config(hf_config), "model_type", None)} - {None}


def packing_rule(hf_config) -> PackingRule:
    """``"attention"``, ``"bounded"`` or ``"refused"`` for this HF config (module docstring)."""
    types = _types(hf_config)
    if types & RESTARTS_IGNORED.keys():
        return "refused"
    if sequence_state(hf_config) is None:
        return "attention"
    return "bounded" if types & BOUNDED.keys() else "refused"


def packs(hf_config) -> bool:
    """Whether documents may share a row (packed layouts) for this model."""
    return packing_rule(hf_config) != "refused"


def bounded_mixers() -> frozenset[str]:
    """Every layer class `shardwise.models.patches.documents` gives document boundaries."""
    return frozenset(c for classes in BOUNDED.values() for c in classes)


def _why(hf_config) -> str:
    name = getattr(hf_config, "model_type", "?")
    ignored = sorted(_types(hf_config) & RESTARTS_IGNORED.keys())
    if ignored:
        reason = f"model type {name!r}: {RESTARTS_IGNORED[ignored[0]]} (transformers' own code)"
    else:
        reason = (f"model type {name!r} keeps a state along the sequence ({sequence_state(hf_config)}) that "
                  "shardwise cannot give document boundaries")
    return reason + ", so packed documents would see each other"


def check_packing(hf_config, data_packing: bool, rl_packing: bool | None) -> None:
    """ConfigError before launch when packing is asked of a model whose rule is "refused":
    ``data.packing: true`` (SFT), or ``rl.packing: true`` set explicitly (RL's default,
    unset, falls back to unpacked rows instead, `rl_packing_note`)."""
    if packs(hf_config):
        return
    if data_packing:
        raise ConfigError("data.packing", _why(hf_config), "set data.packing=false")
    if rl_packing:
        raise ConfigError("rl.packing", _why(hf_config), "leave rl.packing unset (rows then run unpacked)")


def rl_packing_note(hf_config, rl_packing: bool | None) -> str | None:
    """The one line an RL run logs when its default packing is turned off for this model."""
    if rl_packing is None and not packs(hf_config):
        return f"rl.packing: {_why(hf_config)}; the RL forwards run unpacked rows (compact or padded)"
    return None
