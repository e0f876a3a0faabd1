"""Structural patches of HF models that the config asks for. `patch_model` applies them
alike to the meta model the plan is made from, rank 0's full model that supplies the
weights, and the meta model an offline export reads names from, so all three have the
same parameter names."""

from __future__ import annotations

from torch import nn

from shardwise.config.schema import Config
from shardwise.models.patches.moe import split_moe_experts


def patch_model(model: nn.Module, cfg: Config) -> nn.Module:
    """`model` patched in place as `cfg` says (``fsdp.moe_expert_patch``); returned."""
    if cfg.fsdp.moe_expert_patch:
        split_moe_experts(model)
    return model


__all__ = ["patch_model"]
