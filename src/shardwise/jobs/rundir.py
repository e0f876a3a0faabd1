"""One job per run folder: a lock on ``<run.dir>/.shardwise.lock``.

A second job on the same ``run.dir`` would prune the first one's checkpoints, append to its
metrics and overwrite its export; it stops instead with a `ConfigError` on ``run.dir``
that names the holder (process id, host, command, start time).

The lock is an advisory ``flock`` held by the process that launched the job (the
`shardwise` command, or rank 0 under a torchrun the user started) for the whole run. The
operating system releases it when that process ends, however it ends, so a crashed job
never leaves a stale lock behind. Ranks started by a `shardwise` process that holds the
lock find its path in ``SHARDWISE_RUN_DIR_HELD`` and do not lock again.

The lock is per job, not per node. The launchers of a multi-node job (`shardwise train
--nnodes N`) share a run folder on a shared filesystem, or several "nodes" run on one
machine: each tries the lock with the job's key (its rendezvous endpoint and node count,
`shardwise.distributed.launch.Nodes.job`), the first holds it and writes the key beside its
process id, and a launcher that finds its own job's key there goes on without holding it.
A launcher of any other job (another endpoint, or none) stops with the ConfigError.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

from shardwise.errors import ConfigError

LOCK_FILE = ".shardwise.lock"
HELD_ENV = "SHARDWISE_RUN_DIR_HELD"
HOLDER_WAIT_S = 1.0
"""How long a refused launcher waits for the holder to write its details (it writes them
just after taking the lock: nodes of one job started together meet in that gap)."""

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking
    fcntl = None  # type: ignore[assignment]


class RunDirLock:
    """The lock of one run folder; `acquire` raises ConfigError when another job holds it.

    `job`: the key the nodes of a multi-node job share (None: a job of one node); a holder
    with the same key is this job's, and the lock counts as taken (`peer_holder`).
    """

    def __init__(self, run_dir: str | os.PathLike[str], command: str, job: str | None = None):
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / LOCK_FILE
        self.command = command
        self.job = job
        self.peer_holder: dict | None = None
        """The holder's details when another node of this job holds the lock."""
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
            self._refused(fd)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _refused(self, fd: int) -> None:
        """The lock is held: by this job's other node (return), or by another job (raise)."""
        holder = _read_holder(fd)
        if self.job is not None and holder.get("job") == self.job:
            self.peer_holder = holder
            return
        mine = f"; this job is the {self.job}" if self.job else ""
        nodes = ("; the lock is per job: the nodes of one job share it by naming the same rendezvous and --nnodes"
                 if self.job or holder.get("job") else "")
        raise ConfigError("run.dir", f"{str(self.run_dir)!r} is in use by another shardwise job "
                          f"({_describe_holder(holder)}{mine})",
                          f"wait for that job to end, or set run.dir to another folder{nodes}") from None

    def acquire(self) -> RunDirLock:
        if fcntl is None or self.held_by_launcher or self._fd is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                self._refused(fd)
            finally:
                os.close(fd)
            return self
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                "started": datetime.datetime.now().isoformat(timespec="seconds"), "job": self.job}
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


def _read_holder(fd: int) -> dict:
    """The holder's details ({} when unknown), waiting up to `HOLDER_WAIT_S` for a holder
    that has just taken the lock to write them."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            info = {}
        if info or time.monotonic() > deadline:
            return info if isinstance(info, dict) else {}
        time.sleep(0.05)


def _describe_holder(info: dict) -> str:
    if not info:
        return "holder unknown"
    text = f"pid {info.get('pid')} on {info.get('host')}, `{info.get('command')}`, started {info.get('started')}"
    return text + (f", the {info['job']}" if info.get("job") else "")


def command_line() -> str:
    """This process's command line, shortened, for the lock file."""
    text = " ".join(["shardwise", *sys.argv[1:]])
    return text if len(text) <= 200 else text[:197] + "..."


ERROR_FILE = "error.txt"
"""Where a failed run keeps the full report of its first failure (`write_error_file`)."""


def write_error_file(run_dir: str | os.PathLike[str], where: str, traceback_text: str,
                     command: str | None = None) -> Path | None:
    """``<run.dir>/error.txt``: when, where (the rank or worker), the command and the full
    traceback of a run's first failure, kept without ``--debug`` so the one-line message
    can name it. None when the folder is not there (an error before the run wrote
    anything) or cannot be written (a full disk)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return None
    text = (f"time:    {datetime.datetime.now().isoformat(timespec='seconds')}\n"
            f"where:   {where}\n"
            f"command: {command or ' '.join(['shardwise', *sys.argv[1:]])}\n\n{traceback_text.rstrip()}\n")
    try:
        (folder / ERROR_FILE).write_text(text)
    except OSError:
        return None
    return folder / ERROR_FILE
