"""Build or load HF models: on the meta device for planning and sharding, in full on rank 0
only for the weights, which then reach the other ranks' shards by broadcast.

The flow (driven by `shardwise.fsdp.build_sharded_model`):
  meta model -> plan -> apply_plan (fully_shard on meta) -> to_empty(device) ->
  `load_full_weights`: rank 0 builds/reads the full model on CPU, every rank receives its
  shard (DCP's broadcast_from_rank0), non-persistent buffers are broadcast too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from transformers import AutoConfig
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from shardwise.config.dtypes import to_torch_dtype
from shardwise.config.schema import ModelConfig
from shardwise.errors import ConfigError, did_you_mean
from shardwise.models.layout import checkpoint_entries
from shardwise.models.patterns import match_pattern
from shardwise.models.vision import is_vision_language

_TASKS = ("causal_lm", "masked_lm", "sequence_classification", "token_classification")

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.bin")
"""Weight files that are pickles: refused, since unpickling a file can run code."""


def check_weights_folder(path: str | os.PathLike[str], key: str = "model.path") -> list[Path]:
    """The safetensors files of the HF folder `path`, checked without loading any weight.

    Raises ConfigError on `key` when the folder is missing, has no config.json, holds only
    pickled weights (pytorch_model.bin: unpickling can run code, so shardwise never does; the
    message says how to convert), holds no weights at all, lists a shard in its index that is
    absent, or has a safetensors file whose header is unreadable or promises more bytes than
    the file holds (a truncated copy).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(key, f"{str(folder)!r} " + ("is a file, not a folder" if folder.exists()
                                                     else "does not exist"),
                          "point it at a folder written by save_pretrained")
    if not (folder / "config.json").is_file():
        raise ConfigError(key, f"{str(folder)!r} holds no config.json", "point it at a folder written by save_pretrained")
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(key, f"{str(index)!r} is not a readable safetensors index ({type(e).__name__})",
                              "write the folder again with save_pretrained") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(key, f"{str(folder)!r}: {SAFETENSORS_INDEX} lists {missing[0]!r}, which is missing"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                              "copy the whole folder")
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted({p.name for pat in PICKLE_WEIGHTS for p in folder.glob(pat)})
        if pickles:
            raise ConfigError(key, f"{str(folder)!r} holds only pickled weights ({', '.join(pickles[:3])}), which "
                              "shardwise does not load because unpickling can run code",
                              "convert the folder once in a Python you trust: AutoModelForCausalLM.from_pretrained("
                              "DIR).save_pretrained(NEW_DIR) writes model.safetensors")
        raise ConfigError(key, f"{str(folder)!r} holds config.json but no weights (*.safetensors)",
                          "point it at a folder written by save_pretrained, or use model.config for a random init")
    for f in files:
        _check_safetensors_header(f, key)
    return files


def _check_safetensors_header(file: Path, key: str) -> None:
    """The 8-byte header length, the JSON header and the data size it promises."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError("header length does not fit the file")
            header = json.loads(fh.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError) as e:
        raise ConfigError(key, f"{str(file)!r} is not a readable safetensors file ({e})",
                          "copy or write the folder again") from None
    if 8 + n + end > size:
        raise ConfigError(key, f"{str(file)!r} is truncated: its header promises {8 + n + end} bytes, the file has "
                          f"{size}", "copy or write the folder again")


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """``{tensor name: (shape, file)}`` from the headers of checked safetensors files
    (`check_weights_folder`); no weight is read."""
    out: dict[str, tuple[tuple[int, ...], Path]] = {}
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, v in header.items():
            if name != "__metadata__":
                out[name] = (tuple(int(d) for d in v.get("shape", ())), f)
    return out


def check_weight_shapes(model: nn.Module, path: str | os.PathLike[str], key: str = "model.path") -> None:
    """ConfigError on `key` when a tensor of the folder's weights has another shape than the
    model its config.json builds (`model`, on the meta device): transformers would stop on
    rank 0 after launch. Compared under the checkpoint's names (fused MoE experts cut per
    expert); tensors whose names the model does not use are left to transformers' own
    renaming rules."""
    shapes = safetensors_shapes(check_weights_folder(path, key))
    sd = model.state_dict()
    for e in checkpoint_entries(model, [(k, k, tuple(v.shape), v.dtype) for k, v in sd.items()]):
        if e.name in shapes and shapes[e.name][0] != e.shape:
            got, file = shapes[e.name]
            raise ConfigError(key, f"{e.name} in {str(file)!r} has shape {list(got)}, but the model its config.json "
                              f"builds wants {list(e.shape)}",
                              "the weights belong to another config: copy the folder's own config.json, or "
                              "write the folder again with save_pretrained")


def _auto_class(task: str, cfg=None):
    """The transformers Auto class of `task`; a vision-language config's causal LM is its
    image-text-to-text class (Qwen2.5-VL's ForConditionalGeneration)."""
    if task == "causal_lm" and cfg is not None and is_vision_language(cfg):
        return transformers.AutoModelForImageTextToText
    return {
        "causal_lm": transformers.AutoModelForCausalLM,
        "masked_lm": transformers.AutoModelForMaskedLM,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
        "token_classification": transformers.AutoModelForTokenClassification,
    }[task]


def is_encoder_config(cfg) -> bool:
    """Whether the HF config `cfg` is an encoder: a model type with a masked-LM head that is
    neither a decoder (``is_decoder``) nor an encoder-decoder (bert, roberta, distilbert ...)."""
    return (getattr(cfg, "model_type", None) in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(cfg, "is_decoder", False) and not getattr(cfg, "is_encoder_decoder", False))


def check_task(cfg, task: str) -> None:
    """The HF config `cfg` has a model class for `task` (``model.task``); ConfigError naming
    ``model.task`` and the nearest task it has otherwise.

    An encoder (`is_encoder_config`) is not a causal LM, even where
    transformers has a ``*LMHeadModel`` for it (that needs ``is_decoder: true``). A type
    transformers knows no causal-LM class for is left to the loader (it may have its own).
    A decoder's sequence classifier scores each row's last token, found through the
    config's ``pad_token_id``: it must be set (to the tokenizer's pad id).
    """
    model_type = getattr(cfg, "model_type", None)
    names = {
        "masked_lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "sequence_classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    }
    encoder = is_encoder_config(cfg)
    if task == "sequence_classification" and not encoder and getattr(cfg, "pad_token_id", None) is None:
        raise ConfigError("model.config.pad_token_id", f"is not set: a {model_type} sequence classifier finds each "
                          "row's last token by it", "set it to the tokenizer's pad id (the built-in tokenizer's is 0)")
    if task == "causal_lm":
        if not encoder:
            return
    elif task not in names or model_type in names[task]:
        return
    valid = [t for t, m in names.items() if model_type in m]
    if not encoder and model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        valid.insert(0, "causal_lm")
    what = ("an encoder (no causal-LM head; is_decoder is false)" if task == "causal_lm"
            else f"a model type without a {task} head")
    raise ConfigError("model.task", f"{task!r} does not fit this {model_type} config, {what}",
                      (did_you_mean(task, valid) or "") if valid else "use another model.config / model.path")


def load_hf_config(model: ModelConfig, **extra):
    """The HF PretrainedConfig of `model.path` or of the inline `model.config`."""
    if model.path is not None:
        path = Path(model.path)
        if not (path / "config.json").is_file():
            raise ConfigError("model.path", f"{str(path)!r} holds no config.json",
                              "point it at a folder written by save_pretrained")
        try:
            cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=model.trust_remote_code)
        except (ValueError, OSError, KeyError) as e:
            raise ConfigError("model.path", f"cannot read {str(path / 'config.json')!r}: {e}") from e
    elif model.config is not None:
        fields = dict(model.config)
        model_type = fields.pop("model_type")
        if model_type not in CONFIG_MAPPING:
            raise ConfigError("model.config.model_type", f"unknown model_type {model_type!r}",
                              did_you_mean(str(model_type), list(CONFIG_MAPPING.keys())))
        try:
            cfg = AutoConfig.for_model(model_type, **fields)
        except Exception as e:  # HF validates fields with its own exception types
            raise ConfigError("model.config", f"transformers rejected the {model_type} config: {e}") from e
    else:
        raise ConfigError("model", "no model given", "set model.path (a local HF folder) or model.config")
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def build_meta_model(model: ModelConfig, task: str = "causal_lm", **config_extra) -> nn.Module:
    """The model's structure on the meta device (no memory), in the master dtype."""
    cfg = load_hf_config(model, **config_extra)
    check_task(cfg, task)
    try:
        with torch.device("meta"):
            m = _auto_class(task, cfg).from_config(cfg, dtype=to_torch_dtype(model.dtype),
                                              attn_implementation=model.attn_implementation,
                                              trust_remote_code=model.trust_remote_code)
    except ImportError as e:
        raise ConfigError("model.attn_implementation", f"{model.attn_implementation!r} is not usable here: {e}",
                          "use sdpa or eager") from e
    except ValueError as e:
        # transformers' message may list every model class it knows: keep its first sentence.
        first = " ".join(str(e).split())
        first = first.split(". ")[0][:300]
        raise ConfigError("model", f"transformers cannot build a {task} model from this "
                          f"{getattr(cfg, 'model_type', '?')} config: {first}",
                          "check model.config / model.path's config.json (model_type, sizes)") from None
    return m


def build_full_model(model: ModelConfig, seed: int, task: str = "causal_lm", **config_extra) -> nn.Module:
    """The whole model on CPU with real weights: read from `model.path`, or a seeded random init.

    Used by rank 0 only during sharded loading, and by unsharded reference runs.
    """
    dtype = to_torch_dtype(model.dtype)
    cfg = load_hf_config(model, **config_extra)
    cls = _auto_class(task, cfg)
    # Seeded either way: from a folder, weights the folder lacks (a new value or reward
    # head) are initialised too, and must not depend on the process's RNG history.
    fork_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        if model.path is not None:
            m = cls.from_pretrained(model.path, config=cfg, dtype=dtype, use_safetensors=True,
                                    attn_implementation=model.attn_implementation,
                                    trust_remote_code=model.trust_remote_code)
        else:
            m = cls.from_config(cfg, dtype=dtype, attn_implementation=model.attn_implementation,
                                trust_remote_code=model.trust_remote_code)
    return m


def non_persistent_buffers(model: nn.Module) -> list[str]:
    """Names of buffers that are not in the state dict (e.g. rotary inv_freq)."""
    names = []
    for mod_name, mod in model.named_modules():
        for b in sorted(getattr(mod, "_non_persistent_buffers_set", ())):  # one order on every rank
            names.append(f"{mod_name}.{b}" if mod_name else b)
    return names


def load_full_weights(sharded: nn.Module, full: nn.Module | None, device: torch.device) -> None:
    """Fill a sharded, materialised (`to_empty`) model from rank 0's full model.

    `full` is the CPU model on rank 0 and None elsewhere. Each rank keeps only its shard;
    host memory holds one full copy (rank 0's), whatever the number of ranks.
    """
    rank = dist.get_rank()
    assert (full is not None) == (rank == 0), "exactly rank 0 passes the full model"
    full_sd = full.state_dict() if full is not None else {}
    set_model_state_dict(sharded, full_sd,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers are not in any state dict; send rank 0's values.
    full_bufs = dict(full.named_buffers()) if full is not None else {}
    # The broadcast runs on `device` (NCCL sends device tensors only): a buffer held on
    # another device (CPU offload materialises the model in host memory) goes through a copy.
    for name in non_persistent_buffers(sharded):
        buf = sharded.get_buffer(name)
        wire = buf if buf.device == device else torch.empty_like(buf, device=device)
        if rank == 0:
            wire.copy_(full_bufs[name].to(device=device, dtype=buf.dtype))
        dist.broadcast(wire, src=0)
        if wire is not buf:
            buf.copy_(wire)


def frozen_modules(patterns: list[str], module_paths: list[str], param_paths: list[str]) -> list[str]:
    """The module paths ``model.freeze``'s `patterns` name (PatternError otherwise)."""
    return [path for i, pat in enumerate(patterns)
            for path in match_pattern(pat, module_paths, param_paths, key=f"model.freeze[{i}]")]


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """requires_grad=False for every parameter under the matched modules; returns their paths."""
    if not patterns:
        return []
    frozen = frozen_modules(patterns, [n for n, _ in model.named_modules()], [n for n, _ in model.named_parameters()])
    for path in frozen:
        for p in model.get_submodule(path).parameters():
            p.requires_grad_(False)
    return frozen


