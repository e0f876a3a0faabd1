"""One job per run folder: a lock on ``<run.dir>/.shardwise.lock``.

A second job on the same ``run.dir`` would prune the first one's checkpoints, append to its
metrics and overwrite its export; it stops instead with a `ConfigError` on ``run.dir``
that names the holder (process id, host, command, start time).

The lock is an advisory ``flock`` held by the process that launched the job (the
`shardwise` command, or rank 0 under a torchrun the user started) for the whole run. The
operating system releases it when that process ends, however it ends, so a crashed job
never leaves a stale lock behind. Ranks started by a `shardwise` process that holds the
lock find its path in ``SHARDWISE_RUN_DIR_HELD`` and do not lock again.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from pathlib import Path

from shardwise.errors import ConfigError

LOCK_FILE = ".shardwise.lock"
HELD_ENV = "SHARDWISE_RUN_DIR_HELD"

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking
    fcntl = None  # type: ignore[assignment]


class RunDirLock:
    """The lock of one run folder; `acquire` raises ConfigError when another job holds it."""

    def __init__(self, run_dir: str | os.PathLike[str], command: str):
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / LOCK_FILE
        self.command = command
        self._fd: int | None = None

    @property
    def held_by_launcher(self) -> bool:
        """This process's launcher already holds the lock of this folder."""
        return os.environ.get(HELD_ENV) == str(self.run_dir)

    def check_free(self) -> None:
        """Raise the ConfigError of `acquire` when another job holds the lock; creates
        nothing (a quick look before the slower input checks)."""
        if fcntl is None or self.held_by_launcher or not self.path.is_file():
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise self._in_use(fd) from None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _in_use(self, fd: int) -> ConfigError:
        return ConfigError("run.dir", f"{str(self.run_dir)!r} is in use by another shardwise job "
                           f"({_read_holder(fd)})", "wait for that job to end, or set run.dir to another folder")

    def acquire(self) -> RunDirLock:
        if fcntl is None or self.held_by_launcher or self._fd is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            err = self._in_use(fd)
            os.close(fd)
            raise err from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def child_env(self) -> dict[str, str]:
        """What the ranks of a job launched under this lock need to know."""
        return {HELD_ENV: str(self.run_dir)}

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "holder unknown"
    return f"pid {info.get('pid')} on {info.get('host')}, `{info.get('command')}`, started {info.get('started')}"


def command_line() -> str:
    """This process's command line, shortened, for the lock file."""
    text = " ".join(["shardwise", *sys.argv[1:]])
    return text if len(text) <= 200 else text[:197] + "..."
