"""Run user code in a killable child with a time limit and a bounded answer.

User code called by the job (a reward function; next, an agent's tools) can raise, hang
while catching every exception or ignoring SIGALRM, end its process (``os._exit``), kill
its parent, print megabytes, return what is not a plain value, or start processes that
outlive it. `Contained` runs it where all of that stays contained:

- a child process tree of its own, started with ``python -c`` (`_BOOT`) in a new
  session (standard library only before the user's module: it starts in a fraction of a
  second): a small guard process, under it a keeper, and under that the worker that
  imports ``module:attr`` and serves calls. The keeper is the worker's parent, so code
  that kills its parent ends its own tree, never the job. Guard and keeper are both
  subreapers of what is under them (Linux): processes that escape into a session of
  their own (with an empty environment, so without this child's mark) come back to the
  keeper when their parent ends, or to the guard when the code killed the keeper too, and
  they are killed once the worker (or the keeper) ended. What had to be killed beyond the
  child's own processes is counted in `Contained.killed`;
- calls and answers are JSON lines over two pipes of their own (not stdin / stdout: what
  the code prints goes where the job's output goes, or to `output`, e.g. a log file or
  ``subprocess.DEVNULL`` for code that floods it, or through an `OutputBudget` that keeps
  a bounded share of it per call and per run); nothing the child sends is unpickled,
  and an answer over `max_result_bytes` is refused;
- `map` sends many calls in one request (one round trip per batch, not per item) and reads
  the answers as they come; each item has `timeout_s` from the previous answer. A call
  past its time, a child that ended, or an interrupt (Ctrl-C) in the caller kills the
  whole tree with SIGKILL: the processes under the keeper, found by a walk of /proc, and
  every process carrying this child's mark in its environment (those that escaped the
  tree when the keeper itself was killed). The next call starts a fresh child.

Each call ends in an `Outcome`: ``ok`` with the JSON value, or ``error`` (the code raised,
or returned what cannot be sent), ``timeout`` or ``crash`` (the child ended), each with a
one-line reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MARK_ENV", "PR_SET_CHILD_SUBREAPER", "PR_SET_NAME", "PR_SET_PDEATHSIG", "Contained", "Outcome",
           "OutputBudget", "close_all", "describe_exit", "kill_left_under", "prctl", "set_process_name"]

MARK_ENV = "SHARDWISE_CONTAINED"
"""The environment variable that marks every process of one child (see `Contained.close`)."""
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_READ_CHUNK = 1 << 16
_REASON_LIMIT = 300


@dataclass(frozen=True)
class Outcome:
    """How one call ended. `value`: the JSON value returned (``kind == "ok"``); `reason`:
    one line for the others (``error``: the code raised or returned what cannot be sent;
    ``timeout``: it did not answer in time and was killed; ``crash``: its process ended)."""

    kind: Literal["ok", "error", "timeout", "crash"]
    value: Any = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def _one_line(text: str, limit: int = _REASON_LIMIT) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def describe_exit(code: int) -> str:
    """A process's exit status in words (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class OutputBudget:
    """Where the prints of contained children go, bounded: of what one call (one payload)
    prints, its first `per_call` bytes are written to `sink` (a binary file object), of all
    the calls together the first `per_run` bytes; the rest is read and dropped (the code
    never blocks on a full pipe), with a note line ``[shardwise] ...`` in `sink` saying how
    much: one per call cut at its bound, one when the run's bound is reached, and the total
    at `close`. `describe(payload)` names a call in its note. Shared by the children of one
    runner (thread-safe)."""

    def __init__(self, sink: Any, per_call: int, per_run: int, describe: Callable[[Any], str] = str):
        self.sink = sink
        self.per_call = int(per_call)
        self.per_run = int(per_run)
        self.describe = describe
        self.written = 0
        """Bytes of the children's output written to `sink` (the notes aside)."""
        self.dropped = 0
        """Bytes of the children's output read and not written."""
        self._lock = threading.Lock()
        self._full_said = False

    def take(self, child: Contained, chunk: bytes) -> None:
        """`chunk` printed by `child` during its current call: what the bounds allow written."""
        with self._lock:
            room = max(0, min(self.per_call - child._call_written, self.per_run - self.written))
            keep = chunk[:room]
            if keep:
                self._write(keep)
            child._call_written += len(keep)
            child._call_dropped += len(chunk) - len(keep)
            self.written += len(keep)
            self.dropped += len(chunk) - len(keep)
            if self.written >= self.per_run and len(chunk) > len(keep) and not self._full_said:
                self._full_said = True
                self._note(f"the output of the calls reached {self.per_run} bytes per run: the rest is dropped "
                           "(counted at the end)")

    def end_call(self, child: Contained, payload: Any) -> None:
        """`child`'s call of `payload` ended: a note if it was cut at the per-call bound."""
        with self._lock:
            dropped, written = child._call_dropped, child._call_written
            child._call_dropped = child._call_written = 0
            if dropped and not self._full_said:
                self._note(f"{self.describe(payload)} printed {written + dropped} bytes: the first {written} kept, "
                           f"{dropped} dropped (at most {self.per_call} bytes per call)")

    def close(self) -> None:
        """The total dropped, in a last note (none when nothing was)."""
        with self._lock:
            if self.dropped:
                self._note(f"{self.dropped} bytes of the calls' output were dropped in all (at most "
                           f"{self.per_call} bytes per call, {self.per_run} per run)")
            with contextlib.suppress(OSError, ValueError):
                self.sink.flush()

    def _note(self, text: str) -> None:
        self._write(f"\n[shardwise] {text}\n".encode())

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):  # a full disk or a closed log: the prints are notes
            self.sink.write(data)


class Contained:
    """`target` (``module:attr``, a dotted attribute path allowed) called in a child process
    tree that can be killed whatever the code does (see the module docstring).

    `adapter` (``module:function``, ours, imported in the child before `target`) is called
    as ``adapter(target_callable, payload)`` for each payload and returns the JSON value to
    send back; without one, a list payload is passed as positional arguments and a dict as
    keywords. `start_timeout_s` bounds the child's start (the import of `target`
    included). `env` is added to the child's environment; `output` (a file descriptor or
    file object, or ``subprocess.DEVNULL``) takes the child's stdout and stderr, by default
    this process's; or `budget` does, bounded (`OutputBudget`; it then replaces `output`).
    Not thread-safe: one caller.
    """

    def __init__(self, target: str, adapter: str | None = None, *, max_result_bytes: int = 1 << 20,
                 start_timeout_s: float = 120.0, env: dict[str, str] | None = None, output: Any = None,
                 budget: OutputBudget | None = None):
        self.target = target
        self.output = output
        self.budget = budget
        self._out = -1
        """The read end of the pipe of the child's stdout and stderr (with `budget`)."""
        self._call_written = 0
        self._call_dropped = 0
        self.killed = 0
        """Processes killed beyond the child's own (guard, keeper, worker): what the code
        started and left running, over every child started so far."""
        self._own: set[int] = set()
        """The pids of the child's own processes (guard, and keeper and worker once ready)."""
        self.adapter = adapter
        self.max_result_bytes = max_result_bytes
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})
        self._proc: subprocess.Popen | None = None
        self._mark = ""
        self._to_child = -1
        self._from_child = -1
        self._buffer = b""
        """What the child sent after its last complete line."""
        self._lines: deque[bytes] = deque()
        self._ready = False
        self._request = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the child if none runs (returns at once; the child imports `target`
        meanwhile, and the first call waits for it)."""
        if self._proc is not None:
            return
        request_r, request_w = os.pipe()
        answer_r, answer_w = os.pipe()
        self._mark = f"{os.getpid()}-{secrets.token_hex(8)}"
        env = {**os.environ, **self.env, MARK_ENV: self._mark}
        output, out_w = self.output, -1
        if self.budget is not None:
            self._out, out_w = os.pipe()
            os.set_blocking(self._out, False)
            output = out_w
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, _package_root(), str(request_r), str(answer_w), str(os.getpid()),
                 self.target, self.adapter or "", str(self.max_result_bytes)],
                pass_fds=(request_r, answer_w), stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                start_new_session=True, env=env)
        finally:
            os.close(request_r)
            os.close(answer_w)
            if out_w >= 0:
                os.close(out_w)
        self._own = {self._proc.pid}
        self._to_child, self._from_child = request_w, answer_r
        self._buffer, self._ready = b"", False
        self._lines.clear()

    @property
    def running(self) -> bool:
        """A child was started and not closed (it may have ended by itself since)."""
        return self._proc is not None

    def close(self) -> None:
        """Kill the child's whole tree (see `_kill`) and forget it; a later call starts a
        new one. Safe to call twice."""
        if self._proc is None:
            return
        self._kill()  # interrupted (a second Ctrl-C), the next close kills what is left
        self._forget()

    def _forget(self) -> None:
        """Close the pipes of a child that was killed and reaped."""
        if self._out >= 0:
            self._drain_output()
        for fd in (self._to_child, self._from_child, self._out):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._proc, self._to_child, self._from_child, self._out = None, -1, -1, -1

    def wait_started(self) -> Outcome:
        """Start the child (if none runs) and wait until it imported `target`, at most
        `start_timeout_s`: ``ok``, or the Outcome of an import that raised (``error``), did
        not end in time (``timeout``, the child killed) or ended the process (``crash``).
        An interrupt (Ctrl-C) kills the child and propagates."""
        try:
            self.start()
            failure = self._wait_ready()
        except BaseException:
            self.close()
            raise
        return failure if failure is not None else Outcome("ok")

    def __enter__(self) -> Contained:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls
    def call(self, payload: Any, timeout_s: float | None) -> Outcome:
        """One call (see `map`)."""
        return self.map([payload], timeout_s)[0]

    def map(self, payloads: Sequence[Any], timeout_s: float | None) -> list[Outcome]:
        """The outcomes of `payloads` (JSON values), sent in one request. Each item may take
        `timeout_s` seconds after the previous answer (None: no limit). The list stops after
        the first ``timeout`` or ``crash`` (the child is killed there; the items after it
        were not run); ``error`` items do not stop it. An exception in the caller while
        waiting (KeyboardInterrupt) kills the child and propagates."""
        if not payloads:
            return []
        try:
            request = json.dumps({"id": self._request + 1, "items": list(payloads)}).encode() + b"\n"
        except (TypeError, ValueError) as e:
            raise TypeError(f"the payloads of {self.target} must be JSON values: {e}") from None
        try:
            self.start()
            failure = self._wait_ready()
            if failure is not None:
                self.close()
                return [failure]
            self._request += 1
            if not self._send(request):
                return [self._crashed()]
            out: list[Outcome] = []
            while len(out) < len(payloads):
                answer = self._next_answer(timeout_s)
                if isinstance(answer, Outcome):  # timeout or crash: the tree is gone
                    out.append(answer)
                    return out
                if answer.get("id") != self._request:
                    continue
                if "error" in answer:
                    out.append(Outcome("error", reason=_one_line(answer["error"])))
                else:
                    out.append(Outcome("ok", answer.get("value")))
                if self.budget is not None:  # what it printed before it answered is in the pipe
                    self._drain_output()
                    self.budget.end_call(self, payloads[len(out) - 1])
            return out
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the pipes
    def _wait_ready(self) -> Outcome | None:
        if self._ready:
            return None
        answer = self._next_answer(self.start_timeout_s, starting=True)
        if isinstance(answer, Outcome):
            return answer
        if "fatal" in answer:
            return Outcome("error", reason=_one_line(answer["fatal"]))
        self._ready = True
        self._own.update(p for p in answer.get("pids", ()) if isinstance(p, int))
        return None

    def _send(self, data: bytes) -> bool:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._to_child, view):]
        except BrokenPipeError:
            return False
        return True

    def _next_answer(self, timeout_s: float | None, starting: bool = False) -> dict | Outcome:
        """The child's next JSON line, or the Outcome of a child that did not answer in
        time (killed here) or ended."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        limit = self.max_result_bytes + 4096
        while not self._lines:
            if len(self._buffer) > limit:
                self.close()
                return Outcome("crash", reason=f"its answer exceeded {self.max_result_bytes} bytes")
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            readable, _, _ = select.select([self._from_child] + ([self._out] if self._out >= 0 else []), [], [],
                                           left)
            if self._out in readable:
                self._drain_output()
                if self._from_child not in readable:
                    continue
            if not readable:
                self.close()
                if starting:
                    return Outcome("timeout", reason=f"its process did not start within {timeout_s:g} s")
                return Outcome("timeout", reason=f"did not return within {timeout_s:g} s")
            chunk = os.read(self._from_child, _READ_CHUNK)
            if not chunk:
                return self._crashed()
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            self._lines.extend(lines)
        line = self._lines.popleft()
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            self.close()
            return Outcome("crash", reason="its process sent what is not an answer (something wrote to its pipe)")
        if "ended" in answer:  # the keeper's (or the guard's) last word: the worker is gone
            killed = answer.get("killed")
            self.killed += killed if isinstance(killed, int) and killed > 0 else 0
            self.close()
            return Outcome("crash", reason=f"its process {_one_line(answer['ended'])}")
        return answer

    def _drain_output(self) -> None:
        """Read what the child printed so far (without waiting) into the budget; at the
        pipe's end (every writer gone), stop watching it."""
        assert self.budget is not None
        while self._out >= 0:
            try:
                chunk = os.read(self._out, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                with contextlib.suppress(OSError):
                    os.close(self._out)
                self._out = -1
                return
            self.budget.take(self, chunk)

    def _crashed(self) -> Outcome:
        proc = self._proc
        code = None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=5)
        self.close()
        how = describe_exit(code) if code is not None else "closed its pipe"
        return Outcome("crash", reason=f"its process {how}")

    def _kill(self) -> None:
        """SIGKILL the keeper, the processes under it (a /proc walk, repeated until none is
        left: the keeper's own sweep may race with it) and every process carrying this
        child's mark; reap the keeper. Bounded: at most a few seconds."""
        assert self._proc is not None
        _kill_trees([self])


def close_all(children: Sequence[Contained]) -> None:
    """`Contained.close` of every child in `children`, their trees killed together: each
    walk of /proc serves all of them (closing a runner's children one after another cost
    a walk or more each)."""
    live = [c for c in children if c._proc is not None]
    if live:
        _kill_trees(live)
    for c in live:
        c._forget()


def _kill_trees(children: Sequence[Contained]) -> None:
    """SIGKILL each child's keeper, the processes under it and every process carrying its
    mark, walking /proc again until none is left (a keeper's own sweep may race with it);
    reap the keepers. Bounded: at most a few seconds."""
    live = [c for c in children if c._proc is not None]
    procs = [c._proc for c in live]
    roots = {id(c): c._proc.pid for c in live}  # another thread may forget a child meanwhile
    deadline = time.monotonic() + 5.0
    others: dict[int, set[int]] = {id(c): set() for c in live}
    tree = _process_tree()
    for c in live:
        if not c._ready:  # keeper and worker not named yet: the two levels under the guard are the child's own
            keepers = tree.get(roots[id(c)], [])
            c._own.update(keepers, *(tree.get(k, ()) for k in keepers))
    while True:
        pids = []
        marked = _marked_by(c._mark for c in live)
        for c in live:
            mine = descendants(roots[id(c)], tree) + marked.get(c._mark, [])
            others[id(c)].update(p for p in mine if p not in c._own and not _zombie(p))
            pids += mine
        pids += [proc.pid for proc in procs if proc.poll() is None]
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.02)
        tree = _process_tree()
    for c in live:
        c.killed += len(others[id(c)])
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))


_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from shardwise.contained import _main; sys.exit(_main(sys.argv[2:]))"
"""The child's command (``python -c``): shardwise from where this process found it."""


def _package_root() -> str:
    """The folder holding the ``shardwise`` package this process imported."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _process_tree() -> dict[int, list[int]]:
    """Parent pid -> the pids of its children, from one walk of /proc (Linux; {} elsewhere)."""
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
    return children


def descendants(pid: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """Process ids under `pid` (Linux /proc; `tree`: a `_process_tree` already walked),
    deepest last; [] elsewhere."""
    children = _process_tree() if tree is None else tree
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), ()):
            out.append(c)
            stack.append(c)
    return out


def kill_left_under(pid: int) -> list[int]:
    """SIGKILL the processes under `pid` that carry a contained child's mark (any: what a
    child's code started, reparented to `pid`, a subreaper, when the job's process that owned
    the child ended abruptly and the child with it). Returns the pids signalled."""
    out = []
    prefix = f"{MARK_ENV}=".encode()
    for p in descendants(pid):
        if not any(x.startswith(prefix) for x in _environ(p)):
            continue
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
            out.append(p)
    return out


def _marked_by(marks: Iterable[str]) -> dict[str, list[int]]:
    """Mark -> the live processes (this user's) carrying ``MARK_ENV=mark``, for `marks`,
    from one walk of /proc."""
    prefix = f"{MARK_ENV}=".encode()
    wanted = {m.encode() for m in marks if m}
    out: dict[str, list[int]] = {}
    if not wanted:
        return out
    with contextlib.suppress(OSError):
        for e in os.listdir("/proc"):
            if e.isdigit():
                for x in _environ(int(e)):
                    if x.startswith(prefix) and x[len(prefix):] in wanted:
                        out.setdefault(x[len(prefix):].decode(), []).append(int(e))
    return out


def _zombie(pid: int) -> bool:
    """Process `pid` has ended and waits to be reaped (or is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def _environ(pid: int) -> list[bytes]:
    """Process `pid`'s environment as ``NAME=value`` byte strings; [] where it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


# ---------------------------------------------------------------------- the child side


def prctl(option: int, value: Any) -> None:
    """Linux ``prctl(option, value)`` for this process (PR_SET_PDEATHSIG, PR_SET_NAME,
    PR_SET_CHILD_SUBREAPER); nothing where it is not available."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def set_process_name(title: str) -> None:
    """This process's name in ps, top and /proc/<pid>/comm (15 bytes at most), where a
    fork would otherwise show its parent's."""
    prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]))


def _write_line(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode() + b"\n"
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _resolve(spec: str) -> Any:
    module_name, _, attr_path = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split(".") if attr_path else ():
        obj = getattr(obj, part)
    return obj


def _default_adapter(fn: Callable, payload: Any) -> Any:
    if isinstance(payload, list):
        return fn(*payload)
    if isinstance(payload, dict):
        return fn(**payload)
    return fn(payload)


def _serve(request_fd: int, answer_fd: int, target: str, adapter_spec: str, max_bytes: int) -> None:
    """The worker: import `target` (and `adapter_spec`), say ready, answer each request's
    items in order, one line each."""
    try:
        sys.path[:0] = [os.getcwd()]
        adapter = _resolve(adapter_spec) if adapter_spec else _default_adapter
        fn = _resolve(target)
    except BaseException as e:  # reported as the call's error, one line
        _write_line(answer_fd, {"fatal": f"importing {target} failed: {type(e).__name__}: {e}"})
        return
    _write_line(answer_fd, {"ready": True, "pids": [os.getpid(), os.getppid()]})
    reader = os.fdopen(request_fd, "rb", buffering=1 << 16)
    for line in reader:
        request = json.loads(line)
        for item in request["items"]:
            answer: dict[str, Any] = {"id": request["id"]}
            try:
                value = adapter(fn, item)
                text = json.dumps({"id": request["id"], "value": value}, allow_nan=False)
            except BaseException as e:  # SystemExit too: the call's error, one line
                answer["error"] = f"{type(e).__name__}: {_one_line(str(e))}"
                text = json.dumps(answer)
            else:
                if len(text) > max_bytes:
                    answer["error"] = f"returned {len(text)} bytes, over the limit of {max_bytes}"
                    text = json.dumps(answer)
            for stream in (sys.stdout, sys.stderr):  # its prints before its answer (counted as this call's)
                with contextlib.suppress(BaseException):
                    stream.flush()
            view = memoryview(text.encode() + b"\n")
            while view:
                view = view[os.write(answer_fd, view):]


def _keep(child: int, answer_fd: int, told: int = -1) -> int:
    """The keeper (`child`: the worker) and the guard (`child`: the keeper): reap every
    child until `child` ended, then kill what is left under this process (escaped
    processes came here as orphans; the worker under a killed keeper, whose pid the keeper
    wrote to `told`, is not counted), say how `child` ended and how many had to be
    killed, exit."""
    status = None
    while status is None:
        try:
            pid, wstatus = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            status = os.waitstatus_to_exitcode(wstatus)
    own: set[int] = set()
    if told >= 0:
        with contextlib.suppress(OSError, ValueError):
            own.add(int(os.read(told, 64) or b"0"))
    killed: set[int] = set()
    for _ in range(50):
        pids = descendants(os.getpid())
        if not pids:
            break
        for p in pids:
            if p not in own and not _zombie(p):
                killed.add(p)
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        time.sleep(0.01)
    with contextlib.suppress(OSError):
        _write_line(answer_fd, {"ended": describe_exit(status if status is not None else 0), "killed": len(killed)})
    return 0


def _main(argv: list[str]) -> int:
    request_fd, answer_fd, parent = int(argv[0]), int(argv[1]), int(argv[2])
    target, adapter, max_bytes = argv[3], argv[4], int(argv[5])
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the job is gone already
        return 0
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the job stops this tree with SIGKILL, on its own terms
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    guard = os.getpid()
    told_r, told_w = os.pipe()  # the keeper tells the guard its worker's pid
    keeper = os.fork()
    if keeper == 0:
        try:
            os.close(told_r)
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
            if os.getppid() != guard:
                os._exit(0)
            prctl(PR_SET_CHILD_SUBREAPER, 1)
            me = os.getpid()
            worker = os.fork()
            if worker == 0:
                os.close(told_w)
                prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
                if os.getppid() != me:
                    os._exit(0)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_DFL)
                _serve(request_fd, answer_fd, target, adapter, max_bytes)
                os._exit(0)
            os.close(request_fd)
            os.write(told_w, str(worker).encode())
            os.close(told_w)
            _keep(worker, answer_fd)
        finally:
            os._exit(0)
    os.close(request_fd)
    os.close(told_w)
    # The guard: should the code kill the keeper (its worker's parent), what the code started
    # comes here and is killed (counted; the worker, killed with its keeper, is not).
    return _keep(keeper, answer_fd, told=told_r)
