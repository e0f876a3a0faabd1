"""Disk space and the one-line words for a failed write, shared by the checkpoints
(`shardwise.checkpoint.dcp`), the HF export (`shardwise.checkpoint.hf_export`) and the
evaluation samples: is an error a full disk, how much is free, sizes in words."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

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


def free_bytes(folder: Path) -> int | None:
    for p in (folder, *folder.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def folder_bytes(folder: Path | None) -> int:
    if folder is None or not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
