"""Other systems' FSDP2 configs (ROLL, MindSpeed, RLinf) as shardwise configs.

``shardwise convert --from roll|mindspeed|rlinf FILE [--out FILE]`` writes the shardwise
YAML, one comment per key naming the key of FILE it came from;
``shardwise plan|train|infer|rl FILE --dialect NAME [key=value ...]`` converts the same way in
memory and then applies the overrides, which is how keys the dialect file does not hold
(the model, the data) are given: ``model.config={model_type: qwen3, ...}``, ``model.path=DIR``,
``data.source=...``.

Rules, for every dialect:

- Every key of the file is converted or refused. A key with no shardwise meaning, an
  unknown key, a dtype name the dialect does not have: `ConfigError` naming the file and
  the key, what is wrong and the nearest valid choice (exit status 2 from the CLI), before
  any process starts. The file is read with YAML's safe loader, and ROLL's
  ``device_mapping`` (Python text that ROLL evaluates) is parsed by a tiny grammar
  (`parse_device_mapping`), never evaluated.
- Where the dialect's default differs from shardwise's, the dialect's default is written
  out (MindSpeed ``use_reentrant: true``, ``pin_memory: false``; HF TrainingArguments'
  learning rate, warmup and schedule for ROLL's ``training_args``), and its comment says so.
- A device count in the file (ROLL ``device_mapping``) is no config key in shardwise: it is
  the default of ``--nproc`` (train, infer, rl) and ``--world-size`` (plan), and it sizes
  ``train.global_batch_size`` (ROLL counts batches per device).

Accepted shapes:

- ROLL: one worker section (``actor_train`` or ``reference``) holding ``model_args``,
  ``training_args``, ``strategy_args`` (``strategy_name: fsdp2_train | fsdp2_infer``,
  ``strategy_config``), ``device_mapping``, ``infer_batch_size``; or those keys at the top
  of the file; or a bare ``strategy_config`` (the fragments of ROLL's docs).
- MindSpeed: the flat ``fsdp2_config.yaml`` table (``--fsdp2-config-path``).
- RLinf: ``actor: {model: {...}, training_backend: fsdp, micro_batch_size, global_batch_size}``.

The keys (ROLL's ``strategy_config`` is ``strategy_args.strategy_config``):

ROLL                                          shardwise
``strategy_config.fsdp_size``                 ``parallel.fsdp_size`` (<= 1: auto; with ulysses_size > 1
                                              and fsdp_size unset, <= 1 or >= devices: devices / ulysses_size)
``strategy_config.param_dtype/reduce_dtype``  ``fsdp.mixed_precision.param_dtype/reduce_dtype``
``strategy_config.reshard_after_forward``     ``fsdp.reshard_after_forward``
``strategy_config.offload_policy``            ``fsdp.offload.enabled``
``strategy_config.wrap_policy.*``             ``fsdp.wrap.classes`` (transformer_layer_cls_to_wrap),
                                              ``.embeddings`` (wrap_embeddings), ``.lm_head``
                                              (wrap_lm_output), ``.moe_experts``
``strategy_config.apply_expert_patch``        ``fsdp.moe_expert_patch``
``strategy_config.apply_tiled_mlp``           ``fsdp.tiled_mlp.enabled``; tiled_num_shards: ``.shards``
``strategy_config.async_save_ckpt``           ``checkpoint.async``
``model_args.dtype``                          ``model.dtype``
``model_args.ulysses_size``                   ``parallel.ulysses_size``
``model_args.disable_gradient_checkpointing`` ``fsdp.recompute.modules``: false (ROLL's default, for a
                                              training worker) recomputes the wrapped layer classes, else
                                              ``model.layers.{*}`` (HF's decoder layers); true: []
``model_args.freeze_module_prefix``           ``model.freeze`` (comma-separated prefixes, as module paths)
``model_args.model_type``                     must be null (the model comes from model.path / model.config)
``training_args.learning_rate``, ``weight_decay``, ``adam_beta1/2``, ``adam_epsilon``
                                              ``train.optimizer.lr``, ``.weight_decay``, ``.betas``, ``.eps``
``training_args.max_grad_norm``               ``train.grad_clip`` (0: null)
``training_args.warmup_steps``, ``lr_scheduler_type``, ``max_steps``, ``seed``
                                              ``train.scheduler.warmup_steps``, ``.name`` (min_lr_ratio 0,
                                              as HF decays to 0), ``train.max_steps``, ``run.seed``
``training_args.per_device_train_batch_size`` ``train.micro_batch_size``
``training_args.gradient_accumulation_steps`` ``train.global_batch_size`` = micro x accumulation x
                                              devices / ulysses_size (needs ``device_mapping``)
``training_args.num_train_epochs``            not converted (shardwise counts steps): a note, a comment
``device_mapping``                            ranks: the default ``--nproc`` / ``--world-size``
``infer_batch_size``                          ``infer.batch_size``
``reference`` (the section)                   ``rl.reference.enabled: true``

MindSpeed                                     shardwise
``sharding_size``                             ``parallel.fsdp_size`` (auto, n > 1); 1 (MindSpeed's default):
                                              ``parallel.sharding_strategy: no_shard`` (shard groups of one)
``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``
                                              ``fsdp.mixed_precision.*`` (param_dtype unset: the model's
                                              dtype, fp32; reduce_dtype unset: param_dtype)
``sub_modules_to_wrap``                       ``fsdp.wrap.modules`` (patterns), ``fsdp.wrap.classes`` (class names)
``ignored_modules``                           ``fsdp.ignored_modules``
``recompute_modules``, ``use_reentrant``      ``fsdp.recompute.modules``, ``.use_reentrant`` (default true)
``reshard_after_forward``                     ``fsdp.reshard_after_forward``
``offload_to_cpu``, ``pin_memory``            ``fsdp.offload.enabled``, ``.pin_memory`` (default false)
``num_to_forward/backward_prefetch``          ``fsdp.prefetch.forward/backward``

RLinf                                         shardwise
``actor.model.enable_layered_fsdp`` + ``modules_precision``
                                              ``fsdp.module_precision`` ({path: dtype}); modules_precision
                                              without enable_layered_fsdp is an error
``actor.model.precision``                     ``fsdp.mixed_precision.param_dtype`` (the outer units)
``actor.model.sharding_strategy``             ``parallel.sharding_strategy``
``actor.micro_batch_size/global_batch_size``  ``train.micro_batch_size/global_batch_size``
``actor.training_backend``                    must be fsdp
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shardwise.config.dtypes import canonical_dtype
from shardwise.config.load import apply_overrides, config_from_dict, read_yaml_mapping
from shardwise.config.schema import Config
from shardwise.errors import ConfigError, did_you_mean, short_repr

__all__ = ["DIALECTS", "Converted", "check_out_file", "convert", "load_dialect_config", "parse_device_mapping", "read_dialect"]

Key = tuple[str, ...]

_NAMES = {"roll": "ROLL", "mindspeed": "MindSpeed", "rlinf": "RLinf"}
DIALECTS = tuple(_NAMES)

# The dtype names each system accepts (ROLL: roll.distributed.strategy.fsdp2_strategy._parse_dtype;
# MindSpeed and RLinf: their documented tables). fp64 is ROLL's but no shardwise dtype.
_DTYPES: dict[str, tuple[str, ...]] = {
    "roll": ("bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float"),
    "mindspeed": ("bf16", "fp16", "fp32"),
    "rlinf": ("fp32", "bf16", "fp16"),
}

# Top-level order of the written file: the schema's section order.
_SECTION_ORDER = ("run", "model", "parallel", "fsdp", "train", "data", "checkpoint", "rl", "infer")


@dataclass
class Converted:
    """A dialect file as a shardwise config dict, with where each key came from."""

    dialect: str
    source: str
    """The dialect file's path, as given."""
    config: dict[str, Any] = field(default_factory=dict)
    """Nested shardwise keys, ready for `apply_overrides` and `config_from_dict`."""
    origins: dict[Key, str] = field(default_factory=dict)
    """Path of each written leaf (section names, then the key) -> the source key, in words."""
    world_size: int | None = None
    """Ranks the file names (ROLL device_mapping), or None."""
    header: list[str] = field(default_factory=list)
    """Lines the written file starts with (what was read, what is still to set)."""
    notes: list[str] = field(default_factory=list)
    """Keys read but not converted, with the reason; written as comments and said on stderr."""

    def set(self, key: str | Key, value: Any, origin: str) -> None:
        """Write one shardwise key; two source keys that disagree on it are an error."""
        path = tuple(key.split(".")) if isinstance(key, str) else key
        node = self.config
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if path[-1] in node and node[path[-1]] != value:
            raise ConfigError(f"{self.source}:{origin}",
                              f"sets {'.'.join(path)} to {short_repr(value)}, but {self.origins[path]} set it to "
                              f"{short_repr(node[path[-1]])}", "keep one of the two")
        node[path[-1]] = value
        self.origins[path] = origin

    def to_yaml(self) -> str:
        """The shardwise YAML: header comments, then every key with `# <- source key`."""
        lines = [f"# {h}" for h in self.header]
        lines += [f"# not converted: {n}" for n in self.notes]
        order = {name: i for i, name in enumerate(_SECTION_ORDER)}
        top = dict(sorted(self.config.items(), key=lambda kv: order.get(kv[0], len(order))))
        _emit(top, self.origins, (), 0, lines)
        return "\n".join(lines) + "\n"


def _emit(node: dict, origins: dict[Key, str], path: Key, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for k, v in node.items():
        here = (*path, k)
        if isinstance(v, dict) and here not in origins:
            lines.append(f"{pad}{_flow(k)}:")
            _emit(v, origins, here, depth + 1, lines)
        else:
            lines.append(f"{pad}{_flow(k)}: {_flow(v)}  # <- {origins[here]}")


def _flow(value: Any) -> str:
    """One value as flow YAML on one line (strings quoted where YAML needs it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


# --------------------------------------------------------------------------- reading


class _Map:
    """One mapping of the dialect file. Keys are taken one at a time; `done` refuses the
    rest, each with the nearest key this section knows."""

    def __init__(self, data: Any, where: str, known: Sequence[str], ctx: _Ctx):
        if not isinstance(data, dict):
            raise ConfigError(ctx.key(where), f"must be a mapping, got {type(data).__name__} {short_repr(data)}")
        self.data, self.where, self.known, self.ctx = dict(data), where, tuple(known), ctx

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else str(name)

    def has(self, name: str) -> bool:
        return name in self.data

    def take(self, name: str, default: Any = None) -> Any:
        assert name in self.known, name
        return self.data.pop(name, default)

    def sub(self, name: str, known: Sequence[str]) -> _Map | None:
        if name not in self.data or self.data[name] is None:
            self.data.pop(name, None)
            return None
        return _Map(self.take(name), self.key(name), known, self.ctx)

    def done(self) -> None:
        for name in self.data:
            raise ConfigError(self.ctx.key(self.key(str(name))),
                              f"unknown {self.ctx.name} key, or one without a shardwise meaning",
                              did_you_mean(str(name), self.known, f"{self.where}." if self.where else ""))


@dataclass
class _Ctx:
    dialect: str
    source: str

    @property
    def name(self) -> str:
        return _NAMES[self.dialect]

    def key(self, dialect_key: str) -> str:
        return f"{self.source}:{dialect_key}"

    def error(self, dialect_key: str, problem: str, hint: str | None = None) -> ConfigError:
        return ConfigError(self.key(dialect_key), problem, hint)

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f"got {short_repr(value)}, expected true or false")
        return value

    def integer(self, value: Any, key: str, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.error(key, f"got {short_repr(value)}, expected an integer >= {low}")
        return value

    def number(self, value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"got {short_repr(value)}, expected a number")
        if not math.isfinite(value):
            raise self.error(key, f"got {short_repr(value)}: must be a finite number")
        return float(value)

    def names(self, value: Any, key: str) -> list[str]:
        """A list of strings (a single string is a list of one)."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.error(key, f"got {short_repr(value)}, expected a list of names")
        return list(value)

    def dtype(self, value: Any, key: str) -> str:
        """A dtype name of this dialect -> shardwise's canonical name."""
        valid = _DTYPES[self.dialect]
        text = value.strip().lower() if isinstance(value, str) else None
        if text in ("fp64", "float64", "double") and self.dialect == "roll":
            raise self.error(key, f"{short_repr(value)}: shardwise computes and stores in fp32, bf16 or fp16 only",
                             "use fp32")
        if text not in valid:
            raise self.error(key, f"{short_repr(value)} is not a {self.name} dtype",
                             did_you_mean(str(value), valid) or "valid: " + ", ".join(valid))
        return canonical_dtype(text)


def read_dialect(path: str | Path, dialect: str) -> Converted:
    """Read a dialect file (safe YAML loader) and convert it. Raises ConfigError."""
    return convert(read_yaml_mapping(path), dialect, str(path))


def check_out_file(out: str | Path, source: str | Path) -> None:
    """ConfigError on ``--out`` when the converted YAML cannot be written there: a directory,
    a folder that does not exist, or the dialect file being converted."""
    o, src = Path(out), Path(source)
    if o.is_dir():
        raise ConfigError("--out", f"{str(o)!r} is a directory", f"name a file, e.g. {o / (src.stem + '_shardwise.yaml')}")
    if not o.parent.is_dir():
        raise ConfigError("--out", f"the folder of {str(o)!r} does not exist", "create it first, or name a file in "
                          "an existing folder")
    if o.exists() and src.exists() and o.resolve() == src.resolve():
        raise ConfigError("--out", f"{str(o)!r} is the file being converted", f"name another file, e.g. "
                          f"{o.with_name(o.stem + '_shardwise.yaml')}")


def load_dialect_config(path: str | Path, dialect: str,
                        overrides: Sequence[str] = ()) -> tuple[Config, Converted]:
    """A dialect file, converted, plus `key=value` overrides (which complete what the file
    does not say: the model, the data) -> the validated Config and the conversion."""
    conv = read_dialect(path, dialect)
    return config_from_dict(apply_overrides(conv.config, list(overrides))), conv


def convert(raw: dict[str, Any], dialect: str, source: str = "<config>") -> Converted:
    """A dialect's config (plain data, as YAML's safe loader gives it) -> `Converted`."""
    if dialect not in _CONVERTERS:
        raise ConfigError("--dialect", f"unknown dialect {dialect!r}", did_you_mean(dialect, DIALECTS))
    out = Converted(dialect=dialect, source=source)
    ctx = _Ctx(dialect, source)
    _CONVERTERS[dialect](raw, out, ctx)
    out.header.insert(0, f"shardwise config converted from {source} ({_NAMES[dialect]} dialect)")
    if "model" not in out.config or not ({"path", "config"} & set(out.config["model"])):
        out.header.append("still to set: the model (model.path=DIR or model.config={...}) and the data "
                          "(data.source=...), as key=value overrides or keys added here")
    return out


# --------------------------------------------------------------------------- ROLL

_ROLL_ROLES = ("actor_train", "reference")
_ROLL_WORKER = ("model_args", "training_args", "strategy_args", "strategy_config", "device_mapping",
                "infer_batch_size")
_ROLL_STRATEGIES = ("fsdp2_train", "fsdp2_infer")
_ROLL_MODEL_ARGS = ("dtype", "ulysses_size", "disable_gradient_checkpointing", "freeze_module_prefix",
                    "model_type")
_ROLL_TRAINING_ARGS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                       "max_grad_norm", "per_device_train_batch_size", "gradient_accumulation_steps",
                       "warmup_steps", "lr_scheduler_type", "max_steps", "num_train_epochs", "seed")
_ROLL_STRATEGY_CONFIG = ("fsdp_size", "param_dtype", "reduce_dtype", "reshard_after_forward", "offload_policy",
                         "wrap_policy", "apply_expert_patch", "apply_tiled_mlp", "tiled_num_shards",
                         "async_save_ckpt")
_ROLL_WRAP = ("transformer_layer_cls_to_wrap", "wrap_embeddings", "wrap_lm_output", "moe_experts")
# HF TrainingArguments' lr_scheduler_type -> shardwise's schedule after warmup.
_HF_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
_HF_DEFAULT = "HF TrainingArguments default"

_INT = r"\s*(\d{1,9})\s*"  # 9 digits: a device id, not a number of 5,000 digits
_RANGE = re.compile(rf"^\s*list\s*\(\s*range\s*\({_INT}(?:,{_INT}(?:,{_INT})?)?\)\s*\)\s*$")
_LIST = re.compile(r"^\s*\[\s*(\d{1,9}\s*(?:,\s*\d{1,9}\s*)*)?,?\s*\]\s*$")
MAX_DEVICES = 65536
"""Most device ids a device_mapping may name (ROLL's list(range(...)) is read, not run)."""


def parse_device_mapping(value: Any, key: str = "device_mapping") -> list[int]:
    """ROLL's device_mapping -> device ids. Grammar (nothing else is read, nothing is
    evaluated): ``list(range(B))``, ``list(range(A, B))``, ``list(range(A, B, S))`` with
    non-negative integer literals, ``[i, j, ...]`` as text, or a YAML list of integers."""
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                 for v in value):
        return list(value)
    if isinstance(value, str):
        m = _RANGE.match(value)
        if m:
            nums = [int(g) for g in m.groups() if g is not None]
            start, stop, step = (0, nums[0], 1) if len(nums) == 1 else (nums[0], nums[1], nums[2] if len(nums) == 3 else 1)
            if step >= 1 and stop > start:
                if len(range(start, stop, step)) > MAX_DEVICES:
                    raise ConfigError(key, f"{short_repr(value)} names {len(range(start, stop, step)):,} devices, more "
                                      f"than the {MAX_DEVICES:,} shardwise reads", "e.g. list(range(0,8))")
                return list(range(start, stop, step))
        m = _LIST.match(value)
        if m and m.group(1):
            return [int(x) for x in m.group(1).split(",")]
    raise ConfigError(key, f"{short_repr(value)} is not a device list: shardwise reads list(range(A,B)) or [0, 1, ...] "
                      "and never evaluates code", "e.g. list(range(0,8))")


def _roll(raw: dict[str, Any], out: Converted, ctx: _Ctx) -> None:
    roles = [r for r in _ROLL_ROLES if r in raw]
    if len(roles) > 1:
        raise ctx.error(roles[1], f"the file holds {' and '.join(roles)}; shardwise trains one model with one plan "
                        "(the reference uses the actor's)", f"convert one worker section at a time, e.g. {roles[0]}")
    if roles:
        role = roles[0]
        top = _Map(raw, "", _ROLL_ROLES, ctx)
        worker = _Map(top.take(role), role, _ROLL_WORKER, ctx)
        top.done()
    else:
        role = None
        worker = _Map(raw, "", _ROLL_WORKER + _ROLL_ROLES, ctx)

    strategy_name = None
    sargs = worker.sub("strategy_args", ("strategy_name", "strategy_config"))
    sc = None
    if sargs is not None:
        strategy_name = sargs.take("strategy_name")
        if strategy_name is not None and strategy_name not in _ROLL_STRATEGIES:
            raise ctx.error(sargs.key("strategy_name"), f"{short_repr(strategy_name)}: shardwise is an FSDP2 trainer",
                            did_you_mean(str(strategy_name), _ROLL_STRATEGIES))
        sc = sargs.sub("strategy_config", _ROLL_STRATEGY_CONFIG)
        sargs.done()
    bare = worker.sub("strategy_config", _ROLL_STRATEGY_CONFIG)
    if bare is not None:
        if sc is not None:
            raise ctx.error(bare.where, "given twice: here and under strategy_args", "keep strategy_args.strategy_config")
        sc = bare
    training = strategy_name == "fsdp2_train" or (strategy_name is None and role != "reference")
    out.header.append(f"ROLL worker {role or '(keys at the top)'}, strategy {strategy_name or 'not named'}"
                      + ("" if training else " (forward only: no recompute, no training_args)"))
    if role == "reference":
        out.set("rl.reference.enabled", True, "reference (the reference policy's worker)")

    devices = None
    if worker.has("device_mapping"):
        where = worker.key("device_mapping")
        text = worker.take("device_mapping")
        ids = parse_device_mapping(text, ctx.key(where))
        if ids != list(range(len(ids))):
            raise ctx.error(where, f"{short_repr(text)} names devices {ids}; shardwise runs its ranks on devices 0..N-1",
                            f"write list(range(0,{len(ids)})) and choose the devices with CUDA_VISIBLE_DEVICES")
        devices = out.world_size = len(ids)
        out.header.append(f"{where} {text}: {devices} ranks (the default of --nproc, and of plan's --world-size)")

    ulysses = 1
    margs = worker.sub("model_args", _ROLL_MODEL_ARGS)
    checkpointing = training
    gc_origin = f"{worker.key('model_args')}.disable_gradient_checkpointing (ROLL default: false)"
    gc_given = False
    if margs is not None:
        if margs.has("dtype"):
            out.set("model.dtype", ctx.dtype(margs.take("dtype"), margs.key("dtype")), margs.key("dtype"))
        if margs.has("ulysses_size"):
            ulysses = ctx.integer(margs.take("ulysses_size"), margs.key("ulysses_size"), 1)
            out.set("parallel.ulysses_size", ulysses, margs.key("ulysses_size"))
        if margs.has("disable_gradient_checkpointing"):
            gc_origin, gc_given = margs.key("disable_gradient_checkpointing"), True
            disabled = ctx.boolean(margs.take("disable_gradient_checkpointing"), gc_origin)
            checkpointing = training and not disabled
        if margs.has("freeze_module_prefix"):
            k = margs.key("freeze_module_prefix")
            value = margs.take("freeze_module_prefix")
            freeze = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else ctx.names(value, k)
            out.set("model.freeze", freeze, f"{k} (each prefix read as a module path)")
        model_type = margs.take("model_type")
        if model_type is not None:
            raise ctx.error(margs.key("model_type"), f"{short_repr(model_type)}: shardwise builds the model from "
                            "model.path or model.config", "model_type: ~, and set model.path or model.config")
        margs.done()

    wrap_classes: list[str] = []
    if sc is not None:
        wrap_classes = _roll_strategy(sc, out, ctx, devices, ulysses)
    elif ulysses > 1 and devices:
        _roll_fsdp_size(None, out, ctx, devices, ulysses, "model_args.ulysses_size")
    if checkpointing:
        # HF gradient checkpointing recomputes each decoder layer: the wrapped layer classes
        # when named, else the decoder-only LMs' layer list.
        out.set("fsdp.recompute.modules", wrap_classes or ["model.layers.{*}"],
                gc_origin + ("; the wrapped layer classes" if wrap_classes else
                             "; the decoder layers (name others with fsdp.recompute.modules=[...])"))
    elif gc_given:
        out.set("fsdp.recompute.modules", [], gc_origin + ("" if training else " (a forward-only worker)"))

    targs = worker.sub("training_args", _ROLL_TRAINING_ARGS)
    if targs is not None and not training:
        raise ctx.error(targs.where, f"a {strategy_name or role} worker does not train",
                        "drop training_args, or use strategy_name: fsdp2_train")
    if targs is not None:
        _roll_training(targs, out, ctx, devices, ulysses)

    if worker.has("infer_batch_size"):
        k = worker.key("infer_batch_size")
        out.set("infer.batch_size", ctx.integer(worker.take("infer_batch_size"), k, 1), k)
    worker.done()


def _roll_fsdp_size(value: Any, out: Converted, ctx: _Ctx, devices: int | None, ulysses: int, key: str) -> None:
    """ROLL: fsdp_size <= 1 or >= world is one FSDP group; with Ulysses it becomes
    world / ulysses_size (replicas across the sequence-parallel groups)."""
    if ulysses > 1 and devices and (value is None or value <= 1 or value >= devices):
        out.set("parallel.fsdp_size", devices // ulysses, f"{key} (ROLL with ulysses_size {ulysses}: "
                f"world {devices} / ulysses_size)")
    elif value is not None:
        out.set("parallel.fsdp_size", "auto" if value <= 1 else value,
                key + (" (ROLL: <= 1 is one group over all ranks)" if value <= 1 else ""))


def _roll_strategy(sc: _Map, out: Converted, ctx: _Ctx, devices: int | None, ulysses: int) -> list[str]:
    fsdp_size = None
    if sc.has("fsdp_size"):
        fsdp_size = ctx.integer(sc.take("fsdp_size"), sc.key("fsdp_size"), 0)
    _roll_fsdp_size(fsdp_size, out, ctx, devices, ulysses, sc.key("fsdp_size"))
    for name, target in (("param_dtype", "fsdp.mixed_precision.param_dtype"),
                         ("reduce_dtype", "fsdp.mixed_precision.reduce_dtype")):
        if sc.has(name):
            out.set(target, ctx.dtype(sc.take(name), sc.key(name)), sc.key(name))
    if sc.has("reshard_after_forward"):
        k = sc.key("reshard_after_forward")
        v = sc.take("reshard_after_forward")
        out.set("fsdp.reshard_after_forward", v if isinstance(v, bool) else ctx.integer(v, k, 1), k)
    _flag(sc, "offload_policy", "fsdp.offload.enabled", out, ctx)
    _flag(sc, "apply_expert_patch", "fsdp.moe_expert_patch", out, ctx)
    _flag(sc, "apply_tiled_mlp", "fsdp.tiled_mlp.enabled", out, ctx)
    if sc.has("tiled_num_shards"):
        k = sc.key("tiled_num_shards")
        out.set("fsdp.tiled_mlp.shards", ctx.integer(sc.take("tiled_num_shards"), k, 1), k)
    _flag(sc, "async_save_ckpt", "checkpoint.async", out, ctx)
    classes: list[str] = []
    wp = sc.sub("wrap_policy", _ROLL_WRAP)
    if wp is not None:
        if wp.has("transformer_layer_cls_to_wrap"):
            k = wp.key("transformer_layer_cls_to_wrap")
            classes = ctx.names(wp.take("transformer_layer_cls_to_wrap"), k)
            out.set("fsdp.wrap.classes", classes, k)
        _flag(wp, "wrap_embeddings", "fsdp.wrap.embeddings", out, ctx)
        _flag(wp, "wrap_lm_output", "fsdp.wrap.lm_head", out, ctx)
        if wp.has("moe_experts"):
            k = wp.key("moe_experts")
            out.set("fsdp.wrap.moe_experts", ctx.names(wp.take("moe_experts"), k), k)
        wp.done()
    sc.done()
    return classes


def _roll_training(ta: _Map, out: Converted, ctx: _Ctx, devices: int | None, ulysses: int) -> None:
    """HF TrainingArguments -> train.*; HF's defaults where shardwise's differ."""
    def origin(name: str, default: Any) -> str:
        return ta.key(name) if ta.has(name) else f"{ta.key(name)} ({_HF_DEFAULT}: {default})"

    lr_origin = origin("learning_rate", 5e-5)
    lr = ctx.number(ta.take("learning_rate", 5e-5), ta.key("learning_rate"))
    out.set("train.optimizer.lr", lr, lr_origin)
    if ta.has("weight_decay"):
        out.set("train.optimizer.weight_decay", ctx.number(ta.take("weight_decay"), ta.key("weight_decay")),
                ta.key("weight_decay"))
    b_origin = f"{origin('adam_beta1', 0.9)}, {origin('adam_beta2', 0.999)}"
    betas = [ctx.number(ta.take("adam_beta1", 0.9), ta.key("adam_beta1")),
             ctx.number(ta.take("adam_beta2", 0.999), ta.key("adam_beta2"))]
    out.set("train.optimizer.betas", betas, b_origin)
    if ta.has("adam_epsilon"):
        out.set("train.optimizer.eps", ctx.number(ta.take("adam_epsilon"), ta.key("adam_epsilon")),
                ta.key("adam_epsilon"))
    if ta.has("max_grad_norm"):
        clip = ctx.number(ta.take("max_grad_norm"), ta.key("max_grad_norm"))
        out.set("train.grad_clip", clip if clip > 0 else None, ta.key("max_grad_norm"))
    w_origin = origin("warmup_steps", 0)
    out.set("train.scheduler.warmup_steps", ctx.integer(ta.take("warmup_steps", 0), ta.key("warmup_steps")), w_origin)
    s_origin = origin("lr_scheduler_type", "linear")
    sched = ta.take("lr_scheduler_type", "linear")
    if sched not in _HF_SCHEDULES:
        raise ctx.error(ta.key("lr_scheduler_type"), f"{short_repr(sched)} has no shardwise schedule",
                        did_you_mean(str(sched), _HF_SCHEDULES))
    out.set("train.scheduler.name", _HF_SCHEDULES[sched], s_origin)
    if _HF_SCHEDULES[sched] != "constant":
        out.set("train.scheduler.min_lr_ratio", 0.0, f"{s_origin} (HF's {sched} schedule decays to 0)")
    if ta.has("max_steps"):
        steps = ta.take("max_steps")
        if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
            out.set("train.max_steps", steps, ta.key("max_steps"))
        elif steps != -1:
            raise ctx.error(ta.key("max_steps"), f"got {short_repr(steps)}, expected a positive integer (or -1: unset)")
    if ta.has("num_train_epochs"):
        epochs = ta.take("num_train_epochs")
        out.notes.append(f"{ta.key('num_train_epochs')}: {short_repr(epochs)}; shardwise counts optimizer steps, not epochs "
                         "(ROLL's pipelines stop at their own max_steps): set train.max_steps")
    if ta.has("seed"):
        out.set("run.seed", ctx.integer(ta.take("seed"), ta.key("seed")), ta.key("seed"))

    m_origin = origin("per_device_train_batch_size", 8)
    micro = ctx.integer(ta.take("per_device_train_batch_size", 8), ta.key("per_device_train_batch_size"), 1)
    a_origin = origin("gradient_accumulation_steps", 1)
    accum = ctx.integer(ta.take("gradient_accumulation_steps", 1), ta.key("gradient_accumulation_steps"), 1)
    out.set("train.micro_batch_size", micro, m_origin)
    if devices is None:
        raise ctx.error(ta.where, "ROLL's batch sizes count per device, and the file names no devices",
                        "add device_mapping: list(range(0,N)) next to training_args")
    dp = max(1, devices // ulysses)
    out.set("train.global_batch_size", micro * accum * dp,
            f"{m_origin} x {a_origin} x {dp} data-parallel ranks (device_mapping / ulysses_size)")
    ta.done()


def _flag(m: _Map, name: str, target: str, out: Converted, ctx: _Ctx) -> None:
    if m.has(name):
        out.set(target, ctx.boolean(m.take(name), m.key(name)), m.key(name))


# --------------------------------------------------------------------------- MindSpeed

_MINDSPEED = ("sharding_size", "param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs",
              "sub_modules_to_wrap", "ignored_modules", "recompute_modules", "use_reentrant",
              "reshard_after_forward", "offload_to_cpu", "pin_memory", "num_to_forward_prefetch",
              "num_to_backward_prefetch")


def _mindspeed(raw: dict[str, Any], out: Converted, ctx: _Ctx) -> None:
    m = _Map(raw, "", _MINDSPEED, ctx)
    out.header.append("MindSpeed fsdp2 table (--fsdp2-config-path)")

    def origin(name: str, default: str) -> str:
        return name if m.has(name) else f"{name} (MindSpeed default: {default})"

    o = origin("sharding_size", "1")
    size = m.take("sharding_size", 1)
    if size == "auto":
        out.set("parallel.fsdp_size", "auto", o)
    elif isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        if size == 1:  # one rank per shard group: every rank holds whole parameters (replicas)
            out.set("parallel.sharding_strategy", "no_shard", f"{o}: shard groups of 1, replicas")
        else:
            out.set("parallel.fsdp_size", size, o)
    else:
        raise ctx.error("sharding_size", f"got {short_repr(size)}, expected auto or an integer >= 1", "e.g. auto")

    if m.has("param_dtype"):
        param = ctx.dtype(m.take("param_dtype"), "param_dtype")
        out.set("fsdp.mixed_precision.param_dtype", param, "param_dtype")
    else:  # MindSpeed computes in the model's dtype: shardwise's model.dtype default
        param = "fp32"
        out.set("fsdp.mixed_precision.param_dtype", param,
                "param_dtype (MindSpeed default: the model's dtype, fp32 = shardwise's model.dtype default)")
    o = origin("reduce_dtype", "none: reduce in param_dtype")
    reduce = ctx.dtype(m.take("reduce_dtype"), "reduce_dtype") if m.has("reduce_dtype") else param
    out.set("fsdp.mixed_precision.reduce_dtype", reduce, o)
    if m.has("output_dtype"):
        value = m.take("output_dtype")
        out.set("fsdp.mixed_precision.output_dtype", None if value is None else ctx.dtype(value, "output_dtype"),
                "output_dtype")
    _flag(m, "cast_forward_inputs", "fsdp.mixed_precision.cast_forward_inputs", out, ctx)
    if m.has("sub_modules_to_wrap"):
        names = ctx.names(m.take("sub_modules_to_wrap"), "sub_modules_to_wrap")
        classes = [n for n in names if _looks_like_class(n)]
        paths = [n for n in names if not _looks_like_class(n)]
        # Without paths, shardwise would fall back to _no_split_modules when classes is empty.
        out.set("fsdp.wrap.modules", paths, "sub_modules_to_wrap (module path patterns)")
        if classes:
            out.set("fsdp.wrap.classes", classes, "sub_modules_to_wrap (class names)")
    for name, target in (("ignored_modules", "fsdp.ignored_modules"), ("recompute_modules", "fsdp.recompute.modules")):
        if m.has(name):
            out.set(target, ctx.names(m.take(name), name), name)
    o = origin("use_reentrant", "true")
    out.set("fsdp.recompute.use_reentrant", ctx.boolean(m.take("use_reentrant", True), "use_reentrant"), o)
    if m.has("reshard_after_forward"):
        v = m.take("reshard_after_forward")
        out.set("fsdp.reshard_after_forward", v if isinstance(v, bool) else ctx.integer(v, "reshard_after_forward", 1),
                "reshard_after_forward")
    _flag(m, "offload_to_cpu", "fsdp.offload.enabled", out, ctx)
    o = origin("pin_memory", "false")
    out.set("fsdp.offload.pin_memory", ctx.boolean(m.take("pin_memory", False), "pin_memory"), o)
    for name, target in (("num_to_forward_prefetch", "fsdp.prefetch.forward"),
                         ("num_to_backward_prefetch", "fsdp.prefetch.backward")):
        if m.has(name):
            out.set(target, ctx.integer(m.take(name), name), name)
    m.done()


def _looks_like_class(name: str) -> bool:
    return "." not in name and "{" not in name and name[:1].isupper()


# --------------------------------------------------------------------------- RLinf

_RLINF_ACTOR = ("model", "training_backend", "micro_batch_size", "global_batch_size")
_RLINF_MODEL = ("enable_layered_fsdp", "modules_precision", "precision", "sharding_strategy")
_RLINF_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def _rlinf(raw: dict[str, Any], out: Converted, ctx: _Ctx) -> None:
    top = _Map(raw, "", ("actor",), ctx)
    actor = top.sub("actor", _RLINF_ACTOR)
    top.done()
    out.header.append("RLinf actor")
    if actor is None:
        return
    backend = actor.take("training_backend", "fsdp")
    if backend != "fsdp":
        raise ctx.error(actor.key("training_backend"), f"{short_repr(backend)}: shardwise trains with FSDP2 only",
                        "use fsdp")
    for name in ("micro_batch_size", "global_batch_size"):
        if actor.has(name):
            out.set(f"train.{name}", ctx.integer(actor.take(name), actor.key(name), 1), actor.key(name))
    model = actor.sub("model", _RLINF_MODEL)
    actor.done()
    if model is None:
        return
    layered = ctx.boolean(model.take("enable_layered_fsdp", False), model.key("enable_layered_fsdp"))
    precisions = model.sub("modules_precision", ())
    if precisions is not None and not layered:
        raise ctx.error(precisions.where, "is set but enable_layered_fsdp is false, so RLinf would not apply it",
                        "set enable_layered_fsdp: true, or drop modules_precision")
    if layered:
        entries = {} if precisions is None else precisions.data
        if not entries:
            out.set("fsdp.module_precision", {}, f"{model.key('enable_layered_fsdp')} (no modules_precision)")
        for path, value in entries.items():
            k = f"{model.key('modules_precision')}.{path}"
            if not isinstance(path, str) or not path:
                raise ctx.error(k, "a module path is a non-empty string")
            out.set(("fsdp", "module_precision", path), ctx.dtype(value, k), f"{k} (enable_layered_fsdp)")
    if model.has("precision"):
        out.set("fsdp.mixed_precision.param_dtype", ctx.dtype(model.take("precision"), model.key("precision")),
                f"{model.key('precision')} (the outer FSDP units)")
    if model.has("sharding_strategy"):
        k = model.key("sharding_strategy")
        value = model.take("sharding_strategy")
        if value not in _RLINF_STRATEGIES:
            raise ctx.error(k, f"{short_repr(value)} is not an RLinf sharding strategy", did_you_mean(str(value), _RLINF_STRATEGIES))
        out.set("parallel.sharding_strategy", value, k)
    model.done()


_CONVERTERS: dict[str, Callable[[dict[str, Any], Converted, _Ctx], None]] = {
    "roll": _roll, "mindspeed": _mindspeed, "rlinf": _rlinf}
