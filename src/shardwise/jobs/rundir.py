"""One job per run folder: a lock on ``<run.dir>/.shardwise.lock``.

A second job on the same ``run.dir`` would prune the first one's checkpoints, append to its
metrics and overwrite its export; it stops instead with a `ConfigError` on ``run.dir``
that names the holder (process id, host, command, start time).

The lock is an advisory ``flock`` on the run folder itself (a descriptor of the directory),
held by the process that launched the job (the `shardwise` command, or rank 0 under a
torchrun the user started) for the whole run. The file ``.shardwise.lock`` only tells who
holds it: deleting that file used to free the lock (a second job then appended to the
first one's metrics), while the folder cannot be deleted or replaced under a running job
without ending the run anyway. A filesystem that refuses ``flock`` on a directory gets the
lock on the file, as before. The operating system releases the lock when that process
ends, however it ends, so a crashed job never leaves a stale lock behind. Ranks started by a `shardwise` process that holds the
lock find its path in ``SHARDWISE_RUN_DIR_HELD`` and do not lock again.

The lock is per job, not per node. The launchers of a multi-node job (`shardwise train
--nnodes N`) share a run folder on a shared filesystem, or several "nodes" run on one
machine: each tries the lock with the job's key (its rendezvous endpoint and node count,
`shardwise.distributed.nodes.Nodes.job`; hosts compared by address, so ``localhost`` and
``127.0.0.1`` are one), the first holds it and writes the key beside its process id, and a
launcher that finds its own job's key there goes on without holding it.
A launcher of any other job (another endpoint, or none) stops with the ConfigError.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from shardwise.distributed.nodes import same_job
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
    with the same key (`shardwise.distributed.nodes.same_job`: its rendezvous host may be
    named differently) is this job's, and the lock counts as taken (`peer_holder`).
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
        """Raise the ConfigError of `acquire` when another job holds the lock, or
        `check_run_dir`'s when the folder cannot be the run's; creates nothing (a quick look
        before the slower input checks)."""
        check_run_dir(self.run_dir)
        if fcntl is None or self.held_by_launcher or not self.run_dir.is_dir():
            return
        fd = _open_target(self.run_dir, self.path)
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refused()
        except OSError:
            pass
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _refused(self) -> None:
        """The lock is held: by this job's other node (return), or by another job (raise)."""
        holder = _read_holder(self.path)
        if same_job(holder.get("job"), self.job):
            self.peer_holder = holder
            return
        mine = f"; this job is the {self.job}" if self.job else ""
        nodes = ("; the lock is per job: the nodes of one job share it by naming the same rendezvous and --nnodes"
                 if self.job or holder.get("job") else "")
        raise ConfigError("run.dir", f"{str(self.run_dir)!r} is in use by another shardwise job "
                          f"({_describe_holder(holder, self.run_dir)}{mine})",
                          f"wait for that job to end, or set run.dir to another folder{nodes}") from None

    def acquire(self) -> RunDirLock:
        if fcntl is None or self.held_by_launcher or self._fd is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = _open_target(self.run_dir, self.path)
        assert lock_fd is not None  # the folder exists: only a folder we cannot open fails, and then the file opens
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            self._refused()
            return self
        except OSError:  # no flock here at all: run unlocked, as without fcntl
            os.close(lock_fd)
            return self
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                "started": datetime.datetime.now().isoformat(timespec="seconds"), "job": self.job}
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.close(fd)
        self._fd = lock_fd
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


def _open_target(run_dir: Path, lock_file: Path) -> int | None:
    """A descriptor to flock: the run folder's own (it survives the deletion of the
    lock file), or the lock file's where the filesystem cannot flock a directory (some
    network filesystems); None when neither opens."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: flock works on this folder
            return fd
        except OSError:
            os.close(fd)
            fd = None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return fd
    try:
        return os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None


def _read_holder(path: Path) -> dict:
    """The holder's details from the lock file ({} when unknown), waiting up to
    `HOLDER_WAIT_S` for a holder that has just taken the lock to write them."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            info = json.loads(path.read_bytes()[:4096].decode() or "{}")
        except (OSError, ValueError):
            info = {}
        if info or time.monotonic() > deadline:
            return info if isinstance(info, dict) else {}
        time.sleep(0.05)


def _lock_holder_pid(folder: Path) -> int | None:
    """The process holding a flock on `folder`, from /proc/locks (Linux; same machine)."""
    try:
        st = folder.stat()
        wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == wanted:
                return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


def _describe_holder(info: dict, folder: Path | None = None) -> str:
    if not info:
        pid = _lock_holder_pid(folder) if folder is not None else None
        if pid is None:
            return f"holder unknown: its {LOCK_FILE} is gone"
        try:
            cmd = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
        except OSError:
            cmd = "?"
        cmd = cmd if len(cmd) <= 200 else cmd[:197] + "..."
        return f"pid {pid} on {socket.gethostname()}, `{cmd}`; its {LOCK_FILE} is gone"
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
    except OSError:  # a full disk: no empty or partial file that claims to be the report
        with contextlib.suppress(OSError):
            (folder / ERROR_FILE).unlink()
        return None
    return folder / ERROR_FILE


RUN_FILES = {"metrics.jsonl": "file", "hf": "folder", "checkpoints": "folder", "config.json": "file"}
"""What a run writes into run.dir, and what each must be (`check_run_dir`)."""


def _probe_write(folder: Path) -> None:
    """Create and remove an empty file in `folder`: what `os.access` cannot see (a network
    filesystem that maps root to nobody, ACLs, a filesystem remounted read-only) fails
    here, not in the ranks."""
    try:
        fd, name = tempfile.mkstemp(prefix=".shardwise-probe-", dir=folder)
    except OSError as e:
        raise ConfigError("run.dir", f"{str(folder)!r} cannot be written ({e.strerror or e})",
                          "name a folder on a writable filesystem with free space") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


def check_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """ConfigError on ``run.dir`` before anything starts when the folder cannot hold a run:
    empty (the whole run would land in the working directory), a file, a symlink loop, not
    writable (by its permissions, or a read-only filesystem: `_probe_write`), or holding a file where the run writes a folder (``hf``) or the reverse
    (``metrics.jsonl``) — found only after training before."""
    text = str(run_dir).strip()
    if text in ("", "."):
        raise ConfigError("run.dir", "is empty: the run's files would be written into the working directory",
                          "name a folder, e.g. run.dir=runs/my_run")
    path = Path(run_dir)
    try:
        path.resolve(strict=False)
        exists = path.exists()
    except (RuntimeError, OSError) as e:  # a symlink loop, a name too long, ...
        raise ConfigError("run.dir", f"{text!r} cannot be used ({e})", "name a plain folder") from None
    if exists and not path.is_dir():
        raise ConfigError("run.dir", f"{text!r} is a file, not a folder", "name a folder (it is created if missing)")
    nearest = path if exists else next((p for p in path.parents if p.exists()), Path("."))
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError("run.dir", f"{str(nearest)!r} is not writable", "name a folder this user can write")
    _probe_write(nearest)
    for name, kind in RUN_FILES.items():
        p = path / name
        wrong = (kind == "file" and p.is_dir()) or (kind == "folder" and p.exists() and not p.is_dir())
        if wrong:
            raise ConfigError("run.dir", f"{str(p)!r} is a {'folder' if p.is_dir() else 'file'}, where the run "
                              f"writes its {name} {kind}", "move it away, or set run.dir to another folder")
