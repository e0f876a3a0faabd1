"""Names of a run's checkpoint folders, the test of a complete one and the latest complete
one (shared by `shardwise.checkpoint.dcp`, which writes them, `shardwise.checkpoint.best`,
and the lines that say where a stopped run resumes from, which need no torch)."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["CHECKPOINTS_DIR", "COMMITTED", "DCP_METADATA", "META_FILE", "complete_steps", "is_complete", "resume_line",
           "step_dir_name"]

CHECKPOINTS_DIR = "checkpoints"
COMMITTED = "COMMITTED"
META_FILE = "meta.json"
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """``step_00000004``: zero-padded so that names sort like steps."""
    assert step >= 0, step
    return f"step_{step:08d}"


def is_complete(path: str | os.PathLike[str]) -> bool:
    """A committed checkpoint folder: COMMITTED, meta.json and DCP's .metadata all present."""
    p = Path(path)
    return p.is_dir() and all((p / name).is_file() for name in (COMMITTED, META_FILE, DCP_METADATA))


def complete_steps(checkpoints: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoints in the folder `checkpoints` (a run's ``checkpoints/``) as
    (step, folder), lowest step first."""
    folder = Path(checkpoints)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = STEP_DIR.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def resume_line(run_dir: str | os.PathLike[str]) -> str:
    """Where a stopped run in `run_dir` can resume from, in words (for the line that says it stopped)."""
    found = complete_steps(Path(run_dir) / CHECKPOINTS_DIR)
    if not found:
        return "no checkpoint was committed yet"
    return f"the last committed checkpoint is {found[-1][1]} (the same command resumes from it)"
