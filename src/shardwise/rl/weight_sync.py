"""Moving the FSDP actor's weights into the rollout's generation engine.

`WeightSync.sync` hands the actor's full tensors, streamed one at a time under their HF
names (`shardwise.fsdp.gather.iter_full_tensors`: peak extra memory one tensor, tied
aliases once), to the engine before each generation when the engine keeps its own copy of
the weights; with `HFGenerator`, which generates with the actor's parameters, it does
nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine.generate import GenerationEngine
from shardwise.fsdp.gather import iter_full_tensors

__all__ = ["WeightSync"]


class WeightSync:
    """Keeps a rollout engine's weights equal to the actor's."""

    def __init__(self, actor_model: nn.Module, engine: GenerationEngine, dtype: torch.dtype | None = None):
        self.actor_model = actor_model
        self.engine = engine
        self.dtype = dtype
        self.syncs = 0

    def sync(self) -> bool:
        """Push the actor's current weights into the engine; False when the engine shares
        the actor's parameters and nothing had to move. Collective."""
        if self.engine.shares_model_parameters:
            return False
        self.engine.sync_weights(iter_full_tensors(self.actor_model, self.dtype))
        self.syncs += 1
        return True
