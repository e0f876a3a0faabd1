"""The MoE expert patch (``fsdp.moe_expert_patch``): one module per expert, and
every expert runs on every rank.

Why: wrapping each expert as its own FSDP unit keeps an all-gather to one expert's
parameters instead of all of a layer's. But a unit all-gathers in its forward, and HF's
MoE forward calls only the experts its tokens were routed to: when two ranks route to
different experts, one rank waits in an all-gather the other never joins (the run
deadlocks). The patched forward calls every expert on every rank, an expert without
tokens on an empty batch, so all ranks issue the same collectives in the same order; the
empty calls add nothing to the output and zero to the gradients.

transformers 5 stores a layer's experts fused, as 3-D parameters of one module
(``Qwen3MoeExperts``: ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``), which cannot be
split into units. `split_moe_experts` replaces each such module by a `PerExpertMoE`: a
ModuleList of the model's own MLP class (``Qwen3MoeMLP``), one per expert, holding slices of
the fused weights. Parameter names become the original checkpoint layout
(``mlp.experts.{e}.gate_proj.weight``), which transformers 5 fuses again when it loads a
folder, so exports of a patched model load in plain transformers.

Supported: fused experts classes in `SUPPORTED` (Qwen3-MoE).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from shardwise.errors import ConfigError

__all__ = ["SUPPORTED", "PerExpertMoE", "checkpoint_layout", "fused_experts_modules", "split_moe_experts"]

SUPPORTED: dict[str, str] = {"Qwen3MoeExperts": "Qwen3MoeMLP"}
"""Fused experts class -> the MLP class of the same modeling module used per expert."""

KEY = "fsdp.moe_expert_patch"


class PerExpertMoE(nn.ModuleList):
    """A layer's experts as one module each; called like the fused module it replaces:
    ``(hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K)) -> (T, H)``.

    ``tokens_per_expert`` holds, after each forward, how many (token, slot) pairs each
    expert received on this rank (the routing the patch makes safe; also a load metric).
    """

    def __init__(self, experts: list[nn.Module]):
        super().__init__(experts)
        self.tokens_per_expert: list[int] = [0] * len(experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # (E, K, T): expert e's (slot, token) pairs
            routed = nn.functional.one_hot(top_k_index, num_classes=len(self)).permute(2, 1, 0)
        counts = []
        for e, expert in enumerate(self):
            slot, token = torch.where(routed[e])
            counts.append(int(token.numel()))
            # Every expert, on every rank, even with no token (an empty batch): its FSDP unit
            # all-gathers in forward and reduce-scatters in backward on all ranks alike.
            y = expert(hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        self.tokens_per_expert = counts
        return out


def fused_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every fused experts module of a supported class."""
    return [(p, m) for p, m in model.named_modules() if type(m).__name__ in SUPPORTED]


def _mlp_class(fused: nn.Module) -> type[nn.Module]:
    name = SUPPORTED[type(fused).__name__]
    return getattr(sys.modules[type(fused).__module__], name)


def _per_expert(fused: nn.Module, config) -> PerExpertMoE:
    gate_up, down = fused.gate_up_proj, fused.down_proj
    num, two_i, hidden = gate_up.shape
    inter = two_i // 2
    if tuple(down.shape) != (num, hidden, inter):
        raise ConfigError(KEY, f"{type(fused).__name__} has gate_up_proj {tuple(gate_up.shape)} and down_proj "
                          f"{tuple(down.shape)}, not the (E, 2I, H) / (E, H, I) layout the patch splits")
    cls = _mlp_class(fused)
    with torch.device("meta"):
        experts = [cls(config, intermediate_size=inter) for _ in range(num)]
    moe = PerExpertMoE(experts)
    if gate_up.device.type == "meta":
        moe.to(dtype=gate_up.dtype)
    else:
        moe.to_empty(device=gate_up.device)
        moe.to(dtype=gate_up.dtype)
        with torch.no_grad():
            for e, mlp in enumerate(moe):
                mlp.gate_proj.weight.copy_(gate_up[e, :inter])
                mlp.up_proj.weight.copy_(gate_up[e, inter:])
                mlp.down_proj.weight.copy_(down[e])
    for p in moe.parameters():
        p.requires_grad_(gate_up.requires_grad)
    return moe


def split_moe_experts(model: nn.Module) -> list[str]:
    """Replace every fused experts module of `model` (meta or real) by a `PerExpertMoE`
    holding the same weights; returns their paths. Raises ConfigError on
    ``fsdp.moe_expert_patch`` when the model has none."""
    found = fused_experts_modules(model)
    if not found:
        classes = sorted({type(m).__name__ for _, m in model.named_modules() if type(m).__name__.endswith("Experts")})
        what = f"its experts are {', '.join(classes)}" if classes else "it has no MoE experts"
        raise ConfigError(KEY, f"the patch splits fused experts of {', '.join(SUPPORTED)}; {what}",
                          "set fsdp.moe_expert_patch=false")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for path, fused in found:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, _per_expert(fused, config))
    return [p for p, _ in found]


Part = tuple[int, int, int]
"""(expert, first row, last row + 1): the slice ``fused[expert, first:last]``."""


def checkpoint_layout(model: nn.Module) -> dict[str, list[tuple[str, Part, tuple[int, ...]]]]:
    """Where fused expert parameters go in the original checkpoint layout, the one
    ``save_pretrained`` writes and transformers (and other engines) load: state-dict name
    of a fused parameter -> ``(per-expert name, part, shape)`` of each tensor cut from it.
    Empty for models without fused experts (or already split by the patch)."""
    out: dict[str, list[tuple[str, Part, tuple[int, ...]]]] = {}
    for path, mod in fused_experts_modules(model):
        num, two_i, hidden = mod.gate_up_proj.shape
        inter = two_i // 2
        out[f"{path}.gate_up_proj"] = [
            (f"{path}.{e}.{proj}.weight", (e, a, b), (b - a, hidden))
            for e in range(num) for proj, (a, b) in (("gate_proj", (0, inter)), ("up_proj", (inter, two_i)))]
        out[f"{path}.down_proj"] = [(f"{path}.{e}.down_proj.weight", (e, 0, hidden), (hidden, inter))
                                    for e in range(num)]
    return out
