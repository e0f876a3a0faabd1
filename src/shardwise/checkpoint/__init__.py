"""Checkpoints: DCP save / commit / resume of training state (`shardwise.checkpoint.dcp`).

Names are imported on first use, so importing this package does not load DCP.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointManager", "is_complete", "read_meta", "step_dir_name"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shardwise.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
