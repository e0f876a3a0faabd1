"""Full tensors out of a sharded model: one at a time (export, weight sync) or every unit
at once for a block of forwards (generation).

This is the one module of shardwise that touches torch's private FSDP2 state; everything
else uses the public `FSDPModule` / `DTensor` API. What it touches, and why, is in
`_PrivateState`: `gathered_for_generation` must put back each unit's reshard-after-forward
setting exactly as it was, and torch has no public way to read that setting or to set an
int one (``set_reshard_after_forward`` takes a bool). Checked against torch 2.13.0 (CPU,
run by the test suite), 2.14.1 (its source) and 2.15.0 (its source, and the suite run on
it): all keep the list
``FSDPState._fsdp_param_groups``; torch 2.11 has one ``_fsdp_param_group`` instead (seen
on a GPU machine), which `_PrivateState.param_groups` reads too. `FSDPState._lazy_init`
(the root's set-up before a generation that starts in an inner unit) is in all three.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.models import lora
from shardwise.models.layout import checkpoint_entries, tied_aliases

__all__ = ["fsdp_hooks_skipped", "full_tensor", "gather_full", "gathered_for_generation", "iter_adapter_tensors", "iter_full_tensors"]


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The full tensor of a state-dict value: a DTensor is all-gathered (collective: every
    rank of its mesh calls this), a plain tensor is returned detached. CPU-offloaded shards
    are moved to the mesh's device for the collective (NCCL gathers CUDA tensors only)."""
    if not isinstance(value, DTensor):
        return value.detach()
    device = _mesh_device(value)
    if value.to_local().device != device:
        value = DTensor.from_local(value.to_local().to(device), value.device_mesh, value.placements,
                                   run_check=False, shape=value.shape, stride=value.stride())
    return value.full_tensor()


def _mesh_device(value: DTensor) -> torch.device:
    mesh_type = value.device_mesh.device_type
    if mesh_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh_type, getattr(torch, mesh_type).current_device())


def _row_sharded(value: torch.Tensor) -> bool:
    """FSDP's own layout: sharded on dim 0 over the mesh's last dimension, replicated over
    the others (HSDP), uneven shards as ``torch.chunk`` cuts them. Anything else (a
    strided shard of FSDP + TP, a scalar) is gathered by `full_tensor`."""
    if not isinstance(value, DTensor) or value.dim() == 0:
        return False
    *outer, last = value.placements
    return last == Shard(0) and all(p == Replicate() for p in outer)


def gather_full(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full_tensor` of each value, with one all-gather per (mesh, dtype) instead of one per
    tensor: each rank lays its row shards end to end (every shard padded to the chunk size
    ``ceil(rows / world)``), one ``all_gather_into_tensor`` over the shard dimension moves
    them all, and each full tensor is cut back out (padding dropped). Equal bitwise to
    `full_tensor` (a copy). Collective like it: every rank passes the same keys, in the
    same order. Peak extra memory: the full tensors returned plus one padded buffer."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[int, torch.dtype], list[str]] = {}
    for key, value in values.items():
        if _row_sharded(value):
            groups.setdefault((id(value.device_mesh), value.dtype), []).append(key)
        else:
            out[key] = full_tensor(value)
    for keys in groups.values():
        first = values[keys[0]]
        mesh, device = first.device_mesh, _mesh_device(first)
        world = mesh.size(mesh.ndim - 1)
        chunks = [-(-values[k].shape[0] // world) for k in keys]  # rows per rank, padded
        sizes = [c * (values[k].numel() // max(values[k].shape[0], 1)) for k, c in zip(keys, chunks)]
        send = torch.zeros(sum(sizes), dtype=first.dtype, device=device)
        offset = 0
        for k, size in zip(keys, sizes):
            local = values[k].to_local().detach().reshape(-1)
            send[offset:offset + local.numel()].copy_(local)
            offset += size
        recv = torch.empty(world * send.numel(), dtype=send.dtype, device=device)
        dist.all_gather_into_tensor(recv, send, group=mesh.get_group(mesh.ndim - 1))
        per_rank = recv.view(world, send.numel())
        offset = 0
        for k, c, size in zip(keys, chunks, sizes):
            shape = values[k].shape
            rows = per_rank[:, offset:offset + size].reshape(world * c, *shape[1:])
            out[k] = rows[:shape[0]].clone()
            offset += size
    return {k: out[k] for k in values}


def iter_full_tensors(model: nn.Module, dtype: torch.dtype | None = None, merge_lora: bool = True,
                      bucket_bytes: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` for every state-dict entry of `model` (sharded or plain).
    Tied aliases are skipped and fused MoE experts cut per expert
    (`shardwise.models.layout`); a LoRA model's base weights come merged with their
    adapters, under the base names (with `merge_lora` False: the base weights as they are,
    the adapters left out). Collective: every rank iterates to the end, in the same order.
    Floating tensors are cast to `dtype` when given.

    With `bucket_bytes` 0 the tensors are gathered one at a time (peak extra memory: one
    full tensor); else consecutive tensors up to that many full bytes are gathered
    together (`gather_full`: one all-gather per bucket; peak extra memory about one bucket).
    The fixed cost of a gather is what a weight push of a small model is made of."""
    aliases = tied_aliases(model)
    sd = model.state_dict()
    merges = lora.merge_sources(model) if merge_lora else {}  # LoRA: base merged with its adapters, layer by layer
    entries = checkpoint_entries(model, [(lora.hf_name(k), k, tuple(v.shape), v.dtype) for k, v in sd.items()
                                         if k not in aliases and not lora.is_lora_key(k)])
    sources = list(dict.fromkeys(e.source for e in entries))
    needs = {s: [s, *merges[s][:2]] if s in merges else [s] for s in sources}
    full: dict[str, torch.Tensor] = {}
    i = 0
    for e in entries:
        if e.source not in full:  # gather this source and the next ones, up to the bucket
            full.clear()
            bucket, size = [], 0
            while i < len(sources) and (not bucket or size + _full_bytes(sd, needs[sources[i]]) <= bucket_bytes):
                bucket.append(sources[i])
                size += _full_bytes(sd, needs[sources[i]])
                i += 1
            gathered = gather_full({k: sd[k] for s in bucket for k in needs[s]})
            for s in bucket:
                full[s] = gathered[s]
                if s in merges:
                    a, b, scale = merges[s]
                    full[s] = lora.merge(full[s], gathered[a], gathered[b], scale)
            del gathered
        t = e.take(full[e.source])
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield e.name, t


def _full_bytes(sd: dict[str, torch.Tensor], keys: list[str]) -> int:
    return sum(sd[k].numel() * sd[k].element_size() for k in keys)


def iter_adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT adapter-file name, full tensor)`` of a LoRA model's adapters, one at a time
    (collective like `iter_full_tensors`)."""
    sd = model.state_dict()
    for key, name in lora.adapter_state(sd).items():
        yield name, full_tensor(sd[key])


# ------------------------------------------------------------------ torch-private state


class _PrivateState:
    """Reading and writing the private fields of one torch ``FSDPState``.

    - ``_fsdp_param_groups`` (torch >= 2.12; 2.11: a single ``_fsdp_param_group``) and each
      group's ``post_forward_mesh_info``: None keeps the parameters after forward, the
      group's own mesh info reshards (True), a smaller mesh info reshards to that many
      ranks (an int setting);
    - ``_auto_reshard_after_forward``: True when `fully_shard` got no explicit value, so
      the root's lazy initialisation turns resharding off for the root;
    - ``_is_root``: None until the first forward's lazy initialisation.
    """

    def __init__(self, module: FSDPModule):
        self.module = module
        self.state = module._get_fsdp_state()

    @property
    def param_groups(self) -> list[Any]:
        groups = getattr(self.state, "_fsdp_param_groups", None)
        if groups is not None:
            return list(groups)
        group = getattr(self.state, "_fsdp_param_group", None)  # torch 2.11
        return [] if group is None else [group]

    @property
    def auto(self) -> bool | None:
        return getattr(self.state, "_auto_reshard_after_forward", None)

    @auto.setter
    def auto(self, value: bool | None) -> None:
        if hasattr(self.state, "_auto_reshard_after_forward"):
            self.state._auto_reshard_after_forward = value

    @property
    def is_root(self) -> bool | None:
        return self.state._is_root

    def lazy_init_root(self) -> None:
        """torch's lazy root set-up (``FSDPState._lazy_init``), which the root's first
        forward runs; needed before any inner unit runs a forward of its own (HF's VL
        ``generate`` encodes the image with the vision tower before the root's forward)."""
        if self.state._is_root is None:
            self.state._lazy_init()

    def forward_hook_ids(self) -> list[int] | None:
        """The ids of the unit's own forward pre/post hooks on its module, or None where
        skipping them would change a forward: a grouped unit (one hook over several modules)
        or a mixed-precision policy that casts to something other than fp32."""
        mp = getattr(self.state, "_mp_policy", None)
        pre = getattr(self.state, "_pre_forward_hook_handle", None)
        post = getattr(self.state, "_post_forward_hook_handle", None)
        if mp is None or pre is None or post is None or not hasattr(pre, "id") or not hasattr(post, "id"):
            return None
        if mp.param_dtype not in (None, torch.float32) or mp.output_dtype not in (None, torch.float32):
            return None
        return [pre.id, post.id]

    def post_forward(self) -> list[Any]:
        return [g.post_forward_mesh_info for g in self.param_groups]

    def set_post_forward(self, infos: list[Any]) -> None:
        for group, info in zip(self.param_groups, infos, strict=True):
            group.post_forward_mesh_info = info


def fsdp_states(model: nn.Module) -> list[_PrivateState]:
    """One `_PrivateState` per distinct FSDP state under `model`, in module order (a grouped
    ``fully_shard([a, b])`` has one state for several modules: it appears once)."""
    out: list[_PrivateState] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            s = _PrivateState(module)
            if id(s.state) not in seen:
                seen.add(id(s.state))
                out.append(s)
    return out


@dataclass
class _Saved:
    state: _PrivateState
    auto: bool | None
    post_forward: list[Any]
    was_root: bool | None


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Keep every FSDP unit of `model` unsharded for the duration of the block.

    Collective on entry: each unit all-gathers its parameters once (all ranks must enter,
    also a rank with nothing to generate). Inside, forwards issue no collective, so ranks
    may run different numbers of them (each its own decoding steps). For forward-only work
    (under ``torch.no_grad()``); a backward inside is not supported. Memory per rank inside:
    the whole model in the units' compute dtype (``fsdp.mixed_precision.param_dtype``).

    On exit (no collective) every unit is resharded and its reshard-after-forward setting
    restored exactly as it was (bool, int, and the root's own False), including when the
    model's first forward, and so torch's lazy root set-up, ran inside. `model` is the root
    of the FSDP tree (e.g. ``TrainEngine.model``).
    """
    states = fsdp_states(model)
    if states and states[0].module is model:
        states[0].lazy_init_root()
    saved = [_Saved(s, s.auto, s.post_forward(), s.is_root) for s in states]
    try:
        # Unshard before turning resharding off: a unit left "sharded post forward" (an int
        # setting, after a no-grad forward) all-gathers over the mesh in post_forward_mesh_info.
        for s in states:
            s.module.unshard()
        for s in states:
            # Forwards now find their unit unsharded (no all-gather) and keep it (no free).
            s.module.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for s in states:
            s.module.reshard()  # outside forward: frees the full parameters, no collective
        for sv in saved:
            sv.state.auto = sv.auto
            sv.state.set_post_forward(sv.post_forward)
            if sv.was_root is None and sv.state.is_root and sv.auto:
                # The first forward ran inside the block, where resharding was off, so torch's
                # lazy init skipped its one change: an automatic root keeps its parameters.
                sv.state.set_post_forward([None] * len(sv.post_forward))


@contextlib.contextmanager
def fsdp_hooks_skipped(model: nn.Module) -> Iterator[bool]:
    """Inside a `gathered_for_generation` block under ``torch.no_grad()``: the forwards of
    `model` skip FSDP's per-unit forward hooks, which then have nothing to do (the units
    stay unsharded, nothing is recorded for a backward, and casting to fp32 changes nothing)
    but cost Python time on every decoding step. Yields True where they are skipped; False
    (hooks kept, nothing changed) when some unit's hooks could change a forward: grouped
    units, or a mixed-precision policy that casts to bf16 / fp16. Every hook is back, in
    its place, on exit."""
    states = fsdp_states(model)
    ids = [s.forward_hook_ids() for s in states]
    if not states or any(i is None for i in ids) or torch.is_grad_enabled():
        yield False
        return
    saved: list[tuple[nn.Module, dict, dict]] = []
    try:
        for s, (pre, post) in zip(states, ids):
            m = s.module
            saved.append((m, dict(m._forward_pre_hooks), dict(m._forward_hooks)))
            m._forward_pre_hooks.pop(pre, None)
            m._forward_hooks.pop(post, None)
        yield True
    finally:
        for m, pre_hooks, post_hooks in saved:
            for live, before in ((m._forward_pre_hooks, pre_hooks), (m._forward_hooks, post_hooks)):
                added = {k: v for k, v in live.items() if k not in before}
                live.clear()
                live.update(before)
                live.update(added)
