"""Disk space and the one-line words for a failed write, shared by the checkpoints
(`shardwise.checkpoint.dcp`), the HF export (`shardwise.checkpoint.hf_export`) and the
evaluation samples: is an error a full disk, how much is free, sizes in words (the last two
live in `shardwise.errors`, below the engine, whose evaluation samples need them too)."""

from __future__ import annotations

import errno
from pathlib import Path

from shardwise.errors import free_bytes, human_bytes  # the evaluation samples' full-disk line uses them too

__all__ = ["folder_bytes", "free_bytes", "human_bytes", "nearly_full", "out_of_space", "short_error"]


def short_error(exc: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def out_of_space(exc: BaseException | None) -> bool:
    """`exc` (or what it wraps: DCP gathers the ranks' errors) says the disk is full."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(exc):
            return True
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for inner in failures.values():
                inner = inner[0] if isinstance(inner, tuple) else inner
                if isinstance(inner, BaseException) and out_of_space(inner):
                    return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


_NEARLY_FULL = 1 << 20
"""Less free space than this after a failed write: the disk filled up (torch's zip writer
reports a full disk as "unexpected pos", without ENOSPC)."""


def nearly_full(folder: Path) -> bool:
    free = free_bytes(folder)
    return free is not None and free < _NEARLY_FULL


def folder_bytes(folder: Path | None) -> int:
    if folder is None or not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
