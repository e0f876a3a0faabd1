"""Starting, watching and stopping the processes of one job.

Two sides of one contract:

- The launching side (`launch_torchrun`, in the `shardwise` process the user started):
  runs torchrun (through `shardwise.distributed.torchrun`, which keeps torchrun's own
  failure report off the terminal) with an error folder in ``SHARDWISE_ERROR_DIR``.
  SIGINT / SIGTERM are forwarded to torchrun, which stops every rank; whatever is still
  alive after `GRACE_S` seconds is killed. When the ranks are gone it reads the error
  folder and prints ONE line for the first failure: a user error (`ShardwiseError`,
  exit status 2) before any other, else the earliest one (exit status 1); the rest are
  usually peers that lost the failed rank. On one machine without a GPU (`fork_ranks`),
  the wrapper is a fork of the launching process (`Zygote`) and the ranks are its forks.
- The rank side (`die_with_parent`, `record_failure`, `exit_after_failure`): a rank
  dies with its parent (a parent-death signal plus a watchdog thread, so kill -9 of
  torchrun or of the `shardwise` process leaves nothing running); a rank that raises
  writes its error (type, message, traceback) to the error folder and leaves at once,
  without a teardown barrier: its peers' collectives then fail, and torchrun ends them.

A job on several machines (`Nodes`) runs one launcher per node, each with its own error
folder. torchrun knows only its own node's ranks, so the contract crosses nodes through
the job's rendezvous store (the TCP store every rank of the job reaches at
MASTER_ADDR:MASTER_PORT): a rank whose error is its own writes it there first
(`FAILURE_KEY`); a rank whose error is only the loss of a peer (a gloo connection closed:
`is_peer_loss`) reads it from there, so the launcher of every node prints the line of the
node that failed first ("the job failed on node 1: rank 1 failed: ..."). When the store
is gone with that node (kill -9 of the node hosting it), the line says that the rank
lost a peer on another node. `Nodes`, the multi-node flags and the rendezvous bound live
in `shardwise.distributed.nodes`.

The error folder holds our own JSON files, never pickles.
"""

from __future__ import annotations

import atexit
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from shardwise.contained import descendants, describe_exit
from shardwise.distributed.nodes import Nodes
from shardwise.distributed.runtime import free_port
from shardwise.errors import ShardwiseError, as_disk_full
from shardwise.telemetry import activity

ERROR_DIR_ENV = "SHARDWISE_ERROR_DIR"
"""Folder where each failing rank writes ``rank<r>.json`` (set by `launch_torchrun`)."""
DEBUG_ENV = "SHARDWISE_DEBUG"
"""'1': ranks and launcher print full tracebacks (the CLI's ``--debug``)."""
LAUNCHER_FILE = "launcher.json"
"""Written by the torchrun wrapper when its rendezvous failed (no rank started); a rank that
ended without writing its own file is described in ``launcher-rank<r>.json``."""

GRACE_S = 20.0
"""After forwarding SIGINT / SIGTERM, how long torchrun gets to stop the ranks."""
RENDEZVOUS_FAILED = "RendezvousFailed"
"""`Failure.type` of a node whose torchrun could not meet the job's other nodes."""
FAILURE_KEY = "shardwise/first_failure"
"""Key of the job's first failure in the rendezvous store (a multi-node job)."""
STORE_TIMEOUT_S = 2.0
"""How long a failing rank spends on the rendezvous store (connect, then read or write): it
is on its way out, and the store may have gone with a failed node."""
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "got 0 bytes",
             "remote worker crashing")
"""Words of the errors a rank gets when another process of the job ended under it (gloo's
pair.cc, the c10d store's socket): a consequence, never the cause."""
FORK_RANKS_ENV = "SHARDWISE_FORK_RANKS"
"""Set by `launch_torchrun` for the torchrun wrapper whose ranks it forks (`fork_ranks`):
the modules, comma-separated, the wrapper imports before it forks them."""
RDZV_SINCE_ENV = "SHARDWISE_RDZV_SINCE"
"""Set by `launch_torchrun` for a multi-node job's torchrun wrapper: when it was started
(`time.monotonic()`, CLOCK_MONOTONIC, the same clock in every process of the machine), so
that ``--rdzv-timeout`` counts from there, the wrapper's own start (a fresh interpreter
importing torch: 5-20 s on a loaded machine) included."""
FRESH_RANKS_ENV = "SHARDWISE_FRESH_RANKS"
"""'1': every rank is a fresh interpreter, also where `fork_ranks` would fork them."""
RANK_PRELOAD = {"shardwise.cli": ("shardwise.cli", "shardwise.jobs.commands")}
"""What a forked rank of ``-m <module>`` finds imported (the module itself otherwise): for
`shardwise train` and `shardwise infer`, torch, transformers and the jobs."""
CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
SAVED_CPP_LOG_ENV = "SHARDWISE_SAVED_TORCH_CPP_LOG_LEVEL"
"""The ranks' own TORCH_CPP_LOG_LEVEL ('' for none), while the torchrun wrapper runs with
FATAL: c10d's C++ logs of a store it cannot reach (an error with a C++ stack, each retry)
stay off the terminal; the wrapper gives the ranks theirs back."""
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


def under_torchrun() -> bool:
    """This process is a rank that torchrun started (its environment names RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def local_gpus() -> int:
    """GPUs this machine shows (``CUDA_VISIBLE_DEVICES``, else the ``/dev/nvidiaN`` device
    files), without initialising CUDA in the controller (its forked ranks could not)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return sum(1 for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
    except OSError:
        return 0


def fork_ranks(nodes: Nodes | None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun forks this job's ranks from its own process, which imported the
    ranks' code once (`RANK_PRELOAD`), rather than starting a fresh interpreter per rank that
    imports torch, transformers and the jobs again (seconds of CPU each): on one machine
    without a GPU (`local_gpus`, as ``rl.backend: auto`` decides), unless
    ``SHARDWISE_FRESH_RANKS=1``. A machine with GPUs keeps fresh ranks (a process that
    forks must not have touched CUDA, and what an import does there is not checked here);
    so does a multi-node job, whose torchrun logs C++ at FATAL while it waits for the other
    nodes (`SAVED_CPP_LOG_ENV`) and gives fresh ranks their own level."""
    return nodes is None and env.get(FRESH_RANKS_ENV) != "1" and not local_gpus()


# ----------------------------------------------------------------------- rank side


_PR_SET_PDEATHSIG = 1


def die_with_parent(poll_s: float = 1.0) -> None:
    """End this process when its parent ends (Linux: a parent-death SIGKILL; elsewhere and
    as a fallback, a daemon thread that exits when the parent process id changes). Once per
    process and parent: the zygote that becomes torchrun's wrapper asked already."""
    global _watching
    parent = os.getppid()
    if _watching == (os.getpid(), parent):
        return
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
    _watching = (os.getpid(), parent)


_watching: tuple[int, int] | None = None
"""(process, parent) for which `die_with_parent` runs its watch."""


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
    peer: bool = False
    """The rank lost a peer (`is_peer_loss`): a consequence of another process ending."""
    node: int | None = None
    """The node (torchrun's GROUP_RANK) the rank ran on."""
    nodes: int = 1
    """How many nodes the job had."""
    remote: bool = False
    """Read from the rendezvous store by a rank of another node: the job's first failure."""
    exit_status: int = EXIT_USER_ERROR
    """A user error's exit status (`ShardwiseError.exit_status`: 2, or e.g. 74 for a full disk)."""

    def line(self) -> str:
        """The one line the user sees."""
        if self.user or self.type == RENDEZVOUS_FAILED:
            text = self.message
        elif self.peer:
            lost = next((w for w in PEER_LOSS if w in self.message), self.type)
            text = (f"the job failed on another node: rank {self.rank} lost a peer ({lost}); that node's output names "
                    "the cause" if self.nodes > 1 else
                    f"rank {self.rank} lost a peer ({lost}): another process of the job ended first")
        else:
            where = f"rank {self.rank}" if self.rank is not None else "a process"
            text = f"{where} failed: {self.type}: {self.message}"
        return f"the job failed on node {self.node}: {text}" if self.remote else text


def is_peer_loss(exc: BaseException) -> bool:
    """`exc` says only that another process of the job is gone (`PEER_LOSS`)."""
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in PEER_LOSS)


def failure_of(exc: BaseException, rank: int | None) -> Failure:
    message = " ".join(str(exc).split()) or type(exc).__name__
    node = os.environ.get("GROUP_RANK")
    return Failure(rank=rank, type=type(exc).__name__, message=message, user=isinstance(exc, ShardwiseError),
                   exit_status=getattr(exc, "exit_status", EXIT_USER_ERROR) if isinstance(exc, ShardwiseError) else 1,
                   traceback="".join(traceback.format_exception(exc)), time=time.time(), peer=is_peer_loss(exc),
                   node=int(node) if node and node.isdigit() else None,
                   nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1))


def _job_store():
    """A client of the job's rendezvous store (torchrun's, at MASTER_ADDR:MASTER_PORT), or
    None when it cannot be reached within `STORE_TIMEOUT_S`."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                             wait_for_workers=False)
    except Exception:  # noqa: BLE001 - the store went with its node: nothing to share
        return None


@contextlib.contextmanager
def _quiet_cpp_logs() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null meanwhile (not with ``--debug``): c10d logs a
    store that is gone from C++, with a stack, and this rank is on its way out anyway."""
    if debug_enabled():
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def share_failure(f: Failure) -> Failure:
    """Across the nodes of a job: publish this rank's own failure as the job's first (the
    first to publish wins), or, for a peer loss, adopt the first failure of another node
    (`remote`). `f` as it is on a single node, or when the store is unreachable."""
    if f.nodes <= 1:
        return f
    with _quiet_cpp_logs():
        store = _job_store()
        if store is None:
            return f
        try:
            if not f.peer:
                store.compare_set(FAILURE_KEY, "", json.dumps(f.__dict__))
                return f
            store.wait([FAILURE_KEY], timedelta(seconds=STORE_TIMEOUT_S))
            first = Failure(**json.loads(store.get(FAILURE_KEY)))
        except Exception:  # noqa: BLE001 - no failure published, or the store is gone
            return f
    return replace(first, remote=True) if first.node != f.node else f


def record_failure(exc: BaseException, rank: int | None) -> bool:
    """Write `exc` to the launcher's error folder (`share_failure`d first); False when there
    is none (no launcher)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    f = share_failure(failure_of(exc, rank))
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
    exc = as_disk_full(exc)
    rank = int(os.environ.get("RANK", "0"))
    user = isinstance(exc, ShardwiseError)
    recorded = record_failure(exc, rank)
    if debug_enabled() or (not recorded and not user):
        traceback.print_exception(exc)
    elif not recorded:
        print(f"shardwise: [rank {rank}] {failure_of(exc, rank).message}", file=sys.stderr)
    exit_after_failure(exc.exit_status if user else 1)


def exit_after_failure(code: int) -> NoReturn:
    """Leave now: no teardown barrier (the peers are not coming), no atexit handlers that
    could wait on a collective. The peers' collectives fail and torchrun ends them."""
    leave(code)


def end_process(code: int) -> NoReturn:
    """End a command's process with `code` as the interpreter's exit ends it (its atexit
    handlers run: logging flushed, Ray shut down, temporary folders removed; stdout and
    stderr flushed), without the teardown that follows them. In a process that imported
    torch that teardown is 1.4-1.8 s of CPU (torch deregisters its ~175 operator libraries
    one by one), at the end of every command. While a thread that is not a daemon still
    runs, the interpreter's own exit, which waits for it, is kept."""
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter's exit runs; os._exit skips it
    leave(code)


def leave(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process with `code`, skipping the interpreter's
    shutdown (atexit handlers, module teardown, C++ static destructors)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ------------------------------------------------------------------- launching side


def activity_file(rank: int) -> str:
    """The file of the error folder where rank `rank` keeps its activity
    (`shardwise.telemetry.activity`: the reward function and row it is in)."""
    return f"activity-rank{rank}.bin"


def record_activity() -> None:
    """This rank's activity goes to its file in the launcher's error folder: a rank that ends
    without a word (user code calling os._exit, a crash) is reported with what it was doing."""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK", "")
    if folder and rank.isdigit() and os.path.isdir(folder):
        with contextlib.suppress(OSError):
            activity.install(activity.SharedRecord(os.path.join(folder, activity_file(int(rank)))))


def read_failures(folder: str | os.PathLike[str]) -> list[Failure]:
    out = []
    for p in sorted(Path(folder).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            out.append(Failure(**json.loads(p.read_text())))
    return out


def first_failure(failures: Sequence[Failure]) -> Failure | None:
    """The failure to report: a cause before a lost peer (`Failure.peer`); among those the
    earliest user error, else the earliest of all."""
    if not failures:
        return None
    causes = [f for f in failures if not f.peer] or list(failures)
    user = [f for f in causes if f.user]
    return min(user or causes, key=lambda f: f.time)


def kill_tree(pid: int, only: Callable[[str], bool] | None = None) -> list[int]:
    """SIGKILL every process under `pid` (not `pid` itself); with `only`, those whose
    command line (arguments joined by spaces) it accepts. Returns the pids signalled."""
    pids = descendants(pid)
    if only is not None:
        pids = [p for p in pids if only(_cmdline(p))]
    _kill_all(pids)
    return pids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_all(pids: Sequence[int]) -> None:
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


@dataclass
class LaunchResult:
    returncode: int
    failure: Failure | None
    interrupted: signal.Signals | None

    def line(self, resume: Callable[[], str]) -> str | None:
        """What the launching side says of how the job ended (without ``shardwise: ``), or
        None when it succeeded. `resume()`: where the run can resume from, in words, for an
        interrupted job and one whose torchrun ended without a failure to report."""
        if self.interrupted is not None:
            return f"interrupted by {self.interrupted.name}; {resume()}"
        if self.failure is not None:
            return self.failure.line()
        if self.returncode != 0:
            return f"torchrun {describe_exit(self.returncode)}; {resume()}"
        return None

    @property
    def exit_status(self) -> int:
        """The launching `shardwise`'s exit status: 130 / 143 when interrupted by SIGINT /
        SIGTERM, a user error's own status, torchrun's otherwise (128 + N when it was killed
        by signal N; at least 1 after a failure)."""
        if self.interrupted is not None:
            return EXIT_INTERRUPTED.get(self.interrupted, 1)
        if self.failure is not None:
            return self.failure.exit_status if self.failure.user else (self.returncode or 1)
        return self.returncode if self.returncode >= 0 else 128 - self.returncode


class Zygote:
    """A fork of the launching `shardwise`, taken while nothing of the job has run (`fork`:
    its imports done, no other thread, no tokenizer or torch op used, before the job's
    checks), that waits until `launch_torchrun` makes it the torchrun wrapper
    (`shardwise.distributed.torchrun`), whose ranks are its forks (`fork_ranks`): no process
    of the job imports torch, transformers or the jobs again. It has a session of its own
    (a Ctrl-C in the terminal reaches the launching process alone) and dies with the
    launching process; `close` ends one that was not used (a failed check)."""

    def __init__(self, pid: int, pipe: int) -> None:
        self.pid = pid
        self._pipe: int | None = pipe
        self.returncode: int | None = None

    @classmethod
    def fork(cls, nodes: Nodes | None, wrapper: Callable[[list[str], dict[str, str]], int]) -> Zygote | None:
        """The zygote of a job whose ranks torchrun forks (`fork_ranks`); None for fresh ranks,
        on platforms without fork, and while another thread runs here (a fork copies only
        this one, and whatever lock another held). Started, it returns ``wrapper(argv, env)``
        (`shardwise.distributed.torchrun.become`) as its exit status."""
        if not (fork_ranks(nodes) and sys.platform.startswith("linux") and threading.active_count() == 1):
            return None
        read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(write)
                os.setsid()
                die_with_parent()
                with os.fdopen(read, "rb") as f:
                    order = f.read()
                code = wrapper(**json.loads(order)) if order else 0  # nothing: not needed
            except BaseException:  # noqa: BLE001 - never return into the launcher's code
                with contextlib.suppress(Exception):
                    traceback.print_exc()
            finally:
                leave(code)  # its output flushed
        os.close(read)
        assert os.getpid() == parent
        return cls(pid, write)

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        """Become ``python -m shardwise.distributed.torchrun <argv>`` in environment `env`."""
        assert self._pipe is not None, "a zygote starts once"
        with os.fdopen(self._pipe, "wb") as f:
            self._pipe = None
            f.write(json.dumps({"argv": list(argv), "env": dict(env)}).encode())

    def close(self) -> None:
        """End the zygote: one not started reads nothing and leaves; one started and still
        running (its launcher failed) is killed. Then reap it."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        elif self.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])

    def poll(self) -> int | None:
        """The exit status once it ended (negative: the signal), as `subprocess.Popen.poll`."""
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def launch_torchrun(nproc: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
                    grace_s: float = GRACE_S, module: str = "shardwise.cli",
                    nodes: Nodes | None = None, zygote: Zygote | None = None) -> LaunchResult:
    """Run ``python -m <module> <argv>`` (``shardwise <argv>``) in `nproc` local processes
    under torchrun and wait. With `nodes`, these are this node's ranks of a multi-node job
    (torchrun meets the other nodes' launchers at `nodes.endpoint`, ``--max-restarts 0``);
    without, the job is this machine's alone (a free port on 127.0.0.1). Where `fork_ranks`,
    torchrun forks the ranks from its process, which imported their code once.

    Signals SIGINT / SIGTERM received meanwhile are forwarded; a second one, or `grace_s`
    seconds without the ranks ending, kills the whole tree. Returns the exit status, the
    failure to report (see the module docstring) and the signal that interrupted the run.
    With a `zygote` (`Zygote.fork`, where `fork_ranks`), the wrapper is that fork of this
    process rather than a fresh interpreter.
    """
    error_dir = tempfile.mkdtemp(prefix="shardwise-errors-")
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env[ERROR_DIR_ENV] = error_dir
    if fork_ranks(nodes, child_env):  # the ranks are forks of the wrapper: it keeps their C++ log level
        child_env[FORK_RANKS_ENV] = ",".join(RANK_PRELOAD.get(module, (module,)))
    elif not debug_enabled():
        child_env[SAVED_CPP_LOG_ENV] = child_env.get(CPP_LOG_ENV, "")
        child_env[CPP_LOG_ENV] = "FATAL"
    where = (["--master-addr=127.0.0.1", f"--master-port={free_port()}"] if nodes is None
             else nodes.torchrun_args())
    if nodes is not None:
        child_env[RDZV_SINCE_ENV] = repr(time.monotonic())
    cmd = [sys.executable, "-m", "shardwise.distributed.torchrun", f"--nproc-per-node={nproc}", *where,
           "--max-restarts=0", "--monitor-interval=0.2", "-m", module, *argv]
    interrupted: list[tuple[signal.Signals, float]] = []  # (signal, monotonic time received)
    # A session of its own: a Ctrl-C in the terminal reaches this process alone, which
    # stops the job through torchrun (one signal, one path).
    proc: subprocess.Popen | Zygote
    if zygote is not None and FORK_RANKS_ENV in child_env:
        zygote.start(cmd[3:], child_env)
        proc = zygote
    else:
        proc = subprocess.Popen(cmd, env=child_env, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        sig = signal.Signals(signum)
        interrupted.append((sig, time.monotonic()))
        if len(interrupted) > 1:  # asked twice: stop waiting
            _kill_all([*descendants(proc.pid), proc.pid])
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
        while (code := proc.poll()) is None:
            time.sleep(0.1)
            if interrupted and time.monotonic() - interrupted[0][1] > grace_s:
                _kill_all([*descendants(proc.pid), proc.pid])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _kill_all(descendants(proc.pid))  # nothing of this job outlives it
    failure = first_failure(read_failures(error_dir))
    with contextlib.suppress(OSError):
        for p in Path(error_dir).iterdir():
            p.unlink()
        os.rmdir(error_dir)
    if failure is not None and failure.user and not interrupted:
        code = failure.exit_status
    return LaunchResult(returncode=code, failure=failure, interrupted=interrupted[0][0] if interrupted else None)
