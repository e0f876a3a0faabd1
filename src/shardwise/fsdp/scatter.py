"""Full tensors into a sharded model: the inverse of `shardwise.fsdp.gather.iter_full_tensors`.

A generator rank receives the actor's weights as full tensors under their HF names (tied
aliases once, fused MoE experts cut per expert, a LoRA actor's weights merged) and copies
each rank's own part of them into its FSDP shards, in place: no collective, no second copy
of the model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardwise.models.layout import TensorEntry, checkpoint_entries, tied_aliases

__all__ = ["load_full_tensors"]


@torch.no_grad()
def load_full_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy `tensors` (HF name -> full tensor, as `iter_full_tensors` yields them) into
    `model`'s state (sharded DTensors take this rank's part; plain tensors all of it), cast
    to each target's dtype. Every state-dict entry must be there, and nothing else
    (ValueError naming the first names missing or unknown). Local: no collective. Returns
    the bytes read."""
    sd = model.state_dict()
    aliases = tied_aliases(model)
    entries = checkpoint_entries(model, [(k, k, tuple(v.shape), v.dtype) for k, v in sd.items() if k not in aliases])
    names = {e.name for e in entries}
    missing = [e.name for e in entries if e.name not in tensors]
    unknown = [n for n in tensors if n not in names]
    if missing or unknown:
        parts = ([f"lacks {missing[:3]}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")]
                 if missing else []) + ([f"has unknown {unknown[:3]}"] if unknown else [])
        raise ValueError(f"the weights received {' and '.join(parts)} (the model has {len(names)} tensors)")
    by_source: dict[str, list[TensorEntry]] = {}
    for e in entries:
        by_source.setdefault(e.source, []).append(e)
    nbytes = 0
    for source, parts in by_source.items():
        target = sd[source]
        first = tensors[parts[0].name]
        if len(parts) == 1 and parts[0].part is None:
            full = first
        else:  # fused experts: the per-expert tensors back into one
            full = torch.empty(target.shape, dtype=first.dtype, device=first.device)
            for e in parts:
                e.take(full).copy_(tensors[e.name])
        nbytes += sum(tensors[e.name].numel() * tensors[e.name].element_size() for e in parts)
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"the weights received give {source} the shape {tuple(full.shape)}; "
                             f"the model's is {tuple(target.shape)}")
        if isinstance(target, DTensor):
            local = target.to_local()
            # this rank's part of the full tensor, cut here (src_data_rank=None: no scatter)
            mine = distribute_tensor(full.to(local.device), target.device_mesh, target.placements,
                                     src_data_rank=None).to_local()
            local.copy_(mine)
        else:
            target.copy_(full)
    return nbytes
