"""Names of a run's checkpoint folders and the test of a complete one (shared by
`shardwise.checkpoint.dcp`, which writes them, and `shardwise.checkpoint.best`)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CHECKPOINTS_DIR", "COMMITTED", "DCP_METADATA", "META_FILE", "is_complete", "step_dir_name"]

CHECKPOINTS_DIR = "checkpoints"
COMMITTED = "COMMITTED"
META_FILE = "meta.json"
DCP_METADATA = ".metadata"


def step_dir_name(step: int) -> str:
    """``step_00000004``: zero-padded so that names sort like steps."""
    assert step >= 0, step
    return f"step_{step:08d}"


def is_complete(path: str | os.PathLike[str]) -> bool:
    """A committed checkpoint folder: COMMITTED, meta.json and DCP's .metadata all present."""
    p = Path(path)
    return p.is_dir() and all((p / name).is_file() for name in (COMMITTED, META_FILE, DCP_METADATA))
