"""LoRA adapters (``model.lora``): peft's LoRA layers injected into the HF model in place,
before sharding.

`inject` replaces each target Linear by peft's ``lora.Linear`` (the original layer becomes
its ``base_layer``; ``lora_A`` / ``lora_B`` hold the adapter, B zero-initialised, so the
model starts as the base). The model stays the HF model: module paths, FSDP units and
the plan's patterns are unchanged, only the targets gain ``.base_layer`` in their
parameter names. Every base parameter is frozen; the adapters (and ``modules_to_save``)
train and are kept in fp32 whatever ``model.dtype`` is, so a bf16 model has fp32 master
adapters. peft's ``get_peft_model`` would wrap the model in a ``PeftModel`` and prefix
every path; in place, shardwise's names, units and checkpoints keep the HF layout.

Names (`hf_name`, `adapter_key`): ``X.base_layer.weight`` is the base model's
``X.weight``; ``X.lora_A.default.weight`` is ``base_model.model.X.lora_A.weight`` in a
PEFT adapter file (what ``PeftModel.from_pretrained`` reads), and a module to save is
written under its own name there. `merge` gives ``W + (alpha / r) * B @ A``, the weight
peft's ``merge_and_unload`` writes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shardwise.config.schema import LoraSettings
from shardwise.errors import ConfigError, PatternError, nearest
from shardwise.models.patterns import match_pattern

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["ADAPTER", "adapter_key", "adapter_state", "adapters_disabled", "hf_name", "inject", "is_lora_key",
           "lora_config", "lora_modules", "merge", "merge_sources", "read_adapter", "resolve_targets",
           "saved_modules", "trainable_count"]

ADAPTER = "default"
"""The adapter's name inside the model (peft's default)."""
ALL_LINEAR = "all-linear"


# ---------------------------------------------------------------- which modules


def _resolve(entries: list[str], model: nn.Module, key: str) -> list[str]:
    """Module paths named by `entries` (patterns or plain names), in model order."""
    names = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]
    chosen: set[str] = set()
    for i, entry in enumerate(entries):
        k = f"{key}[{i}]"
        if entry == ALL_LINEAR:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            chosen.update(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head)
        elif "." in entry or "{" in entry:
            chosen.update(match_pattern(entry, names, params, key=k))
        else:
            found = [n for n in names if n.rsplit(".", 1)[-1] == entry]
            if not found:
                leaves = sorted({n.rsplit(".", 1)[-1] for n in names if not n.rsplit(".", 1)[-1].isdigit()})
                near = nearest(entry, leaves)
                raise PatternError(k, f"no module is named {entry!r}",
                                   ("nearest names: " + ", ".join(near)) if near else f"names: {', '.join(leaves)}")
            chosen.update(found)
    return [n for n in names if n in chosen]


def resolve_targets(model: nn.Module, lora: LoraSettings) -> list[str]:
    """The Linear modules that get adapters: ``target_modules`` less ``exclude_modules``.
    PatternError for an entry that names nothing; ConfigError when a target is not a
    Linear (naming it and its type) or nothing is left."""
    targets = _resolve(lora.target_modules, model, "model.lora.target_modules")
    if lora.exclude_modules:
        out = set(_resolve(lora.exclude_modules, model, "model.lora.exclude_modules"))
        targets = [t for t in targets if t not in out]
    if not targets:
        raise ConfigError("model.lora.target_modules", "no module is left after model.lora.exclude_modules",
                          "exclude fewer modules")
    odd = [(t, type(model.get_submodule(t)).__name__) for t in targets
           if not isinstance(model.get_submodule(t), nn.Linear)]
    if odd:
        shown = ", ".join(f"{t} ({kind})" for t, kind in odd[:4]) + (f" and {len(odd) - 4} more" if len(odd) > 4 else "")
        raise ConfigError("model.lora.target_modules", f"adapters go on Linear modules only, not {shown}",
                          "name the Linear projections inside them, e.g. q_proj or model.layers.{*}.mlp.down_proj")
    return targets


def lora_config(model: nn.Module, lora: LoraSettings) -> LoraConfig:
    """peft's LoraConfig for `lora` on `model`: an adapter folder's own (``path``) or one
    built from the settings, with the targets and modules to save as exact paths."""
    from peft import LoraConfig  # peft (0.3 s of imports) only for a run that uses LoRA

    if lora.path is not None:
        return _folder_config(lora.path)
    saved = _resolve(lora.modules_to_save, model, "model.lora.modules_to_save") if lora.modules_to_save else None
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=resolve_targets(model, lora), modules_to_save=saved, bias="none")


def _folder_config(path: str) -> LoraConfig:
    from peft import LoraConfig

    folder = Path(path).expanduser()
    cfg_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not (cfg_file.is_file() and weights.is_file()):
        raise ConfigError("model.lora.path", f"{path!r} is not a PEFT adapter folder (it needs adapter_config.json "
                          "and adapter_model.safetensors)", "point it at a folder written by save_pretrained of a "
                          "PeftModel or by shardwise (run.dir/adapter)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (ValueError, OSError) as e:
        raise ConfigError("model.lora.path", f"{cfg_file} is not readable JSON: {e}", "rewrite it") from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError("model.lora.path", f"{path!r} holds a {raw.get('peft_type')} adapter, not LoRA",
                          "give a LoRA adapter folder")
    known = set(LoraConfig.__dataclass_fields__)
    return LoraConfig(**{k: v for k, v in raw.items() if k in known and k not in ("peft_type",)})


# ---------------------------------------------------------------- injecting


def inject(model: nn.Module, lora: LoraSettings, seed: int | None = None) -> LoraConfig | None:
    """Add the adapters of `lora` to `model` in place (its device: meta or real) and freeze
    everything else; None (and nothing done) when LoRA is off. Adapters and modules to save
    are fp32; `seed` seeds the adapters' initialisation (A: peft's Kaiming-uniform, B: 0).
    With ``lora.path`` the adapter folder's tensors replace the initial ones. The LoraConfig
    used is kept on the model (``model.peft_config``, as peft does), with the modules to
    save, which are trained in place (not wrapped as peft would)."""
    if not lora.enabled:
        return None
    from peft import inject_adapter_in_model

    config = lora_config(model, lora)
    device = next(model.parameters()).device
    saved = tuple(config.modules_to_save or ())
    in_place = copy.copy(config)
    in_place.modules_to_save = None  # trained where they are: peft would wrap them and rename their weights
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng, torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        inject_adapter_in_model(in_place, model, adapter_name=ADAPTER)
    model.peft_config = {ADAPTER: config}
    for name, p in model.named_parameters():
        trainable = is_lora_key(name) or any(name == s or name.startswith(s + ".") for s in saved)
        p.requires_grad_(trainable)
        if trainable and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    if lora.path is not None:  # checked on the meta model (before launch), loaded into the real one
        state = model.state_dict()
        tensors = read_adapter(lora.path, state, saved, shapes_only=device.type == "meta")
        with torch.no_grad():
            for key, t in tensors.items():
                state[key].copy_(t)
    return config


def saved_modules(model: nn.Module) -> tuple[str, ...]:
    """The modules to save of an injected model's LoraConfig (none without LoRA)."""
    config = getattr(model, "peft_config", {}).get(ADAPTER)
    return tuple(config.modules_to_save or ()) if config is not None else ()


def is_lora_key(name: str) -> bool:
    """`name` (a parameter or state-dict key) is an adapter tensor."""
    return ".lora_A." in name or ".lora_B." in name


def lora_modules(model: nn.Module) -> dict[str, float]:
    """``{module path: scale}`` of every adapter layer (scale = alpha / r)."""
    return {path: float(m.scaling[ADAPTER]) for path, m in _lora_layers(model)
            if ADAPTER in getattr(m, "scaling", {})}


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, layer) of every peft LoRA layer in `model`. A model holds none while peft is
    not imported (`inject` imports it; a run without LoRA never does): then peft is not
    imported here either."""
    lora = sys.modules.get("peft.tuners.lora")
    if lora is None:
        return []
    return [(path, m) for path, m in model.named_modules() if isinstance(m, lora.LoraLayer)]


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model for the block: every adapter layer's output is the base layer's (the
    RL reference policy without a second copy of the weights)."""
    layers = [m for _, m in _lora_layers(model)]
    before = [m.disable_adapters for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m.enable_adapters(not was)


# ---------------------------------------------------------------- names and merging


def hf_name(key: str) -> str:
    """The base model's (HF) name of a state-dict key: ``.base_layer`` dropped."""
    return key.replace(".base_layer.", ".")


def adapter_key(key: str) -> str:
    """The name of an adapter tensor (or a module to save's) in a PEFT adapter file."""
    return "base_model.model." + key.replace(f".{ADAPTER}.", ".")


def merge_sources(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """``{base weight key: (A key, B key, scale)}`` of every adapter layer: what to gather
    with a base weight to write it merged."""
    out = {}
    for path, scale in lora_modules(model).items():
        out[f"{path}.base_layer.weight"] = (f"{path}.lora_A.{ADAPTER}.weight", f"{path}.lora_B.{ADAPTER}.weight", scale)
    return out


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * b @ a`` in fp32, returned in `weight`'s dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def adapter_state(model_state: dict[str, torch.Tensor], saved: tuple[str, ...] = ()) -> dict[str, str]:
    """``{state-dict key: adapter-file key}`` of the tensors a PEFT adapter file holds: the
    adapters and the modules to save."""
    out = {}
    for key in model_state:
        if is_lora_key(key):
            out[key] = adapter_key(key)
        elif any(key.startswith(s + ".") for s in saved):
            out[key] = "base_model.model." + key
    return out


def read_adapter(path: str, model_state: dict[str, torch.Tensor], saved: tuple[str, ...] = (),
                 shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of the adapter folder `path` under `model_state`'s keys, checked
    against their shapes (ConfigError on ``model.lora.path`` naming the tensor); with
    `shapes_only` nothing is loaded (the check alone, as on a meta model) and {} returned."""
    file = Path(path).expanduser() / "adapter_model.safetensors"
    out = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            stored = set(f.keys())
            for key, name in adapter_state(model_state, saved).items():
                if name not in stored:
                    raise ConfigError("model.lora.path", f"{file} has no tensor {name!r} (this base model has that "
                                      "adapter)", "the adapter was made for another base model or other target modules")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(model_state[key].shape):
                    raise ConfigError("model.lora.path", f"tensor {name!r} of {file} has shape {shape}, this base "
                                      f"model's is {tuple(model_state[key].shape)}",
                                      "the adapter was made for another base model")
                if not shapes_only:
                    out[key] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ConfigError("model.lora.path", f"{file} is not a readable safetensors file: {e}", "rewrite it") from None
    return out
