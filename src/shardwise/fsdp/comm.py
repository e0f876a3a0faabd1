"""The collectives one optimizer step issues, per unit and per rank: pure arithmetic on
the plan, the meta model's parameter shapes and the step's shape.

What FSDP2 (torch 2.13, `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`) does
per unit, and therefore what is counted here (bytes of the full buffer of each call):

- all-gather (`dist.all_gather_single`): the output buffer, every owned parameter padded
  to ceil(dim0 / shard) rows on each of the `shard` ranks, in the unit's `param_dtype`
  (frozen parameters included: forward needs them). Once per micro-batch in forward; once
  more in backward when the unit reshards after forward (true, or an int: then over that
  many consecutive ranks, same buffer) and its backward runs (its output needs a gradient:
  it trains a parameter, or a trainable parameter runs before it, modules in definition
  order being the forward order of HF decoders) or a unit whose backward runs prefetches
  it (`fsdp.prefetch.backward`, or FSDP's implicit one-unit prefetch where none is set).
  No all-gather when shard is 1.
- reduce-scatter (`dist.reduce_scatter_single`): the input buffer, the trainable
  parameters padded as above, in `reduce_dtype`; once per optimizer step: the engine
  turns gradient sync off for every micro-batch but the last (`set_requires_gradient_sync`),
  FSDP then keeps the unsharded gradients and reduces their sum. None when shard is 1.
- all-reduce (`dist.all_reduce`, HSDP and no_shard: replicate > 1): the reduce-scatter's
  output (the padded trainable shard) in `reduce_dtype`, across the replicas, once per
  step with the reduce-scatter.
- all-to-all (`dist.all_to_all`, Ulysses, `shardwise.distributed.ulysses`): per attention
  module and micro-batch, query, key, value and the output in forward, their gradients in
  backward, and the forward ones again in backward when the attention is recomputed; each
  tensor (micro, heads, seq / sp, head_dim) in the unit's compute dtype, key and value
  repeated to every query head when sp does not divide the key/value heads.

The step's shape: `accumulation` micro-batches of `train.micro_batch_size` rows of
`data.max_length` tokens (padded to a multiple of the sp degree); shorter rows send less
all-to-all traffic, nothing else changes. The engine's own scalar all-reduces (the loss,
the gradient norm: 12 bytes a step) and the whole-gradient all-reduce of
`fsdp.ignored_modules` are not FSDP's and are not counted.

Networks: ranks are numbered node by node (`gpus_per_node` each); shard groups are blocks
of `shard` consecutive ranks, replica groups take every `shard`-th rank, Ulysses groups and
the int-reshard groups are blocks of consecutive ranks. A group crosses nodes when two of
its ranks live on different nodes. Wire bytes (what each rank sends, ring algorithms):
(n - 1) / n of the buffer for all-gather, reduce-scatter and all-to-all, twice that for
all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from shardwise.config.dtypes import dtype_bytes
from shardwise.config.validate import MeshSpec
from shardwise.fsdp.plan import is_under, owner_unit

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class Collective:
    """One kind of call a unit makes, `calls` times per optimizer step on every rank."""

    kind: str
    """One of KINDS."""
    phase: str
    """forward | backward | step (once per optimizer step, after the last backward)."""
    buffer_bytes: int
    """Bytes of the full buffer of one call (all-gather output, reduce-scatter input,
    all-reduce / all-to-all tensor), FSDP's padding included."""
    calls: int
    group_size: int
    inter_node: bool
    """The group spans more than one node."""

    @property
    def bytes(self) -> int:
        """Buffer bytes of all `calls`, per rank per step."""
        return self.buffer_bytes * self.calls

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends for all `calls` (ring algorithms)."""
        n = self.group_size
        factor = 2 if self.kind == "all_reduce" else 1
        return self.bytes * factor * (n - 1) // n

    @property
    def ring_steps(self) -> int:
        """Latency-bound steps of one call's ring."""
        return (2 if self.kind == "all_reduce" else 1) * (self.group_size - 1)


@dataclass
class UnitComm:
    path: str
    collectives: list[Collective] = field(default_factory=list)

    def bytes_by_kind(self) -> dict[str, int]:
        return {k: sum(c.bytes for c in self.collectives if c.kind == k) for k in KINDS}

    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.collectives)


@dataclass
class StepComm:
    """The collectives of one optimizer step on one rank."""

    accumulation: int
    """Micro-batches per optimizer step on each rank."""
    micro_batch_size: int
    seq_len: int
    """Tokens per row as counted (data.max_length, padded to a multiple of the sp degree)."""
    gpus_per_node: int
    units: list[UnitComm]
    """In the plan's apply order."""

    def unit(self, path: str) -> UnitComm:
        return next(u for u in self.units if u.path == path)

    def bytes_per_step(self) -> dict[str, int]:
        return {k: sum(u.bytes_by_kind()[k] for u in self.units) for k in KINDS}

    def wire_bytes_per_step(self) -> dict[str, int]:
        return {k: sum(c.wire_bytes for u in self.units for c in u.collectives if c.kind == k) for k in KINDS}

    def to_json(self) -> dict:
        return {"accumulation": self.accumulation, "micro_batch_size": self.micro_batch_size,
                "seq_len": self.seq_len, "gpus_per_node": self.gpus_per_node,
                "wire_bytes_per_step": self.wire_bytes_per_step()}

    def plan_json(self, units: list[dict]) -> dict:
        """The plan's JSON with this step's figures (`shardwise.fsdp.plan.PlanFigures`): each
        unit's bytes by collective kind are added to its entry of `units` (in place); returns
        the step's totals and this object's JSON, for the plan's top level."""
        for u in units:
            u["comm_bytes"] = self.unit(u["path"]).bytes_by_kind()
        return {"comm_bytes_per_step": self.bytes_per_step(), "comm": self.to_json()}


def step_comm(model: nn.Module, plan, mesh: MeshSpec, *, accumulation: int, micro_batch_size: int,
              max_length: int, gpus_per_node: int) -> StepComm:
    """The collectives of one optimizer step of `plan` (see the module docstring)."""
    S, R, sp = mesh.shard, mesh.replicate, mesh.ulysses
    world = mesh.world_size
    seq = -(-max_length // sp) * sp
    unit_paths = [u.path for u in plan.units]
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    padded: dict[str, int] = dict.fromkeys(unit_paths, 0)
    trainable: dict[str, int] = dict.fromkeys(unit_paths, 0)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    # definition-order index of the first module with a trainable parameter
    first_trainable = min((order[n.rsplit(".", 1)[0] if "." in n else ""] for n in trained), default=math.inf)
    for name, p in model.named_parameters():
        if any(is_under(name, ig) for ig in plan.ignored):
            continue
        owner = owner_unit(name, unit_paths)
        dim0 = p.shape[0] if p.dim() > 0 else 1
        n = -(-dim0 // S) * S * (math.prod(p.shape[1:]) if p.dim() > 1 else 1)
        padded[owner] += n
        if p.requires_grad:
            trainable[owner] += n

    # A unit's backward runs when its output needs a gradient: it trains a parameter, or a
    # trainable parameter runs before it. Such a unit's pre-backward all-gathers what it
    # prefetches: its plan list, or (none set) the unit before it in post-forward order,
    # the plan's apply order (FSDPParamGroup._backward_prefetch) -- whether that unit's own
    # backward runs or not.
    runs = [first_trainable < order[u.path] or any(is_under(n, u.path) for n in trained) for u in plan.units]
    gathered_in_backward: set[str] = set()
    for i, u in enumerate(plan.units):
        if runs[i]:
            gathered_in_backward.add(u.path)
            gathered_in_backward.update(u.prefetch_backward or ([plan.units[i - 1].path] if i else []))
    shard_inter = _crosses(_blocks(world, S), gpus_per_node)
    replica_inter = _crosses([[s + r * S for r in range(R)] for s in range(S)], gpus_per_node)
    out = []
    for u in plan.units:
        c: list[Collective] = []
        if S > 1 and padded[u.path]:
            gather = padded[u.path] * dtype_bytes(u.param_dtype)
            c.append(Collective("all_gather", "forward", gather, accumulation, S, shard_inter))
            if u.reshard_after_forward is not False and u.path in gathered_in_backward:
                size = S if u.reshard_after_forward is True else int(u.reshard_after_forward)
                c.append(Collective("all_gather", "backward", gather, accumulation, size,
                                    _crosses(_blocks(world, size), gpus_per_node)))
        if trainable[u.path]:
            reduce = trainable[u.path] * dtype_bytes(u.reduce_dtype)
            if S > 1:
                c.append(Collective("reduce_scatter", "step", reduce, 1, S, shard_inter))
            if R > 1:
                c.append(Collective("all_reduce", "step", reduce // S, 1, R, replica_inter))
        out.append(UnitComm(u.path, c))
    if sp > 1:
        _add_ulysses(model, plan, out, sp, micro_batch_size, accumulation, seq,
                     _crosses(_blocks(world, sp), gpus_per_node))
    return StepComm(accumulation, micro_batch_size, seq, gpus_per_node, out)


def _add_ulysses(model: nn.Module, plan, units: list[UnitComm], sp: int, micro: int, accumulation: int,
                 seq: int, inter: bool) -> None:
    """Each attention module's all-to-alls, in its unit: per micro-batch two of query size
    (query, output) and two of key size (key, value), forward and backward."""
    paths = [u.path for u in plan.units]
    dtype = {u.path: u.param_dtype for u in plan.units}
    by_path = {u.path: u for u in units}
    for name, mod in model.named_modules():
        if not (hasattr(mod, "num_key_value_groups") and hasattr(mod, "layer_idx")):  # as ulysses.enable
            continue
        cfg = mod.config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(mod, "head_dim", None) or cfg.hidden_size // heads
        if kv % sp:
            kv = heads
        owner = owner_unit(f"{name}.x", paths)
        esz = dtype_bytes(dtype[owner])
        backward_passes = 2 if any(is_under(name, r) for r in plan.recompute) else 1  # + the recomputed forward
        for h in (heads, kv):
            tensor = micro * h * (seq // sp) * head_dim * esz
            by_path[owner].collectives.append(Collective("all_to_all", "forward", tensor, 2 * accumulation, sp, inter))
            by_path[owner].collectives.append(Collective("all_to_all", "backward", tensor,
                                                         2 * accumulation * backward_passes, sp, inter))


def _blocks(world: int, size: int) -> list[list[int]]:
    return [list(range(start, min(start + size, world))) for start in range(0, world, size)]


def _crosses(groups: list[list[int]], gpus_per_node: int) -> bool:
    """Some group holds ranks of two nodes."""
    return any(len({r // gpus_per_node for r in g}) > 1 for g in groups)
