"""AdamW and the LR schedules (constant / linear / cosine, each with linear warmup)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.schema import OptimizerConfig, SchedulerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, with torch's fused kernel (one kernel for all
    parameters of a device and dtype) where the parameters live on CUDA, else its foreach
    kernels; ``optimizer.fused`` forces either. Fused and foreach compute the same update
    up to the rounding of their fused arithmetic."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = cfg.fused
    if fused is None:
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
    # A multi-tensor kernel takes sharded (DTensor) or plain parameters, not both: FSDP's
    # ignored modules keep plain ones, so they get a parameter group of their own.
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (sharded, plain) if g] if sharded and plain else params
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=fused, foreach=None if fused else True)


def lr_factor(step: int, cfg: SchedulerConfig, total_steps: int) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based).

    Warmup: (step + 1) / warmup_steps for the first warmup_steps steps. Then `progress`
    runs from 0 to 1 over the remaining steps: constant 1; linear 1 -> min_lr_ratio;
    cosine 1 -> min_lr_ratio along half a cosine.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    lo = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "linear":
        return 1.0 - (1.0 - lo) * progress
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))
