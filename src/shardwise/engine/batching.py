"""Batch-size arithmetic shared by every job: global = micro x grad_accum x dp_size."""

from __future__ import annotations

from shardwise.config.schema import TrainConfig
from shardwise.errors import ConfigError


def check_batch_sizes(train: TrainConfig, dp_size: int) -> int:
    """Gradient-accumulation steps per optimizer step; ConfigError if sizes do not fit."""
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step:
        lo = max(per_step, train.global_batch_size // per_step * per_step)
        raise ConfigError(
            "train.global_batch_size",
            f"{train.global_batch_size} is not a multiple of micro_batch_size x data-parallel size "
            f"({train.micro_batch_size} x {dp_size} = {per_step})",
            f"try {lo} or {lo + per_step}",
        )
    return train.global_batch_size // per_step
