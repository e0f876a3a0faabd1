"""Checkpoints: DCP save / commit / verify / resume of training state
(`shardwise.checkpoint.dcp`), the best one by an evaluation metric
(`shardwise.checkpoint.best`), and the HF export (`shardwise.checkpoint.hf_export`)."""

from shardwise.checkpoint.dcp import (
    CheckpointManager,
    is_complete,
    read_meta,
    step_dir_name,
)

__all__ = ["CheckpointManager", "is_complete", "read_meta", "step_dir_name"]
