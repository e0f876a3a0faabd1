"""Moving the FSDP actor's weights into a rollout engine (seed 003's weight-sync manager).

`iter_full_tensors` streams the actor's parameters as full tensors, one at a time (each
DTensor all-gathered when it is reached, so peak extra memory is one tensor, not the
model), under the HF names (tied aliases once). `WeightSync.sync` hands that stream to
the rollout engine before each generation when the engine keeps its own copy of the
weights; with `HFRollout`, which generates with the actor's parameters, it does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shardwise.checkpoint.hf_export import checkpoint_entries, gather_full, tied_aliases
from shardwise.rl.workers.rollout import RolloutEngine

__all__ = ["WeightSync", "iter_full_tensors"]


def iter_full_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every state-dict entry of `model` (sharded or plain),
    tied aliases skipped, under the names of an HF export (fused MoE experts cut per expert,
    as in the original checkpoints). Collective: every rank iterates to the end in the same
    order. Floating tensors are cast to `dtype` when given."""
    aliases = tied_aliases(model)
    sd = model.state_dict()
    entries = checkpoint_entries(model, [(k, k, tuple(v.shape), v.dtype) for k, v in sd.items() if k not in aliases])
    full, gathered = None, None
    for e in entries:
        if gathered != e.source:
            full = None
            full, gathered = gather_full(sd[e.source]), e.source
        t = e.take(full)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield e.name, t


class WeightSync:
    """Keeps a rollout engine's weights equal to the actor's."""

    def __init__(self, actor_model: nn.Module, engine: RolloutEngine, dtype: torch.dtype | None = None):
        self.actor_model = actor_model
        self.engine = engine
        self.dtype = dtype
        self.syncs = 0

    def sync(self) -> bool:
        """Push the actor's current weights into the engine; False when the engine shares
        the actor's parameters and nothing had to move. Collective."""
        if self.engine.shares_actor_parameters:
            return False
        self.engine.sync_weights(iter_full_tensors(self.actor_model, self.dtype))
        self.syncs += 1
        return True
