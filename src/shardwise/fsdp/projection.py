"""Projected step time of a plan on named hardware: `shardwise plan --hardware NAME`.

The model (docs/sharding.md, "Projected step time", says the same for users):

- Compute: torchtitan's count of model FLOPs per token, ``6 x (parameters - input
  embedding) + 12 x layers x heads x head_dim x seq`` (`flops_per_token`), at the assumed
  MFU: seconds = FLOPs / (peak FLOP/s of the compute dtype x MFU). MFU is torchtitan's:
  recompute is not counted in the FLOPs, it lowers the MFU a run reaches; the default is
  the profile's published value for no recompute, times ``1 / (1 + f / 3)`` when a share
  f of the layers is recomputed (one more forward of 2 of the 6 FLOPs). Each unit gets
  its share of the FLOPs (its parameters, its attention modules); forward is 1/3 of it.
- Communication: each collective of the plan (`shardwise.fsdp.comm`) takes
  ``latency x ring steps + wire bytes / (bandwidth x efficiency)``, over NVLink or the
  inter-node network as its group lies.
- Overlap: one compute stream and one communication stream per micro-batch. A unit's
  forward all-gather may start when the unit `max(1, prefetch.forward)` before it starts
  computing, its backward all-gather when the unit `max(1, prefetch.backward)` after it
  starts its backward; a reduce-scatter (and HSDP all-reduce) starts when its unit's
  backward ends. So the root's all-gather, the first one, and the root's reduce-scatter,
  the last one, are exposed; the rest hides behind compute when it is shorter. Ulysses
  all-to-alls sit inside attention and are exposed whole.
- The optimizer step reads and writes every byte of the rank's state once
  (params, grads, AdamW moments) at HBM bandwidth.
- Memory: the plan's per-rank state, the largest unit's gathered parameters and
  gradient (times the prefetch depth) plus the root's, and activations after Korthikanti et
  al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): 34 bytes x
  hidden per token and layer in 16-bit (with flash attention, no s^2 term), 2 bytes x
  hidden when the layer is recomputed, plus the logits (16-bit, their fp32 copy and its
  gradient: 10 bytes x vocab per token). It fits when that is at most the GPU's memory.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from torch import nn

from shardwise.config.dtypes import dtype_bytes
from shardwise.config.load import read_yaml_file
from shardwise.errors import ConfigError, short_repr
from shardwise.fsdp.comm import Collective, StepComm
from shardwise.fsdp.plan import is_under, owner_unit, peak_memory

PROFILES = Path(__file__).with_name("hardware.yaml")


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its network. Units: FLOP/s, bytes, bytes/s per GPU and direction, s."""

    name: str
    description: str
    peak_flops: dict[str, float]
    """Dense peak by compute dtype name (bf16, fp16, fp32)."""
    memory_bytes: float
    memory_bandwidth: float
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    intra_node_efficiency: float
    inter_node_efficiency: float
    mfu: dict[str, float]
    """Assumed MFU with no recompute ("none") and with every layer recomputed ("full")."""
    sources: dict[str, str] = field(default_factory=dict)


REQUIRED = [f.name for f in fields(Hardware) if f.name not in ("name", "sources")]


def profiles() -> dict[str, dict]:
    """The built-in profiles by name, read as a user's profile file is (``80.0e9`` a number)."""
    return read_yaml_file(PROFILES)


FIELD_RANGES: dict[str, tuple[str, str]] = {
    # field: (range, unit); "positive": > 0, "non-negative": >= 0, "fraction": in (0, 1]
    "peak_flops": ("positive", "FLOP/s"),
    "memory_bytes": ("positive", "bytes"),
    "memory_bandwidth": ("positive", "bytes/s"),
    "gpus_per_node": ("count", "GPUs"),
    "intra_node_bandwidth": ("positive", "bytes/s"),
    "inter_node_bandwidth": ("positive", "bytes/s"),
    "intra_node_latency_s": ("non-negative", "seconds"),
    "inter_node_latency_s": ("non-negative", "seconds"),
    "intra_node_efficiency": ("fraction", "of the line rate"),
    "inter_node_efficiency": ("fraction", "of the line rate"),
    "mfu": ("fraction", "of the peak FLOP/s"),
}
"""What each number of a profile may be; a value outside is refused naming the field."""
EXAMPLE_PROFILE = "h100"
"""The profile whose values the refusals quote as the nearest valid choice."""


def load_hardware(spec: str) -> Hardware:
    """A profile by name (`hardware.yaml`) or from a YAML file path, read with the bounds of
    the config loader (`shardwise.config.load.read_yaml_file`: size, UTF-8, nesting).
    ConfigError for an unknown name (listing the known ones), a file that is not a YAML
    profile, or a field that is missing or out of range (naming it)."""
    known = profiles()
    if spec in known:
        return _hardware(spec, known[spec], "--hardware")
    path = Path(spec)
    if not path.is_file():
        raise ConfigError("--hardware", f"unknown hardware {spec!r}",
                          f"known: {', '.join(known)}; or the path of a profile file")
    try:
        data = read_yaml_file(path)
    except ConfigError as e:  # a binary file, one too large, not YAML: named under the flag
        raise ConfigError(f"--hardware {e.key}" if e.key else "--hardware", e.problem, e.hint) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hardware {spec}", f"holds no profile (a mapping of {', '.join(REQUIRED)})",
                          "see shardwise/fsdp/hardware.yaml")
    return _hardware(str(data.get("name", path.stem)), data, f"--hardware {spec}")


def _hardware(name: str, data: dict, key: str) -> Hardware:
    missing = [f for f in REQUIRED if f not in data]
    if missing:
        raise ConfigError(key, f"the profile lacks {', '.join(missing)}", "see shardwise/fsdp/hardware.yaml")
    unknown = [k for k in data if k not in REQUIRED and k not in ("name", "sources")]
    if unknown:
        raise ConfigError(key, f"the profile has unknown field(s) {', '.join(map(str, unknown))}",
                          f"fields: {', '.join(REQUIRED)}")
    if not isinstance(data["mfu"], dict) or not {"none", "full"} <= set(data["mfu"]):
        raise ConfigError(key, "mfu needs both 'none' and 'full' (no recompute, every layer recomputed)",
                          f"the {EXAMPLE_PROFILE} profile has mfu: {_example('mfu')}")
    if not isinstance(data["peak_flops"], dict) or not data["peak_flops"]:
        raise ConfigError(key, "peak_flops needs a FLOP/s per compute dtype",
                          f"the {EXAMPLE_PROFILE} profile has peak_flops: {_example('peak_flops')}")
    values = {f: ({k: _in_range(key, f"{f}.{k}", v, f) for k, v in data[f].items()} if f in ("peak_flops", "mfu")
                  else _in_range(key, f, data[f], f)) for f in FIELD_RANGES}
    return Hardware(name=name, description=str(data["description"]), sources=dict(data.get("sources") or {}),
                    **values)


def _in_range(key: str, name: str, value: object, field_name: str) -> float:
    """`value` of profile field `name` as a number within `FIELD_RANGES[field_name]`, else a
    ConfigError naming the field, the value and the example profile's value."""
    kind, unit = FIELD_RANGES[field_name]
    number = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            number = float(value)  # a quoted "1e12" too
    ok = number is not None and math.isfinite(number) and {
        "positive": lambda x: x > 0, "non-negative": lambda x: x >= 0, "fraction": lambda x: 0 < x <= 1,
        "count": lambda x: x >= 1 and x == int(x)}[kind](number)
    if not ok:
        wanted = {"positive": f"a positive number of {unit}", "non-negative": f"a number of {unit} >= 0",
                  "fraction": f"a fraction in (0, 1] {unit}", "count": f"a whole number of {unit}, at least 1"}[kind]
        raise ConfigError(key, f"{name} is {short_repr(value)}, not {wanted}",
                          f"the {EXAMPLE_PROFILE} profile has {name}: {_example(name)}")
    return int(number) if kind == "count" else number


def _example(name: str) -> str:
    """The value of `name` (``mfu`` or ``mfu.none``) in the `EXAMPLE_PROFILE`."""
    field_name, _, sub = name.partition(".")
    value = profiles()[EXAMPLE_PROFILE][field_name]
    if sub:
        value = value.get(sub, next(iter(value.values())))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v:g}" for k, v in value.items()) + "}"
    return f"{value:g}"


def collective_seconds(c: Collective, hw: Hardware) -> float:
    """Seconds of all `c.calls` calls: ring latency plus wire bytes over the link's
    effective bandwidth (inter-node link when the group crosses nodes)."""
    if c.inter_node:
        lat, bw = hw.inter_node_latency_s, hw.inter_node_bandwidth * hw.inter_node_efficiency
    else:
        lat, bw = hw.intra_node_latency_s, hw.intra_node_bandwidth * hw.intra_node_efficiency
    return c.calls * lat * c.ring_steps + c.wire_bytes / bw


def default_mfu(hw: Hardware, recomputed_share: float) -> float:
    """The profile's no-recompute MFU, lowered by the forward a recompute of
    `recomputed_share` of the layers adds: none / (1 + share / 3) (full: x 3/4)."""
    return hw.mfu["none"] / (1 + recomputed_share / 3)


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _attention_modules(model: nn.Module) -> list[str]:
    """HF decoder attention modules (as `shardwise.distributed.ulysses.enable` finds them)."""
    return [n for n, m in model.named_modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]


def attention_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """torchtitan's attention term per layer: 12 x heads x head_dim x seq."""
    cfg = _text_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 12 * cfg.num_attention_heads * head_dim * seq_len


def _input_embedding(model: nn.Module) -> str | None:
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return next((f"{n}.weight" for n, m in model.named_modules() if m is emb), None)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """torchtitan's model FLOPs per token (`get_num_flop_per_token`, with its
    `exclude_embedding`): 6 x (parameters - input embedding) + 12 x l x h x q x t."""
    emb = _input_embedding(model)
    params = sum(p.numel() for n, p in model.named_parameters() if n != emb)
    return 6 * params + attention_flops_per_token(model, seq_len) * len(_attention_modules(model))


def unit_flops_per_token(model: nn.Module, plan, seq_len: int) -> dict[str, float]:
    """Each unit's share of `flops_per_token`: its own parameters (input embedding left
    out), its attention modules. Ignored modules count with the unit around them."""
    paths = [u.path for u in plan.units]
    emb = _input_embedding(model)
    out = dict.fromkeys(paths, 0.0)
    for n, p in model.named_parameters():
        if n != emb:
            out[owner_unit(n, paths)] += 6 * p.numel()
    per_layer = attention_flops_per_token(model, seq_len)
    for a in _attention_modules(model):
        out[owner_unit(f"{a}.x", paths)] += per_layer
    return out


@dataclass
class Projection:
    hardware: str
    world_size: int
    mfu: float
    flops_per_token: float
    tokens_per_step_per_gpu: float
    step_s: float
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    comm_s: float
    """Sum of every collective's time, hidden or not."""
    memory_bytes: int
    """Per rank: state + gathered units + activations (see the module docstring)."""
    activation_bytes: int
    fits: bool

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step_per_gpu / self.step_s

    def to_json(self) -> dict:
        return {"hardware": self.hardware, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "step_s": self.step_s,
                "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s, "fits": self.fits,
                "optimizer_s": self.optimizer_s, "comm_s": self.comm_s, "mfu": self.mfu,
                "flops_per_token": self.flops_per_token, "tokens_per_step_per_gpu": self.tokens_per_step_per_gpu,
                "memory_bytes": self.memory_bytes, "activation_bytes": self.activation_bytes}


@dataclass
class _Stage:
    """A top-level unit (nested units folded in) as the timeline sees it."""

    path: str
    forward_s: float = 0.0
    backward_s: float = 0.0
    gather_s: float = 0.0
    """One forward all-gather (per micro-batch)."""
    regather_s: float = 0.0
    """One backward all-gather (0: not resharded, or its backward never gathers)."""
    reduce_s: float = 0.0
    """Reduce-scatter + all-reduce, once per step."""
    a2a_s: float = 0.0
    """Ulysses all-to-alls of one micro-batch, forward and backward."""


def project(model: nn.Module, plan, comm: StepComm, hw: Hardware, mfu: float | None = None) -> Projection:
    """Projected step of `plan` on `hw` (see the module docstring)."""
    cfg = _text_config(model)
    layers = max(1, len(_attention_modules(model)))
    recomputed = sum(1 for a in _attention_modules(model) if any(is_under(a, r) for r in plan.recompute))
    if mfu is None:
        mfu = default_mfu(hw, recomputed / layers)
    compute_dtype = plan.unit("").param_dtype
    if compute_dtype not in hw.peak_flops:
        raise ConfigError("--hardware", f"the profile {hw.name} has no peak FLOP/s for {compute_dtype}",
                          f"it has {', '.join(hw.peak_flops)}")
    rate = hw.peak_flops[compute_dtype] * mfu
    sp = plan.mesh.ulysses
    tokens_mb = comm.micro_batch_size * comm.seq_len / sp  # per rank and micro-batch
    k = comm.accumulation

    # top-level stages in forward order, the root first (its gather opens the forward)
    inner = [u for u in plan.units if u.path]
    tops = [u for u in inner if not any(o is not u and o.path and is_under(u.path, o.path) for o in inner)]
    pre = {n: i for i, (n, _) in enumerate(model.named_modules())}
    tops.sort(key=lambda u: pre[u.path])
    stage_of = {}
    for u in plan.units:
        stage_of[u.path] = next((t.path for t in tops if is_under(u.path, t.path)), "")
    stages = {p: _Stage(p) for p in ["", *[t.path for t in tops]]}
    unit_flops = unit_flops_per_token(model, plan, comm.seq_len)
    for u in plan.units:
        st = stages[stage_of[u.path]]
        seconds = unit_flops[u.path] * tokens_mb / rate
        st.forward_s += seconds / 3
        st.backward_s += seconds * 2 / 3
        for c in comm.unit(u.path).collectives:
            t = collective_seconds(c, hw)
            if c.kind == "all_to_all":
                st.a2a_s += t / k
            elif c.kind == "all_gather":
                if c.phase == "forward":
                    st.gather_s += t / k
                else:
                    st.regather_s += t / k
            else:
                st.reduce_s += t
    order = [stages[""], *[stages[t.path] for t in tops]]
    fwd_depth = max(1, max((len(t.prefetch_forward) for t in tops), default=1))
    bwd_depth = max(1, max((len(t.prefetch_backward) for t in tops), default=1))

    clock = comm_free = 0.0
    for mb in range(k):
        clock, comm_free = _micro_batch(order, clock, comm_free, fwd_depth, bwd_depth, last=mb == k - 1)
    compute_s = k * sum(s.forward_s + s.backward_s for s in order)
    state = peak_memory(plan.memory_per_rank_bytes)["total"]
    optimizer_s = 2 * state / hw.memory_bandwidth
    step_s = max(clock, comm_free) + optimizer_s
    comm_s = sum(collective_seconds(c, hw) for u in comm.units for c in u.collectives)
    activations = _activation_bytes(cfg, plan, tokens_mb, layers, recomputed)
    memory = state + _gathered_bytes(plan, comm, fwd_depth, bwd_depth) + activations
    return Projection(hardware=hw.name, world_size=plan.world_size, mfu=mfu,
                      flops_per_token=flops_per_token(model, comm.seq_len),
                      tokens_per_step_per_gpu=tokens_mb * k, step_s=step_s, compute_s=compute_s,
                      exposed_comm_s=step_s - compute_s - optimizer_s, optimizer_s=optimizer_s, comm_s=comm_s,
                      memory_bytes=int(memory), activation_bytes=int(activations),
                      fits=memory <= hw.memory_bytes)


def _micro_batch(order: list[_Stage], clock: float, comm_free: float, fwd_depth: int, bwd_depth: int,
                 last: bool) -> tuple[float, float]:
    """One forward and backward from time `clock` on a compute stream and a serial
    communication stream (free from `comm_free`); returns (compute end, communication
    end). `order[0]` is the root: gathered first, its head computed after the layers in
    forward and before them in backward, its embedding's gradient last, reduced last."""
    n = len(order)
    # forward: stage i's gather may start once stage i - depth began (the root at `clock`)
    began = {0: clock}
    compute_free = clock
    for i in range(n):
        allowed = clock if i - fwd_depth <= 0 else began[i - fwd_depth]
        comm_free = max(comm_free, allowed) + order[i].gather_s
        if i == 0:
            compute_free = max(compute_free, comm_free)  # the embedding waits for the root's gather
            continue
        began[i] = max(comm_free, compute_free)
        compute_free = began[i] + order[i].forward_s + order[i].a2a_s / 2
    compute_free += order[0].forward_s
    # backward: the head, then the layers in reverse. Stage i's gather may start once stage
    # i + depth began its backward (index n: the head); a stage's reduce-scatter is issued
    # when its backward ends, after the gather issued at its start.
    bbegan = {n: compute_free}
    compute_free += order[0].backward_s / 2
    pending: tuple[float, float] | None = None  # (ready at, seconds) of the last stage's reduce
    for i in range(n - 1, 0, -1):
        ready = compute_free
        if order[i].regather_s:
            comm_free = max(comm_free, bbegan[min(i + bwd_depth, n)]) + order[i].regather_s
            ready = max(ready, comm_free)
        if pending is not None:
            comm_free = max(comm_free, pending[0]) + pending[1]
            pending = None
        bbegan[i] = ready
        compute_free = ready + order[i].backward_s + order[i].a2a_s / 2
        if last and order[i].reduce_s:
            pending = (compute_free, order[i].reduce_s)
    if pending is not None:
        comm_free = max(comm_free, pending[0]) + pending[1]
    compute_free += order[0].backward_s / 2
    if last and order[0].reduce_s:
        comm_free = max(comm_free, compute_free) + order[0].reduce_s
    return compute_free, comm_free


def _gathered_bytes(plan, comm: StepComm, fwd_depth: int, bwd_depth: int) -> int:
    """Unsharded parameters and gradients held at once: the root's, and the largest unit's
    times (1 + prefetch depth)."""
    def gather(path: str) -> int:
        return max((c.buffer_bytes for c in comm.unit(path).collectives if c.kind == "all_gather"), default=0)

    def grad(path: str) -> int:
        return max((c.buffer_bytes for c in comm.unit(path).collectives if c.kind == "reduce_scatter"), default=0)

    others = [u.path for u in plan.units if u.path]
    big = max((gather(p) + grad(p) for p in others), default=0)
    return gather("") + grad("") + (1 + max(fwd_depth, bwd_depth)) * big


def _activation_bytes(cfg, plan, tokens: float, layers: int, recomputed: int) -> float:
    """Korthikanti et al. 2022 per token and layer: 34 x hidden bytes (16-bit, flash
    attention), 2 x hidden for a recomputed layer; plus logits: 10 x vocab bytes per token."""
    h = cfg.hidden_size
    per_token = (layers - recomputed) * 34 * h + recomputed * 2 * h + 10 * getattr(cfg, "vocab_size", 0)
    scale = dtype_bytes(plan.unit("").param_dtype) / 2  # the 34 assumes 16-bit activations
    return tokens * per_token * scale
