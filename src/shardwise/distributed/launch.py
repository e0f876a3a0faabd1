"""Starting, watching and stopping the processes of one job.

Two sides of one contract:

- The launching side (`launch_torchrun`, in the `shardwise` process the user started):
  runs torchrun (through `shardwise.distributed.torchrun`, which keeps torchrun's own
  failure report off the terminal) with an error folder in ``SHARDWISE_ERROR_DIR``.
  SIGINT / SIGTERM are forwarded to torchrun, which stops every rank; whatever is still
  alive after `GRACE_S` seconds is killed. When the ranks are gone it reads the error
  folder and prints ONE line for the first failure: a user error (`ShardwiseError`,
  exit status 2) before any other, else the earliest one (exit status 1); the rest are
  usually peers that lost the failed rank.
- The rank side (`die_with_parent`, `record_failure`, `exit_after_failure`): a rank
  dies with its parent (a parent-death signal plus a watchdog thread, so kill -9 of
  torchrun or of the `shardwise` process leaves nothing running); a rank that raises
  writes its error (type, message, traceback) to the error folder and leaves at once,
  without a teardown barrier: its peers' collectives then fail, and torchrun ends them.

The error folder holds our own JSON files, never pickles.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from shardwise.distributed.runtime import free_port
from shardwise.errors import ShardwiseError

ERROR_DIR_ENV = "SHARDWISE_ERROR_DIR"
"""Folder where each failing rank writes ``rank<r>.json`` (set by `launch_torchrun`)."""
DEBUG_ENV = "SHARDWISE_DEBUG"
"""'1': ranks and launcher print full tracebacks (the CLI's ``--debug``)."""
LAUNCHER_FILE = "launcher.json"
"""Written by the torchrun wrapper when a rank ended without writing its own file."""

GRACE_S = 20.0
"""After forwarding SIGINT / SIGTERM, how long torchrun gets to stop the ranks."""
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def describe_exit(code: int) -> str:
    """A process's exit status in words (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# ----------------------------------------------------------------------- rank side


_PR_SET_PDEATHSIG = 1


def die_with_parent(poll_s: float = 1.0) -> None:
    """End this process when its parent ends (Linux: a parent-death SIGKILL; elsewhere and
    as a fallback, a daemon thread that exits when the parent process id changes)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent or parent == 1:  # the parent was already gone
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="shardwise-parent-watch", daemon=True).start()


@dataclass(frozen=True)
class Failure:
    """One rank's error, as written to the error folder."""

    rank: int | None
    type: str
    message: str
    user: bool
    """A `ShardwiseError`: the user's input was wrong (exit status 2)."""
    traceback: str
    time: float

    def line(self) -> str:
        """The one line the user sees."""
        if self.user:
            return self.message
        where = f"rank {self.rank}" if self.rank is not None else "a process"
        return f"{where} failed: {self.type}: {self.message}"


def failure_of(exc: BaseException, rank: int | None) -> Failure:
    message = " ".join(str(exc).split()) or type(exc).__name__
    return Failure(rank=rank, type=type(exc).__name__, message=message, user=isinstance(exc, ShardwiseError),
                   traceback="".join(traceback.format_exception(exc)), time=time.time())


def record_failure(exc: BaseException, rank: int | None) -> bool:
    """Write `exc` to the launcher's error folder; False when there is none (no launcher)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    f = failure_of(exc, rank)
    path = Path(folder) / f"rank{rank if rank is not None else 'x'}.json"
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(f.__dict__))
        os.replace(tmp, path)
        return True
    return False


def rank_failed(exc: BaseException) -> NoReturn:
    """End a rank (under torchrun) that raised `exc`.

    A KeyboardInterrupt is the launcher stopping the job (it says so itself): exit 130
    quietly. Otherwise the error goes to the launcher's error folder, which prints one line
    for the whole job; without a launcher (a torchrun the user started) the rank prints the
    line itself, or the traceback for an error that is not the user's. With
    ``SHARDWISE_DEBUG=1`` the traceback is printed as well.
    """
    if isinstance(exc, KeyboardInterrupt):
        exit_after_failure(130)
    rank = int(os.environ.get("RANK", "0"))
    user = isinstance(exc, ShardwiseError)
    recorded = record_failure(exc, rank)
    if debug_enabled() or (not recorded and not user):
        traceback.print_exception(exc)
    elif not recorded:
        print(f"shardwise: [rank {rank}] {failure_of(exc, rank).message}", file=sys.stderr)
    exit_after_failure(EXIT_USER_ERROR if user else 1)


def exit_after_failure(code: int) -> NoReturn:
    """Leave now: no teardown barrier (the peers are not coming), no atexit handlers that
    could wait on a collective. The peers' collectives fail and torchrun ends them."""
    leave(code)


def leave(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process with `code`, skipping the interpreter's
    shutdown (atexit handlers, module teardown, C++ static destructors)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ------------------------------------------------------------------- launching side


def read_failures(folder: str | os.PathLike[str]) -> list[Failure]:
    out = []
    for p in sorted(Path(folder).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            out.append(Failure(**json.loads(p.read_text())))
    return out


def first_failure(failures: Sequence[Failure]) -> Failure | None:
    """The failure to report: the earliest user error, else the earliest of all."""
    if not failures:
        return None
    user = [f for f in failures if f.user]
    return min(user or failures, key=lambda f: f.time)


def _descendants(pid: int) -> list[int]:
    """Process ids under `pid` (Linux /proc), deepest last; [] elsewhere."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), ()):
            out.append(c)
            stack.append(c)
    return out


def _kill_all(pids: Sequence[int]) -> None:
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


@dataclass
class LaunchResult:
    returncode: int
    failure: Failure | None
    interrupted: signal.Signals | None


def launch_torchrun(nproc: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
                    grace_s: float = GRACE_S, module: str = "shardwise.cli") -> LaunchResult:
    """Run ``python -m <module> <argv>`` (``shardwise <argv>``) in `nproc` local processes
    under torchrun and wait.

    Signals SIGINT / SIGTERM received meanwhile are forwarded; a second one, or `grace_s`
    seconds without the ranks ending, kills the whole tree. Returns the exit status, the
    failure to report (see the module docstring) and the signal that interrupted the run.
    """
    error_dir = tempfile.mkdtemp(prefix="shardwise-errors-")
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env[ERROR_DIR_ENV] = error_dir
    cmd = [sys.executable, "-m", "shardwise.distributed.torchrun", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--monitor-interval=0.2",
           "-m", module, *argv]
    interrupted: list[tuple[signal.Signals, float]] = []  # (signal, monotonic time received)
    # A session of its own: a Ctrl-C in the terminal reaches this process alone, which
    # stops the job through torchrun (one signal, one path).
    proc = subprocess.Popen(cmd, env=child_env, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        sig = signal.Signals(signum)
        interrupted.append((sig, time.monotonic()))
        if len(interrupted) > 1:  # asked twice: stop waiting
            _kill_all([*_descendants(proc.pid), proc.pid])
            return
        with contextlib.suppress(OSError):
            # SIGTERM either way: torchrun passes the signal it got on to the ranks, and
            # SIGTERM ends them without a KeyboardInterrupt traceback from each.
            proc.send_signal(signal.SIGTERM)

    previous: dict[int, Callable | int | None] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if interrupted and time.monotonic() - interrupted[0][1] > grace_s:
                _kill_all([*_descendants(proc.pid), proc.pid])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _kill_all(_descendants(proc.pid))  # nothing of this job outlives it
    failure = first_failure(read_failures(error_dir))
    with contextlib.suppress(OSError):
        for p in Path(error_dir).iterdir():
            p.unlink()
        os.rmdir(error_dir)
    if failure is not None and failure.user and not interrupted:
        code = EXIT_USER_ERROR
    return LaunchResult(returncode=code, failure=failure, interrupted=interrupted[0][0] if interrupted else None)
