"""Integrity of a checkpoint folder: the SHA-256 digests COMMITTED records, and the check
against them (`verify_checkpoint`) that resuming and the launching process run. Reads files
only (no process group)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from shardwise.checkpoint.disk import short_error
from shardwise.checkpoint.layout import COMMITTED, DCP_METADATA, META_FILE, is_complete
from shardwise.checkpoint.safe_load import metadata_problem

__all__ = ["HASH_CHUNK_BYTES", "file_digest", "folder_files", "incomplete_reason", "own_files", "read_committed",
           "read_meta", "verify_checkpoint"]

HASH_CHUNK_BYTES = 8 << 20
"""Files are hashed in reads of this many bytes (8 MiB)."""


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """meta.json of a checkpoint folder."""
    return json.loads((Path(path) / META_FILE).read_text())



def file_digest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of one file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def own_files(folder: Path, rank: int, is_main: bool) -> list[Path]:
    """The files of a checkpoint folder that `rank` wrote itself."""
    files = sorted(folder.glob(f"__{rank}_*.distcp"))
    files += [folder / f"rng_rank{rank}.safetensors", folder / f"rng_rank{rank}.json"]
    if is_main:
        files += [folder / DCP_METADATA, folder / META_FILE]
    return [f for f in files if f.is_file()]


def folder_files(folder: Path) -> list[str]:
    """Relative (posix) names of every file in `folder` but COMMITTED, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() != COMMITTED)


def read_committed(p: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(COMMITTED as a dict, None) or (None, problem). An empty marker is ``{}``."""
    try:
        text = (p / COMMITTED).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{COMMITTED} cannot be read ({short_error(exc)})"
    if not text.strip():
        return {}, None
    try:
        marker = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"{COMMITTED} is not valid JSON ({short_error(exc)})"
    if not isinstance(marker, dict) or not isinstance(marker.get("files", {}), dict):
        return None, f"{COMMITTED} is not a JSON object with a 'files' mapping"
    return marker, None


def verify_checkpoint(path: str | os.PathLike[str], ranks: tuple[int, int] = (0, 1),
                      digests: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder: missing files, sizes or SHA-256 digests that
    differ from those COMMITTED records, meta.json or COMMITTED that are not JSON, a DCP
    ``.metadata`` that the restricted unpickler refuses (`metadata_problem`: a crafted
    pickle is found here, before any rank hands it to DCP). Empty when intact. Reads files
    only (no process group). ``digests=False`` compares sizes only: the quick look the
    launching process takes before launch (the ranks hash the files when they load).

    ``ranks=(rank, world)`` checks the share of this rank: file i of the sorted list in
    COMMITTED when ``i % world == rank``; the structural checks (is_complete, the JSON of
    meta.json and COMMITTED) belong to rank 0. The union over the ranks is the whole check.
    A COMMITTED without "files" (empty, or from before checksums) passes on the structural
    checks alone.
    """
    p = Path(path)
    rank, world = ranks
    assert 0 <= rank < world, ranks
    if not is_complete(p):
        return [f"it {incomplete_reason(p)}"] if rank == 0 else []
    problems = []
    marker, problem = read_committed(p)
    if problem is not None:
        return [problem] if rank == 0 else []
    if rank == 0:
        try:
            meta = read_meta(p)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            problems.append(f"{META_FILE} cannot be read ({short_error(exc)})")
        else:
            if not isinstance(meta, dict):
                problems.append(f"{META_FILE} is not a JSON object")
        problem = metadata_problem(p)
        if problem is not None:
            problems.append(problem)
    files = marker.get("files")
    if files is None:
        return problems
    for i, name in enumerate(sorted(files)):
        if i % world != rank:
            continue
        want, f = files[name], p / name
        if not f.is_file():
            problems.append(f"missing file {name}")
            continue
        size = f.stat().st_size
        if size != want.get("bytes"):
            problems.append(f"{name} has {size} bytes, COMMITTED says {want.get('bytes')}")
        elif digests and file_digest(f)["sha256"] != want.get("sha256"):
            problems.append(f"{name} fails its sha256 checksum")
    return problems


def incomplete_reason(p: Path) -> str:
    if not p.exists():
        return "does not exist"
    if not p.is_dir():
        return "is not a folder"
    missing = [n for n in (DCP_METADATA, META_FILE, COMMITTED) if not (p / n).is_file()]
    if missing == [COMMITTED]:
        return "has no COMMITTED marker (a save that did not finish)"
    return "is not a shardwise checkpoint (missing " + ", ".join(missing) + ")"
