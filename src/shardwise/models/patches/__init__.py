"""Patches of HF models: the structural ones the config asks for, and document boundaries
for the sequence-state layers of hybrid models (always: packing is wrong without them,
`shardwise.models.patches.documents`). `patch_model` applies them alike to the meta model
the plan is made from, rank 0's full model that supplies the weights, and the meta model
an offline export reads names from, so all three have the same parameter names."""

from __future__ import annotations

from torch import nn

from shardwise.config.schema import Config
from shardwise.models.patches.documents import keep_documents_apart
from shardwise.models.patches.moe import split_moe_experts


def patch_model(model: nn.Module, cfg: Config) -> nn.Module:
    """`model` patched in place as `cfg` says (``fsdp.moe_expert_patch``), its sequence-state
    layers given document boundaries; returned."""
    if cfg.fsdp.moe_expert_patch:
        split_moe_experts(model)
    keep_documents_apart(model)
    return model


__all__ = ["patch_model"]
