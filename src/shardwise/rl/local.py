"""Worker groups on this machine without Ray: ranks are processes forked from the controller.

`rl.backend: local` (what ``auto`` picks on one machine without a GPU and without
``RAY_ADDRESS``) runs each rank of each worker group in a process forked from the
controller once it has imported the job's code (torch, transformers, the workers'
modules): a rank starts in milliseconds instead of a fresh interpreter's seconds of
imports, and no Ray head runs beside the job. `LocalWorkerGroup` is `RayWorkerGroup`'s
twin for the controller (`shardwise.rl.cluster.WorkerGroup`): the same dispatch rules,
`submit` / `Pending`, the same one-line errors (the group, the rank, what it was doing,
how its process ended, its log file) and the same bounds.

`start_pool(n)` forks n idle processes ("zygotes") at a moment the controller runs no
other thread (`shardwise.jobs.supervisor.control`: right after the job's imports, before
its checks; nothing in them has started a process group, and a failed check kills them
before its line). A group takes its ranks from the pool, or forks more when it is empty.

Each rank serves its calls one at a time, in the order the controller sent them, over a
socket pair (pickles: both ends are this program's own processes). The controller sends
from a thread per rank and reads each rank's answers in another, so a large batch on its
way in or out never blocks the other side (a generator's answer waiting to be read while
the actor's push needs that generator would otherwise deadlock). A rank dies with the
controller (``PR_SET_PDEATHSIG``) and ignores Ctrl-C (the controller stops it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection, Pipe
from typing import Any

import torch

from shardwise.config.schema import Config
from shardwise.contained import PR_SET_PDEATHSIG, describe_exit, prctl, set_process_name
from shardwise.distributed.launch import local_gpus
from shardwise.distributed.runtime import free_port, teardown
from shardwise.errors import ShardwiseError
from shardwise.rl.cluster import (
    _WORKER_ENV,
    RankPlace,
    RayWorkerGroup,
    WorkerError,
    WorkerGroup,
    _lost_peer,
    host_rank,
)
from shardwise.telemetry.logs import capture_worker_stderr

log = logging.getLogger(__name__)

__all__ = ["LocalWorkerGroup", "RemoteTraceback", "group_class", "local_gpus", "resolve_backend", "start_pool",
           "stop_pool"]

NODE_ID = "local"
"""`RankPlace.node_id` of a local rank."""
PEER_LOSS_GRACE_S = 5.0
"""How long a group whose rank failed on a broken connection waits for a peer's process to
be seen dead (its socket's end, at once when it died), so the line names the lost rank."""
TEARDOWN_S = 120.0
"""How long a graceful shutdown waits for the ranks' teardown (their workers' close and a
barrier) before it kills them anyway."""


class RemoteTraceback(Exception):
    """A rank's traceback (text), the cause of the controller's `WorkerError`: the run
    folder's error file keeps it."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]) if self.args else ""


# -- the ranks' side

def _dump(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _error_reply(e: BaseException) -> tuple:
    """``("error", exception or None, type name, message, traceback)``: the exception
    itself when it pickles (a `ShardwiseError` is re-raised as it is), else its words."""
    text = "".join(traceback.format_exception(e))
    try:
        pickle.loads(_dump(e))
        exc: BaseException | None = e
    except Exception:  # noqa: BLE001 - an exception that does not survive pickling: its words
        exc = None
    return ("error", exc, type(e).__name__, str(e), text)


def _serve(conn: Connection, parent: int) -> None:
    """A zygote's life: wait for its rank's setup, then serve calls (one at a time, in the
    order sent) until the controller kills it or goes away."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the controller ended before the death signal was armed
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller stops the ranks
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    worker: Any = None
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the controller is gone
            os._exit(0)
        kind = msg[0]
        t0 = time.perf_counter()
        try:
            if kind == "setup":
                worker = _setup(*msg[1:])
                reply: tuple = ("ok", (socket.gethostname(), os.getpid()), 0.0)
            elif kind == "call":
                _, method, args, kwargs = msg
                result = getattr(worker, method)(*args, **kwargs)
                reply = ("ok", result, time.perf_counter() - t0)
            elif kind == "teardown":
                _teardown(worker)
                reply = ("ok", None, 0.0)
            else:
                raise ValueError(f"unknown message {kind!r}")
            data = _dump(reply)
        except BaseException as e:  # noqa: BLE001 - every failure is the controller's to report
            data = _dump(_error_reply(e))
        try:
            conn.send_bytes(data)
        except (EOFError, OSError):
            os._exit(0)


def _setup(rank: int, world_size: int, port: int, local_rank: int, env: dict[str, str], log_path: str | None,
           title: str, worker_cls: type, args: tuple, kwargs: dict) -> Any:
    set_process_name(title)
    os.environ.update(env)
    # torch was imported by the controller before the fork: its thread count is set here
    torch.set_num_threads(max(int(env.get("OMP_NUM_THREADS", "1") or 1), 1))
    # a fresh start for logging: the controller's handlers (its console, its files) are not this rank's
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in list(logging.getLogger("shardwise").handlers):
        logging.getLogger("shardwise").removeHandler(h)
    console = capture_worker_stderr(log_path) if log_path else None
    return host_rank(rank, world_size, "127.0.0.1", port, local_rank, NODE_ID, console, worker_cls, args, kwargs)


def _teardown(worker: Any) -> None:
    close = getattr(worker, "close", None)
    if callable(close):
        close()
    teardown()


# -- the controller's side

class _Events(threading.Condition):
    """A condition with a count of the news it was notified of (so a waiter that looked
    before waiting misses none)."""

    def __init__(self) -> None:
        super().__init__()
        self.events = 0


class _Rank:
    """One forked process and the controller's two threads talking to it."""

    def __init__(self, pid: int, conn: Connection):
        self.pid, self.conn = pid, conn
        self.sent = 0
        """Messages queued so far (the next one's number)."""
        self.replies: dict[int, tuple] = {}
        self.received = 0
        self.exit_code: int | None = None
        """How its process ended (`os.waitstatus_to_exitcode`), once it did."""
        self.cond = _Events()
        self._outbox: list[bytes | None] = []
        self._sender: threading.Thread | None = None
        self._reader: threading.Thread | None = None

    def start_threads(self, label: str) -> None:
        self._sender = threading.Thread(target=self._send_loop, name=f"shardwise-{label}-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"shardwise-{label}-read", daemon=True)
        self._sender.start()
        self._reader.start()

    def send(self, msg: tuple) -> int:
        """Queue `msg`; its number (the answer's)."""
        data = _dump(msg)
        with self.cond:
            n = self.sent
            self.sent += 1
            self._outbox.append(data)
            self.cond.notify_all()
        return n

    def _send_loop(self) -> None:
        while True:
            with self.cond:
                while not self._outbox:
                    self.cond.wait()
                data = self._outbox.pop(0)
            if data is None:
                return
            try:
                self.conn.send_bytes(data)
            except (EOFError, OSError):  # it is gone: the reader says how
                return

    def _read_loop(self) -> None:
        while True:
            try:
                reply = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                break
            with self.cond:
                self.replies[self.received] = reply
                self.received += 1
                self.cond.events += 1
                self.cond.notify_all()
        code = self._reap()
        with self.cond:
            self.exit_code = code
            self.cond.events += 1
            self.cond.notify_all()

    def _reap(self) -> int:
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:  # reaped elsewhere: its status is lost
            return -int(signal.SIGKILL)
        return os.waitstatus_to_exitcode(status)

    def stop_sender(self) -> None:
        with self.cond:
            self._outbox.append(None)
            self.cond.notify_all()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.stop_sender()
        if self._reader is not None:
            self._reader.join(timeout=10)
        else:
            self.exit_code = self._reap()
        with contextlib.suppress(OSError):
            self.conn.close()


_POOL: list[_Rank] = []
_POOL_LOCK = threading.Lock()
_FORKED: list[_Rank] = []
"""Every rank process this controller forked and has not killed (for `stop_pool`)."""


def _fork() -> _Rank:
    """A zygote: a child of this process waiting for its setup."""
    ours, theirs = Pipe(duplex=True)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    others = [r.conn for r in _FORKED]
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            for c in others:  # the other ranks' ends: their ends must close with the controller
                with contextlib.suppress(OSError):
                    c.close()
            _serve(theirs, parent)
        except BaseException:  # noqa: BLE001 - never return into the controller's code
            with contextlib.suppress(Exception):
                traceback.print_exc()
        os._exit(1)
    theirs.close()
    rank = _Rank(pid, ours)
    _FORKED.append(rank)
    return rank


def start_pool(count: int) -> None:
    """Fork `count` idle rank processes now (see the module docstring: the caller runs no
    other thread)."""
    with _POOL_LOCK:
        _POOL.extend(_fork() for _ in range(count))


def stop_pool() -> None:
    """Kill every rank process this controller forked that is still there (the pool's idle
    ones and the groups' not shut down)."""
    with _POOL_LOCK:
        _POOL.clear()
        ranks = list(_FORKED)
        _FORKED.clear()
    for r in ranks:
        r.kill()


def _take() -> _Rank:
    with _POOL_LOCK:
        return _POOL.pop(0) if _POOL else _fork()


def resolve_backend(cfg: Config) -> str:
    """``rl.backend`` with auto resolved: local on one machine without a GPU (`local_gpus`)
    and without ``RAY_ADDRESS``, else ray."""
    if cfg.rl.backend != "auto":
        return cfg.rl.backend
    return "ray" if os.environ.get("RAY_ADDRESS") or local_gpus() else "local"


def group_class(cfg: Config) -> type[WorkerGroup]:
    """The worker-group class of ``rl.backend`` (`resolve_backend`)."""
    return LocalWorkerGroup if resolve_backend(cfg) == "local" else RayWorkerGroup


_next_device = 0
_DEVICE_LOCK = threading.Lock()


def _devices(n: int) -> list[int]:
    """The next `n` GPU indices of this machine (each group's ranks get their own)."""
    global _next_device
    with _DEVICE_LOCK:
        first = _next_device
        _next_device += n
    return list(range(first, first + n))


class LocalWorkerGroup(WorkerGroup):
    """`world_size` forked processes, each hosting ``worker_cls(*args, runtime=...,
    **kwargs)`` as one rank of a fresh process group (gloo on CPU, nccl with `use_gpu`,
    one GPU per rank). See the module docstring; the arguments are `RayWorkerGroup`'s."""

    def __init__(self, worker_cls: type, world_size: int, *args: Any, name: str = "workers",
                 use_gpu: bool | None = None, setup_timeout_s: float = 900.0, sp: int = 1,
                 log_dir: str | os.PathLike[str] | None = None, **kwargs: Any):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.worker_cls, self.world_size, self.name = worker_cls, world_size, name
        self.places: list[RankPlace] = []
        self.log_paths = [None if log_dir is None else os.path.join(log_dir, f"{name}-rank{i}.log")
                          for i in range(world_size)]
        self.dispatch_s = 0.0
        self._ranks = [_take() for _ in range(world_size)]
        self._cond = _Events()
        """Notified by every rank's reader (an answer, a process ended)."""
        for i, r in enumerate(self._ranks):
            r.cond = self._cond
            r.start_threads(f"{name}{i}")
        self._alive = True
        if use_gpu is None:
            use_gpu = local_gpus() >= world_size
        local_ranks = _devices(world_size) if use_gpu else list(range(world_size))
        env = {k: os.environ.get(k, v) for k, v in _WORKER_ENV.items()}
        host = socket.gethostname()
        self.places = [RankPlace(i, NODE_ID, "127.0.0.1", host, r.pid) for i, r in enumerate(self._ranks)]
        try:
            port = free_port()
            self._wait({i: r.send(("setup", i, world_size, port, local_ranks[i], env, self.log_paths[i],
                                   f"sw-{name}{i}", worker_cls, args, kwargs))
                        for i, r in enumerate(self._ranks)}, "setup", timeout=setup_timeout_s)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        log.info("worker group %s: %s (pids %s)", name, self.describe_places(),
                 ", ".join(str(r.pid) for r in self._ranks))
        self._set_layout(sp)

    def _start(self, rank: int, method: str, call: tuple[tuple, dict]) -> Any:
        return self._ranks[rank].send(("call", method, *call))

    def _ready(self, futures: Mapping[int, Any]) -> bool:
        with self._cond:
            return all(n in self._ranks[r].replies or self._ranks[r].exit_code is not None
                       for r, n in futures.items())

    def _wait(self, futures: Mapping[int, Any], what: str, timeout: float | None = None) -> list[Any]:
        """The ``(result, seconds)`` of `futures` (rank -> message number), in the mapping's
        order; on the first failure the group is shut down and one `WorkerError` raised: a
        rank whose process ended, a rank that raised (its own error when it is the user's
        mistake, a `ShardwiseError`), or (with `timeout`) the ranks that did not answer. A
        broken collective is a symptom: the group first looks, up to `PEER_LOSS_GRACE_S`,
        for a rank whose process ended, and names that one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, tuple] = {}
        symptom: tuple[int, tuple] | None = None
        symptom_since = 0.0
        while True:
            with self._cond:
                seen = self._cond.events
                state = [(r, self._ranks[r].replies.get(n), self._ranks[r].exit_code) for r, n in futures.items()]
                dead = [r for r, rank in enumerate(self._ranks) if rank.exit_code is not None]
            for r, reply, ended in state:
                if r in results:
                    continue
                if reply is not None:
                    if reply[0] == "ok":
                        results[r] = reply
                    elif symptom is None and _lost_peer(reply[3]):
                        symptom, symptom_since = (r, reply), time.monotonic()
                    elif symptom is None:
                        self.shutdown(graceful=False)
                        raise self._raised(what, r, reply)
                    # else: another survivor's broken collective, the cause is still to come
                elif ended is not None:
                    self.shutdown(graceful=False)
                    raise self._lost(what, r, ended)
            if symptom is not None and dead:
                self.shutdown(graceful=False)
                raise self._lost(what, dead[0], self._ranks[dead[0]].exit_code or 0)
            if len(results) == len(futures):
                with self._cond:  # answered: the controller holds them now
                    for r, n in futures.items():
                        self._ranks[r].replies.pop(n, None)
                return [results[r][1:] for r in futures]
            now = time.monotonic()
            if symptom is not None and now - symptom_since > PEER_LOSS_GRACE_S:
                self.shutdown(graceful=False)
                raise self._raised(what, *symptom)
            if deadline is not None and now >= deadline:
                silent = sorted(r for r in futures if r not in results)
                self.shutdown(graceful=False)
                ranks = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
                raise WorkerError(f"worker group {self.name!r}: {what} did not finish in {timeout:g} s "
                                  f"({ranks} did not answer)")
            wait_s = 1.0 if deadline is None else min(max(deadline - now, 0.0), 1.0)
            if symptom is not None:
                wait_s = min(wait_s, 0.2)
            with self._cond:  # until a reader has news (an answer, an end) or the next check is due
                if self._cond.events == seen:
                    self._cond.wait(wait_s)

    def _raised(self, what: str, rank: int, reply: tuple) -> BaseException:
        """The error a rank answered with: the user's mistake (`ShardwiseError`) as it is
        (the same line and exit status as when the controller finds it), anything else one
        `WorkerError` whose cause carries the rank's traceback."""
        _, exc, kind, message, text = reply
        if isinstance(exc, ShardwiseError):
            exc.__cause__ = RemoteTraceback(text)
            return exc
        place = self.places[rank]
        err = WorkerError(f"{self.name}.{what} failed on rank {rank}: {kind}: {message} "
                          f"(rank {rank} ran on {place.where()})")
        err.__cause__ = RemoteTraceback(text)
        return err

    def _lost(self, what: str, rank: int, code: int) -> WorkerError:
        place = self.places[rank]
        out = self.log_paths[rank]
        how = describe_exit(code).removeprefix("was ")
        return WorkerError(f"worker group {self.name!r} lost rank {rank} in {what}: its process "
                           f"(pid {place.pid} on {place.where()}) died ({how})" + (f"; its output: {out}" if out else ""))

    def shutdown(self, graceful: bool = True) -> None:
        """Tear down the process group (graceful: each rank's worker closes, then a barrier)
        and end the processes."""
        if not getattr(self, "_alive", False):
            return
        self._alive = False
        if graceful:
            try:
                self._wait({i: r.send(("teardown",)) for i, r in enumerate(self._ranks)}, "teardown",
                           timeout=TEARDOWN_S)
            except Exception as e:  # noqa: BLE001 - the processes are killed below either way
                log.warning("worker group %s: teardown failed: %s", self.name, e)
        for r in self._ranks:
            r.kill()
            with _POOL_LOCK, contextlib.suppress(ValueError):
                _FORKED.remove(r)
