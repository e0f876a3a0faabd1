"""The sharding plan: pure data computed from (model, config, mesh shape).

`build_plan` decides which modules get their own `fully_shard` call and with which
precision, reshard, offload, recompute, tiling and prefetch settings, and estimates the bytes each
rank will hold. It reads only module/parameter names, shapes and dtypes, so it runs on a
meta-device model before any process group exists.

Rules (documented for users in docs/sharding.md, "Rules the plan follows"):
- Unit sources: `wrap.classes` (default: those classes of the model's `_no_split_modules` it
  has modules of, when neither `wrap.classes` nor `wrap.modules` is set), `wrap.modules` patterns, `wrap.embeddings`,
  `wrap.lm_head`, `wrap.moe_experts` (class names or patterns), every `module_precision`
  entry whose module has parameters, and the root (path "").
- A module named by several rules is one unit; its `sources` list every rule.
- Precision of a unit: the nearest `module_precision` entry at or above the unit's module
  wins (an fp32 entry on `model.x` makes every unit inside `model.x` fp32 too); otherwise
  the global `mixed_precision`. Two entries naming the same module with different values
  are an error. An override unit's output is cast back to the global compute dtype unless
  its entry sets `output_dtype`, so the modules around it keep their dtype.
- `ignored_modules` are left out of FSDP: their parameters stay whole on every rank; units
  inside them are dropped.
- Prefetch applies to the top-level units (those not nested in another non-root unit) in
  forward order: unit i all-gathers units i+1..i+F ahead in forward and i-1..i-B in backward.
- `train.compile`: every non-root unit's module is compiled (torch.compile, one per unit);
  the root never is (it holds the embeddings, the head and HF's mask / position glue).
- Communication: the collectives of one optimizer step are the communication model's
  (`shardwise.fsdp.comm.step_comm` reads a plan and returns a `StepComm`); `shardwise plan`
  keeps that result with the plan (`ShardingPlan.comm`), which knows it only as figures
  that write themselves into the plan's JSON (`PlanFigures`).
- `model.lora`: adapters live in the units of the modules they adapt (paths unchanged);
  the plan counts trainable / frozen parameters per unit and, in `LoraPlan`, the per-rank
  memory of the same model trained in full, so the saving shows before anything runs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Protocol

from torch import nn

from shardwise.config.dtypes import canonical_dtype, dtype_bytes
from shardwise.config.schema import Config, PrecisionOverride
from shardwise.config.validate import MeshSpec
from shardwise.errors import ConfigError, did_you_mean
from shardwise.models.loading import frozen_modules
from shardwise.models.lora import ADAPTER, is_lora_key, lora_modules, saved_modules
from shardwise.models.patches.moe import SUPPORTED
from shardwise.models.patterns import looks_like_class_name, match_pattern
from shardwise.models.vision import vision_tower_path

_ORDER = {"fp32": 2, "bf16": 1, "fp16": 1}


@dataclass
class Unit:
    """One `fully_shard` call."""

    path: str
    sources: list[str]
    param_dtype: str
    """dtype parameters are all-gathered and computed in."""
    reduce_dtype: str
    """dtype gradients are reduce-scattered in."""
    output_dtype: str | None
    cast_forward_inputs: bool
    storage_dtype: str
    """dtype of this unit's sharded master parameters (and its optimizer state)."""
    reshard_after_forward: bool | int
    offload: bool
    recompute: bool = False
    compiled: bool = False
    """This unit's module forward runs under torch.compile (fsdp/apply.py:apply_compile)."""
    prefetch_forward: list[str] = field(default_factory=list)
    prefetch_backward: list[str] = field(default_factory=list)
    num_params: int = 0
    """Elements of the parameters this unit owns (not those of nested units or ignored ones)."""
    trainable_params: int = 0
    """Elements of those that train (requires_grad: with LoRA, the adapters and modules to save)."""

    @property
    def frozen_params(self) -> int:
        """Elements of this unit's parameters that do not train (`model.freeze`, a LoRA base)."""
        return self.num_params - self.trainable_params

    def to_json(self) -> dict:
        return {**asdict(self), "frozen_params": self.frozen_params}


@dataclass
class LoraPlan:
    """What `model.lora` does to the plan: the adapters, and the memory it saves."""

    r: int
    alpha: float
    targets: list[str]
    """Module paths that carry an adapter, in model order."""
    units: list[str]
    """Paths of the units that hold adapters, in apply order ("" is the root)."""
    trainable_params: int
    """Elements of every trainable parameter (adapters, modules to save, ignored ones included)."""
    total_params: int
    """Elements of every parameter of the model: base, adapters, ignored modules."""
    memory_per_rank_bytes_without_lora: list[dict[str, int]]
    """Index = rank: bytes as in `ShardingPlan.memory_per_rank_bytes` for the same config with
    LoRA off (`_without_lora`)."""

    def to_json(self, memory_per_rank_bytes: list[dict[str, int]]) -> dict:
        return {"r": self.r, "alpha": self.alpha, "targets": self.targets, "units": self.units,
                "trainable_params": self.trainable_params, "total_params": self.total_params,
                "memory_per_rank_bytes": per_rank_json(memory_per_rank_bytes),
                "memory_per_rank_bytes_without_lora": per_rank_json(self.memory_per_rank_bytes_without_lora)}


class PlanFigures(Protocol):
    """A result computed from a plan and kept with it (the step's communication,
    `shardwise.fsdp.comm.StepComm`): the plan's JSON carries its figures."""

    def plan_json(self, units: list[dict]) -> dict:
        """Add this result's figures to each unit's JSON (`Unit.to_json`, in place) and return
        the keys it adds to the plan's JSON."""
        ...


@dataclass
class ShardingPlan:
    world_size: int
    mesh: MeshSpec
    units: list[Unit]
    """In apply order: nested units before their parents, the root ("") last."""
    ignored: list[str]
    recompute: list[str]
    use_reentrant: bool
    tiled_mlp: list[str]
    """Modules whose forward runs over slices of the sequence (fsdp/tiled.py)."""
    tiled_mlp_shards: int
    frozen: list[str]
    buffer_casts: dict[str, str]
    """Module path -> dtype its buffers (and parameters) are cast to (layered precision)."""
    memory_per_rank_bytes: list[dict[str, int]]
    """Index = rank: {"params", "grads", "optimizer", "total"} bytes held after apply + a step."""
    model_dtype: str
    warnings: list[str] = field(default_factory=list)
    lora: LoraPlan | None = None
    """The adapters and the memory without them; None when `model.lora` is off."""
    comm: PlanFigures | None = None
    """The collectives of one optimizer step (a `shardwise.fsdp.comm.StepComm`, which
    `step_comm` computed from this plan); set by `shardwise plan` for an SFT config, None
    otherwise."""

    def unit(self, path: str) -> Unit:
        for u in self.units:
            if u.path == path:
                return u
        raise KeyError(path)

    @property
    def compiled(self) -> list[str]:
        """Paths of the units whose module is compiled, in apply order."""
        return [u.path for u in self.units if u.compiled]

    def to_json(self) -> dict:
        units = [u.to_json() for u in self.units]
        comm = self.comm.plan_json(units) if self.comm is not None else {}
        return {
            "world_size": self.world_size,
            "mesh": self.mesh.to_json(),
            "model_dtype": self.model_dtype,
            "units": units,
            **comm,
            "ignored_modules": self.ignored,
            "recompute": self.recompute,
            "use_reentrant": self.use_reentrant,
            "tiled_mlp": {"modules": self.tiled_mlp, "shards": self.tiled_mlp_shards},
            "frozen": self.frozen,
            "buffer_casts": self.buffer_casts,
            "memory_per_rank_bytes": per_rank_json(self.memory_per_rank_bytes),
            "warnings": self.warnings,
            "lora": self.lora.to_json(self.memory_per_rank_bytes) if self.lora is not None else None,
        }


def peak_memory(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"}: each the largest over ranks, in bytes."""
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]} if per_rank else {}


def per_rank_json(per_rank: list[dict[str, int]]) -> dict:
    return {**peak_memory(per_rank), "by_rank": per_rank}


@dataclass
class _Index:
    """Names the rules are resolved against."""

    modules: list[str]
    params: list[str]
    classes: dict[str, str]  # module path -> class name

    @classmethod
    def of(cls, model: nn.Module) -> _Index:
        return cls(
            modules=[n for n, _ in model.named_modules()],
            params=[n for n, _ in model.named_parameters()],
            classes={n: type(m).__name__ for n, m in model.named_modules()},
        )

    def by_class(self, name: str, key: str) -> list[str]:
        found = [p for p, c in self.classes.items() if c == name and p]
        if not found:
            present = sorted(set(self.classes.values()))
            raise ConfigError(key, f"class {name!r} matches no module of this model",
                              did_you_mean(name, present) or "classes: " + ", ".join(present[:12]))
        return found

    def resolve(self, spec: str, key: str) -> list[str]:
        """A class name or a path pattern -> module paths."""
        if looks_like_class_name(spec) and spec not in self.modules:
            return self.by_class(spec, key)  # an unknown class raises with the nearest names
        return match_pattern(spec, self.modules, self.params, key=key)


def is_under(path: str, ancestor: str) -> bool:
    """`path` (a module or parameter path) is `ancestor` or lies inside it; "" is the root."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def owner_unit(param: str, unit_paths: list[str]) -> str:
    """The innermost unit whose module contains `param`."""
    best = ""
    for u in unit_paths:
        if u and param.startswith(u + ".") and len(u) > len(best):
            best = u
    return best


def _higher(a: str, b: str) -> str:
    return a if _ORDER[a] >= _ORDER[b] else b


def default_wrap_classes(model: nn.Module, present: set[str]) -> list[str]:
    """The classes of the model's ``_no_split_modules`` that it has modules of (`present`):
    a class can name a part the model lacks (Qwen3.5's text model lists its vision
    blocks). All of them when none is present, so the plan's error names them."""
    listed = sorted(getattr(model, "_no_split_modules", None) or [])
    return [c for c in listed if c in present] or listed


def build_plan(model: nn.Module, cfg: Config, mesh: MeshSpec) -> ShardingPlan:
    """Compute the plan. Raises ConfigError for any rule that names nothing real."""
    fcfg = cfg.fsdp
    idx = _Index.of(model)
    notes: list[str] = []
    model_dtype = canonical_dtype(cfg.model.dtype)

    # -- ignored modules
    ignored: list[str] = []
    for i, pat in enumerate(fcfg.ignored_modules):
        ignored += idx.resolve(pat, f"fsdp.ignored_modules[{i}]")
    ignored = _outermost(ignored)

    # -- wrap rules -> candidate units with their sources
    sources: dict[str, list[str]] = {}

    def add(paths: list[str], source: str) -> None:
        for p in paths:
            sources.setdefault(p, [])
            if source not in sources[p]:
                sources[p].append(source)

    wrap = fcfg.wrap
    classes = list(wrap.classes)
    if not classes and not wrap.modules:
        classes = default_wrap_classes(model, set(idx.classes.values()))
        key_of = "fsdp.wrap.classes (default: the model's _no_split_modules)"
    else:
        key_of = "fsdp.wrap.classes"
    for i, name in enumerate(classes):
        add(idx.by_class(name, f"{key_of}[{i}]" if key_of == "fsdp.wrap.classes" else key_of), f"class:{name}")
    for i, pat in enumerate(wrap.modules):
        add(match_pattern(pat, idx.modules, idx.params, key=f"fsdp.wrap.modules[{i}]"), f"modules:{pat}")

    emb_path, head_path, tied = _embedding_paths(model)
    if wrap.embeddings or wrap.lm_head:
        if tied:
            notes.append("the model ties input and output embeddings; fsdp.wrap.embeddings/lm_head "
                         "are ignored so the shared weight stays in the root unit")
        else:
            if wrap.embeddings:
                if emb_path is None:
                    raise ConfigError("fsdp.wrap.embeddings", "this model has no input embeddings module")
                add([emb_path], "embeddings")
            if wrap.lm_head:
                if head_path is None:
                    raise ConfigError("fsdp.wrap.lm_head", "this model has no output head module")
                add([head_path], "lm_head")
    for i, spec in enumerate(wrap.moe_experts):
        add(_resolve_experts(idx, spec, f"fsdp.wrap.moe_experts[{i}]"), f"moe_experts:{spec}")

    # -- layered precision entries
    overrides: dict[str, PrecisionOverride] = {}
    for pat, value in fcfg.module_precision.items():
        entry = value if isinstance(value, PrecisionOverride) else PrecisionOverride(param_dtype=value)
        key = f"fsdp.module_precision.{pat}"
        for path in match_pattern(pat, idx.modules, idx.params, key=key):
            if path in overrides and overrides[path] != entry:
                raise ConfigError(key, f"module {path!r} is also named by another module_precision "
                                  "entry with a different setting", "keep one entry per module")
            if tied and path in (emb_path, head_path):
                raise ConfigError(key, f"{path!r} shares its weight with the tied "
                                  f"{'lm_head' if path == emb_path else 'input embeddings'}; "
                                  "a shared weight cannot have two precisions")
            overrides[path] = entry
    buffer_casts: dict[str, str] = {}
    for path, entry in overrides.items():
        mod = model.get_submodule(path)
        buffer_casts[path] = entry.param_dtype
        if any(True for _ in mod.parameters()):
            add([path], f"module_precision:{entry.param_dtype}")

    # -- drop units inside ignored modules
    for path in list(sources):
        if any(is_under(path, ig) for ig in ignored):
            notes.append(f"unit {path!r} lies inside ignored module; not wrapped")
            del sources[path]

    # -- a unit must have a forward of its own (fully_shard hooks forward)
    for path, srcs in sources.items():
        mod = model.get_submodule(path)
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and type(mod).forward is nn.Module.forward:
            raise ConfigError(_rule_key(srcs[0]), f"{path!r} is a {type(mod).__name__}, a container "
                              "without forward, and cannot be its own unit",
                              f"name its children instead, e.g. {path}.{{*}}")

    # -- a tied weight must live in one unit that holds both of its users
    if tied:
        owner = owner_unit(f"{emb_path}.weight", list(sources))
        from_default = not wrap.classes and all(s.startswith("class:") for s in sources.get(owner, []))
        if owner and not is_under(head_path, owner) and from_default:
            # The model's own _no_split_modules (BERT's: BertEmbeddings) would split the weight
            # its masked-LM head shares: that unit is dropped, the weight stays in the root.
            notes.append(f"unit {owner!r} (the model's _no_split_modules) is not wrapped: it would split the "
                         f"weight it shares with {head_path!r} (tie_word_embeddings)")
            del sources[owner]
        paths_now = list(sources)
        owner = owner_unit(f"{emb_path}.weight", paths_now)
        splits = (owner and not is_under(head_path, owner)) or owner_unit(f"{head_path}.weight", paths_now) != owner
        if splits:
            srcs = sources.get(owner) or sources.get(head_path) or ["root"]
            raise ConfigError(_rule_key(srcs[0]), f"unit {owner or head_path!r} would split the weight "
                              f"that {emb_path!r} and {head_path!r} share (tie_word_embeddings)",
                              "keep both in one unit: do not wrap a module that holds only one of them")

    # -- recompute targets
    recompute: list[str] = []
    for i, spec in enumerate(fcfg.recompute.modules):
        recompute += idx.resolve(spec, f"fsdp.recompute.modules[{i}]")
    recompute = list(dict.fromkeys(recompute))

    tiled = _tiled_modules(idx, fcfg.tiled_mlp) if fcfg.tiled_mlp.enabled else []

    # -- per-unit settings
    mp = fcfg.mixed_precision
    reshard = _reshard_setting(cfg, mesh)
    offload = fcfg.offload.enabled
    post = _post_order(model)
    unit_paths = sorted(sources, key=lambda p: post[p]) + [""]
    tower = vision_tower_path(model)
    units: list[Unit] = []
    for path in unit_paths:
        over_at = _nearest_override(path, overrides)
        if over_at is None:
            pd, rd, od, cast = mp.param_dtype, mp.reduce_dtype, mp.output_dtype, mp.cast_forward_inputs
            if tower is not None and path and is_under(path, tower):
                cast = mp.cast_vision_inputs  # seed 001: the vision encoder's inputs are not cast
            storage = model_dtype
        else:
            e = overrides[over_at]
            pd = e.param_dtype
            rd = e.reduce_dtype or ("fp32" if pd == "fp32" else mp.reduce_dtype)
            od = e.output_dtype or (mp.param_dtype if mp.param_dtype != pd else None)
            cast = e.cast_forward_inputs
            storage = _higher(model_dtype, pd)
        units.append(Unit(
            path=path,
            sources=sources.get(path, ["root"]),
            param_dtype=pd, reduce_dtype=rd, output_dtype=od, cast_forward_inputs=cast,
            storage_dtype=storage,
            reshard_after_forward=(False if path == "" else reshard),
            offload=offload,
            recompute=path in recompute,
            compiled=cfg.train.compile and path != "",
        ))

    for ig in ignored:
        around = next(u for u in units if is_under(ig, u.path) and ig != u.path)
        if around.param_dtype != model_dtype:
            notes.append(f"ignored module {ig!r} keeps its {model_dtype} parameters while the unit "
                         f"around it ({around.path or 'root'}) computes in {around.param_dtype}; "
                         "its inputs may arrive in another dtype")
    _wire_prefetch(units, model, fcfg.prefetch.forward, fcfg.prefetch.backward)
    frozen = _frozen_paths(model)
    _count_params(model, units, ignored)
    memory = estimate_memory(model, units, ignored, mesh, overrides, model_dtype)
    lora_plan = None
    if cfg.model.lora.enabled and ADAPTER in getattr(model, "peft_config", {}):
        without = estimate_memory(model, units, ignored, mesh, overrides, model_dtype,
                                  _without_lora(model, idx, cfg.model.freeze, model_dtype))
        lora_plan = _lora_plan(model, units, ignored, without)
    return ShardingPlan(
        world_size=mesh.world_size, mesh=mesh, units=units, ignored=ignored,
        recompute=recompute, use_reentrant=fcfg.recompute.use_reentrant,
        tiled_mlp=tiled, tiled_mlp_shards=fcfg.tiled_mlp.shards, frozen=frozen,
        buffer_casts=buffer_casts, memory_per_rank_bytes=memory, model_dtype=model_dtype,
        warnings=notes, lora=lora_plan,
    )


def _resolve_experts(idx: _Index, spec: str, key: str) -> list[str]:
    """`wrap.moe_experts` entry -> module paths; on a model whose experts are fused (one
    module of 3-D parameters, transformers 5), the error says how to get one per expert."""
    try:
        return idx.resolve(spec, key)
    except ConfigError as e:
        fused = sorted({c for c in idx.classes.values() if c in SUPPORTED})
        if not fused:
            raise
        raise ConfigError(key, f"{spec!r} matches no module: this model's experts are fused ({fused[0]}, "
                          "3-D parameters of one module per layer)",
                          f"set fsdp.moe_expert_patch=true for one {SUPPORTED[fused[0]]} per expert, or wrap "
                          f"the fused module: {fused[0]}") from e


def _tiled_modules(idx: _Index, cfg) -> list[str]:
    """The modules `fsdp.tiled_mlp` tiles: its patterns / class names, or every module
    whose class name ends in MLP (the outermost of nested ones)."""
    found: list[str] = []
    for i, spec in enumerate(cfg.modules):
        found += idx.resolve(spec, f"fsdp.tiled_mlp.modules[{i}]")
    if not cfg.modules:
        found = [p for p, c in idx.classes.items() if p and c.endswith("MLP")]
        if not found:
            raise ConfigError("fsdp.tiled_mlp.modules", "no module of this model has a class name ending in MLP",
                              "name the position-wise modules to tile, e.g. [model.layers.{*}.mlp]")
    return _outermost(list(dict.fromkeys(found)))


def _rule_key(source: str) -> str:
    """The config key behind a unit source label."""
    kind = source.split(":", 1)[0]
    return {"class": "fsdp.wrap.classes", "modules": "fsdp.wrap.modules", "embeddings": "fsdp.wrap.embeddings",
            "lm_head": "fsdp.wrap.lm_head", "moe_experts": "fsdp.wrap.moe_experts",
            "module_precision": "fsdp.module_precision"}.get(kind, "fsdp")


def _reshard_setting(cfg: Config, mesh: MeshSpec) -> bool | int:
    strategy = cfg.parallel.sharding_strategy
    value = cfg.fsdp.reshard_after_forward
    if strategy in ("shard_grad_op", "no_shard"):
        return False
    if isinstance(value, bool):
        return value
    if mesh.shard % value:
        divs = [d for d in range(1, mesh.shard + 1) if mesh.shard % d == 0]
        raise ConfigError("fsdp.reshard_after_forward", f"{value} does not divide the shard group "
                          f"size {mesh.shard}", f"use true, false or one of {divs}")
    if value == mesh.shard:
        return True
    if value == 1:
        return False
    return value


def _embedding_paths(model: nn.Module) -> tuple[str | None, str | None, bool]:
    """(input embeddings path, output head path, whether they share a weight)."""
    names = {id(m): n for n, m in model.named_modules()}
    emb = head = None
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        pass
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        pass
    tied = (emb is not None and head is not None and getattr(emb, "weight", None) is not None
            and emb.weight is getattr(head, "weight", None))
    return (names.get(id(emb)) if emb is not None else None,
            names.get(id(head)) if head is not None else None, tied)


def _outermost(paths: list[str]) -> list[str]:
    paths = list(dict.fromkeys(paths))
    return [p for p in paths if not any(q != p and is_under(p, q) for q in paths)]


def _nearest_override(path: str, overrides: dict[str, PrecisionOverride]) -> str | None:
    best = None
    for o in overrides:
        if is_under(path, o) and path != "" and (best is None or len(o) > len(best)):
            best = o
    return best


def _post_order(model: nn.Module) -> dict[str, int]:
    order: dict[str, int] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        for name, child in mod.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name)
        order.setdefault(prefix, len(order))

    walk(model, "")
    return order


def _wire_prefetch(units: list[Unit], model: nn.Module, forward: int, backward: int) -> None:
    pre = {n: i for i, (n, _) in enumerate(model.named_modules())}
    inner = [u for u in units if u.path]
    top = [u for u in inner if not any(o is not u and o.path and is_under(u.path, o.path) for o in inner)]
    top.sort(key=lambda u: pre[u.path])
    for i, u in enumerate(top):
        u.prefetch_forward = [t.path for t in top[i + 1: i + 1 + forward]]
        u.prefetch_backward = [t.path for t in reversed(top[max(0, i - backward): i])]


def _frozen_paths(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def _count_params(model: nn.Module, units: list[Unit], ignored: list[str]) -> None:
    paths = [u.path for u in units]
    by_path = {u.path: u for u in units}
    for name, p in model.named_parameters():
        if any(is_under(name, ig) for ig in ignored):
            continue
        u = by_path[owner_unit(name, paths)]
        u.num_params += p.numel()
        if p.requires_grad:
            u.trainable_params += p.numel()


class ParamInfo(NamedTuple):
    """What the memory estimate needs of one parameter."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    """Bytes per element of the parameter as built (fp32 for LoRA adapters in a bf16 model)."""
    trainable: bool


def _without_lora(model: nn.Module, idx: _Index, freeze: list[str], model_dtype: str) -> list[ParamInfo]:
    """The parameters of `model` (LoRA injected) as the same config with LoRA off has them.

    Adapter tensors (`.lora_A.` / `.lora_B.`) are left out; a target's `base_layer.weight`
    stands for the plain Linear's weight (same shape, same unit, since units are module
    paths above the target). Every parameter trains except those under `model.freeze`'s
    modules (resolved on this model: its patterns name modules, which LoRA leaves in
    place). Modules to save, which LoRA keeps in fp32, are back in the master dtype.
    """
    frozen = frozen_modules(freeze, idx.modules, idx.params)
    saved = saved_modules(model)
    return [ParamInfo(n, tuple(p.shape),
                      dtype_bytes(model_dtype) if any(is_under(n, s) for s in saved) else p.element_size(),
                      not any(is_under(n, f) for f in frozen))
            for n, p in model.named_parameters() if not is_lora_key(n)]


def _lora_plan(model: nn.Module, units: list[Unit], ignored: list[str],
               without: list[dict[str, int]]) -> LoraPlan:
    config = model.peft_config[ADAPTER]
    targets = list(lora_modules(model))
    paths = [u.path for u in units]
    owners = {owner_unit(f"{t}.lora_A.{ADAPTER}.weight", paths) for t in targets
              if not any(is_under(t, ig) for ig in ignored)}
    params = list(model.parameters())
    return LoraPlan(r=int(config.r), alpha=float(config.lora_alpha), targets=targets,
                    units=[p for p in paths if p in owners],
                    trainable_params=sum(p.numel() for p in params if p.requires_grad),
                    total_params=sum(p.numel() for p in params), memory_per_rank_bytes_without_lora=without)


def estimate_memory(model: nn.Module, units: list[Unit], ignored: list[str], mesh: MeshSpec,
                    overrides: dict[str, PrecisionOverride], model_dtype: str,
                    params: list[ParamInfo] | None = None) -> list[dict[str, int]]:
    """Bytes each rank holds for params, grads and AdamW state after apply and one step.

    Sharded parameters and their gradients occupy the padded shard FSDP2 allocates
    (ceil(dim0 / shard) rows on every rank); AdamW's exp_avg / exp_avg_sq follow the
    unpadded local shard (torch.chunk rows of this rank) plus one 4-byte `step` tensor per
    parameter. Ignored parameters are whole on every rank. A parameter is stored in its
    unit's storage dtype, or in its own where that is wider (LoRA adapters stay fp32 in a
    bf16 model). `params`: the parameters to count (default: `model`'s, trainable when
    requires_grad).
    """
    if params is None:
        params = [ParamInfo(n, tuple(p.shape), p.element_size(), p.requires_grad) for n, p in model.named_parameters()]
    paths = [u.path for u in units]
    by_path = {u.path: u for u in units}
    S = mesh.shard
    out = []
    for rank in range(mesh.world_size):
        shard_idx = rank % S
        held = grads = optim = 0
        for p in params:
            name, numel = p.name, math.prod(p.shape)
            is_ignored = any(is_under(name, ig) for ig in ignored)
            if is_ignored:
                nbytes = numel * max(dtype_bytes(_param_storage(name, overrides, model_dtype)), p.itemsize)
                held += nbytes
                if p.trainable:
                    grads += nbytes
                    optim += 2 * nbytes + 4
                continue
            u = by_path[owner_unit(name, paths)]
            esz = max(dtype_bytes(u.storage_dtype), p.itemsize)
            rest = math.prod(p.shape[1:]) if len(p.shape) > 1 else 1
            dim0 = p.shape[0] if len(p.shape) > 0 else 1
            padded_rows = -(-dim0 // S)
            local_rows = _chunk_rows(dim0, S, shard_idx)
            held += padded_rows * rest * esz
            if p.trainable:
                grads += padded_rows * rest * esz
                optim += 2 * local_rows * rest * esz + 4
        out.append({"params": held, "grads": grads, "optimizer": optim,
                    "total": held + grads + optim})
    return out


def _param_storage(name: str, overrides: dict[str, PrecisionOverride], model_dtype: str) -> str:
    o = _nearest_override(name, overrides)
    return model_dtype if o is None else _higher(model_dtype, overrides[o].param_dtype)


def _chunk_rows(dim0: int, parts: int, idx: int) -> int:
    """Rows torch.chunk gives part `idx` of `parts` (later parts may be short or empty)."""
    size = -(-dim0 // parts)
    return max(0, min(size, dim0 - idx * size))


def warn_plan(plan: ShardingPlan, is_main: bool) -> None:
    """Show the plan's notes once (rank 0)."""
    if is_main:
        for note in plan.warnings:
            warnings.warn(note, stacklevel=2)
