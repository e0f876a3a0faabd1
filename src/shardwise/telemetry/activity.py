"""What this process is doing, kept where a supervising parent can read it after a crash.

A process that runs user code (a reward function) can end without a word: ``os._exit(3)``
or a crash in a native library leaves no exception to report. `SharedRecord` is a page of
memory shared with the parent that forked this process (an anonymous ``mmap`` made before
the fork): the child writes its current activity there (`doing`) and, once it has printed
its own last line, the status it ends with (`SharedRecord.finish`); the parent reads it
after the child ended (`shardwise.jobs.supervisor`).

Without a record installed (`install`), `doing` costs one global lookup: nothing is written
in ranks under torchrun, Ray workers or in-process calls.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["SharedRecord", "doing", "install", "installed", "read_file"]

_SIZE = 4096
"""Bytes of the shared page; an activity is cut to `_TEXT_LIMIT` characters to fit."""
_TEXT_LIMIT = 1000


class SharedRecord:
    """A JSON object in a shared page (``MAP_SHARED``): anonymous, made by the parent before
    `os.fork`, written by the child, read by the parent once the child has ended; or, with
    `path`, a file's page (a rank under torchrun: its launcher reads the file, `read_file`,
    after the rank died; the kernel keeps what a dead process wrote to a mapped file)."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            self._map = mmap.mmap(-1, _SIZE)
        else:
            with open(path, "w+b") as f:
                f.truncate(_SIZE)
                self._map = mmap.mmap(f.fileno(), _SIZE)
        self._fields: dict[str, Any] = {}

    def update(self, **fields: Any) -> None:
        self._fields.update(fields)
        data = json.dumps(self._fields).encode()
        if len(data) >= _SIZE:  # cannot happen with the texts cut below; never a torn object
            data = json.dumps({k: v for k, v in self._fields.items() if k != "doing"}).encode()
        self._map[:len(data) + 1] = data + b"\0"

    def finish(self, status: int | None) -> None:
        """The child has said how it ends (its last line is printed); `status` is the exit
        status it chose (None: the interpreter's, for an uncaught exception it prints)."""
        self.update(said=True, status=status)

    def read(self) -> dict[str, Any]:
        return _parse(self._map[:])


def _parse(page: bytes) -> dict[str, Any]:
    raw = page.split(b"\0", 1)[0]
    try:
        return json.loads(raw) if raw else {}
    except ValueError:  # written while the process died: nothing reliable in it
        return {}


def read_file(path: str) -> dict[str, Any]:
    """The record a process kept in the file `path` ({} when there is none)."""
    try:
        with open(path, "rb") as f:
            return _parse(f.read(_SIZE))
    except OSError:
        return {}


_record: SharedRecord | None = None


def install(record: SharedRecord | None) -> None:
    """`doing` writes into `record` from now on (None: nowhere)."""
    global _record
    _record = record


def installed() -> SharedRecord | None:
    return _record


@contextmanager
def doing(text: str) -> Iterator[None]:
    """`text` (e.g. ``reward function mod.fn on row 3 (prompt '1+2=')``) is this process's
    activity for the block; the previous one is put back after it."""
    record = _record
    if record is None:
        yield
        return
    before = record._fields.get("doing")
    record.update(doing=text if len(text) <= _TEXT_LIMIT else text[:_TEXT_LIMIT] + "...")
    try:
        yield
    finally:
        record.update(doing=before)
