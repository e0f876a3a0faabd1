"""Tool calls run where the user's code cannot break the rollout.

`ToolRunner` keeps up to `workers` contained children (`shardwise.contained.Contained`, their
side is `shardwise.agents.host`) and runs calls concurrently over them, one thread per
child. Plain calls wait in one queue and the first child free takes the next
(`ToolRunner._drain`): a child that just imported the tools, or one whose last call
ended. Children start as calls need them: `start_workers` at construction (they import
the tools while the job goes on), and more whenever calls wait that outnumber the
children without a call (up to `workers`), so N slow calls sent together run at once
(about one call's time, not N), a fast call is taken by the first child free rather than
waiting for a start, and a large `workers` costs nothing while calls are few (each child
is a Python process, ~31 MiB with its keeper); an environment's child starts when its
first trajectory is pinned to it. What a tool does stays in its child: a raise, a hang
(stopped after ``timeout_s``), ``os._exit``, killing its parent (what it started is
killed too, counted in `ToolRunner.killed` and one note at `close`), megabytes of prints
(they go to `output`, by default nowhere; into a log at most ``output_bytes_per_call``
per call and ``output_bytes_per_run`` in all, the rest dropped with a note), a return
value that is not a string, text the tokenizer cannot take (a lone surrogate becomes
U+FFFD: `readable`), arguments that do not fit its signature: each is a `ToolResult`
whose text the model reads (``"error: ..."``, one line), never an exception in the job.
A child that ended or was killed is started afresh on its next call.

An environment is constructed once per trajectory, in the child the trajectory is pinned
to (by a hash of its id), where it stays across the trajectory's calls. When that child
ends (a call in it hung or crashed), the environments it held are lost: their later calls
are answered ``"error: the environment of this trajectory was lost (its process ended)"``
and their reward is None.

Calls can be sent while the caller does something else: `ToolRunner.submit` queues them
and returns at once, `ToolRunner.collect` waits for their results (`ToolRunner.call` is
both; `ToolRunner.done` and `ToolRunner.wait_any` tell when results are back, for a
caller with other work). Each child has one thread of its own that runs what was sent to
it in the order sent (then the plain calls waiting), so two calls never share a child at
once, and a trajectory's environment calls run in the order they were submitted.

Texts are cut to their first ``max_chars`` characters (the head is kept: a tool's output
usually says what matters first); the loop cuts them again to tokens.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import subprocess
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardwise.agents.parsers import ToolCall
from shardwise.agents.tools import EnvironmentSpec, ToolSpec, check_names
from shardwise.contained import Contained, Outcome, OutputBudget, close_all
from shardwise.errors import did_you_mean

__all__ = ["Submitted", "ToolResult", "ToolRunner"]

_TARGET = "shardwise.agents.host:serve"
_STATUSES = ("ok", "error", "timeout", "crash")
BOUND_PER_CALL_S = 10.0
BOUND_SLACK_S = 30.0
"""The runner's own bound on a submission's answers, beyond each call's ``timeout_s`` and a
start's ``start_timeout_s`` (which its children enforce): per call queued on a child, and
once. Past it the wait ends in one line naming the tool workers that did not answer: it
only fires on a runner bug (a child's thread that never came back)."""
_NO_ENVIRONMENT = "the environment of this trajectory was ended or never started"
OUTPUT_BYTES_PER_CALL = 1 << 20
"""What the tools print (to `output`) is kept up to this many bytes per call..."""
OUTPUT_BYTES_PER_RUN = 64 << 20
"""...and this many per runner (per rank and run); the rest is dropped with a note saying
how much (`shardwise.contained.OutputBudget`). A tool printing 100 MB per call once put
5.6 GB into run.dir/logs/tools-rank*.log in two steps."""


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: `text`, what the model reads (cut to ``max_chars``; ``"error: ..."``
    for a fault), and `status`: ``ok``, ``error`` (the call was malformed, named no tool, did
    not fit the signature, raised, returned a non-string; or its environment is gone),
    ``timeout`` (stopped after ``timeout_s``) or ``crash`` (its process ended)."""

    text: str
    status: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class _Jobs:
    """Payloads sent to the children by one `ToolRunner._submit` or `ToolRunner._enqueue`."""

    parts: list[tuple[concurrent.futures.Future, list[int], int | None]]
    """``(future, indices, child)``: the future's answer is the outcomes of the payloads at
    those indices among the submitted ones, in order; `child` is the child they were pinned
    to (None: a plain call, taken by whichever child is free first: `_Taken.worker`)."""
    count: int
    bound_s: float
    """How long the answers may take from submission (a runner bug past it)."""
    deadline: float
    """``time.monotonic()`` at which `bound_s` runs out."""


class _Taken(concurrent.futures.Future):
    """The future of one plain call; `worker` is the child that took it (None: none yet)."""

    worker: int | None = None


@dataclass
class Submitted:
    """Calls sent by `ToolRunner.submit`, running or done: `ToolRunner.collect` gives
    their results."""

    calls: list[tuple[str, ToolCall, dict]]
    early: list[ToolResult | None]
    """Results known at submission (a refused call), None for the calls sent to a child."""
    where: list[int]
    """Index into `calls` of each payload sent, in the order sent."""
    jobs: _Jobs


def _plain(value: Any) -> Any:
    """`value` as JSON (what the data carries: numpy values become lists / numbers, the
    rest their string)."""
    def default(obj: Any) -> Any:
        if hasattr(obj, "tolist"):
            return obj.tolist()
        return str(obj)

    return json.loads(json.dumps(value, default=default)) if value is not None else None


class ToolRunner:
    """Runs `tools` (plain functions) and the methods of `environment` (one instance per
    trajectory) in up to `workers` contained processes, `start_workers` of them started at
    once, the others as calls need them; see the module docstring.

    `timeout_s` bounds each call (and each reset, reward and end); `start_timeout_s` bounds a
    child's start together with the import of the user's modules in it. `output` takes what
    the tools print: None (nowhere, ``subprocess.DEVNULL``), a path (appended to) or a file
    descriptor / file object. Extra keyword arguments from the data are merged over the
    model's arguments, those the function takes (all for a ``**kwargs`` function). One caller
    (not thread-safe: submit, collect and the rest from one thread); `close` leaves no process.
    """

    def __init__(self, tools: list[ToolSpec], environment: EnvironmentSpec | None, *, timeout_s: float,
                 workers: int = 4, max_chars: int = 4096, output: Any = None, start_timeout_s: float = 120.0,
                 start_workers: int = 1, output_bytes_per_call: int = OUTPUT_BYTES_PER_CALL,
                 output_bytes_per_run: int = OUTPUT_BYTES_PER_RUN):
        check_names(tools, environment)
        if workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        self.tools = {t.name: t for t in tools}
        self.environment = environment
        self.methods = {t.name: t for t in environment.tools} if environment is not None else {}
        self.timeout_s = float(timeout_s)
        self.max_chars = int(max_chars)
        self.start_timeout_s = float(start_timeout_s)
        self._own_output = None
        self._budget: OutputBudget | None = None
        if output is None:
            output = subprocess.DEVNULL
        else:  # prints go through a pipe read here, bounded per call and per run
            if isinstance(output, (str, os.PathLike)):
                sink = self._own_output = open(output, "ab")  # noqa: SIM115 (closed in close())
            elif isinstance(output, int):
                sink = self._own_output = open(output, "ab", closefd=False)  # noqa: SIM115
            else:
                sink = getattr(output, "buffer", output)  # a text file's bytes
            self._budget = OutputBudget(sink, output_bytes_per_call, output_bytes_per_run, describe=_named)
            output = None
        # The user's modules are found where they were found when the tools were loaded,
        # whatever the working directory is when a child (re)starts.
        path = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
        env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
        self._specs = [t.spec for t in tools] + ([environment.spec] if environment is not None else [])
        self._children = [Contained(_TARGET, start_timeout_s=self.start_timeout_s, env=env, output=output,
                                    budget=self._budget, max_result_bytes=max(1 << 20, 16 * self.max_chars + 4096))
                          for _ in range(workers)]
        self._loaded = [False] * workers
        # one thread per child: what is sent to a child runs in the order sent, never two at once
        self._lanes = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"shardwise-tools-{i}")
                       for i in range(workers)]
        self._queued = [0] * workers
        """Payloads sent to each child's thread and not yet answered (plain calls: the one it runs)."""
        self._tasks = [0] * workers
        """Tasks queued on each child's thread or running there; each ends by taking plain
        calls (`_drain`) until none waits, and its count drops when it found none."""
        self._pending: deque[tuple[dict, _Taken]] = deque()
        """Plain calls that no child took yet: the first child free takes the first."""
        self._lock = threading.Lock()
        self._envs: set[str] = set()
        """Trajectories whose environment was constructed and reset."""
        self._failed: dict[str, str] = {}
        """Trajectory -> why its environment could not be started."""
        self.reward_errors: dict[str, str] = {}
        """Trajectory -> why its reward() gave no value (the last `reward` call's)."""
        self._closed = False
        self._grown = 0
        """Children 0 .. _grown - 1 were started for plain calls (the pool grows as they are all busy)."""
        for _ in range(min(int(start_workers), workers)):
            self._grow()

    # ------------------------------------------------------------------ the API
    def reset(self, traj_ids: list[str], rows: list[dict]) -> list[str | None]:
        """One environment per trajectory in `traj_ids`, constructed and reset with its data
        record `rows[i]` (the fields ``reset`` takes; all for ``**kwargs``); the first
        observations (None: none, or no environment). An environment that could not be
        constructed or reset gives None, and its trajectory's calls are answered with the
        reason."""
        if len(traj_ids) != len(rows):
            raise ValueError(f"reset got {len(traj_ids)} trajectory ids and {len(rows)} rows")
        if self.environment is None:
            return [None] * len(traj_ids)
        jobs = []
        for traj, row in zip(traj_ids, rows, strict=True):
            self._envs.discard(traj)
            self._failed.pop(traj, None)
            jobs.append((self._pin(traj), {"op": "reset", "env": self.environment.spec, "traj": traj,
                                           "row": _plain(row), "max_chars": self.max_chars}))
        out: list[str | None] = []
        for traj, outcome in zip(traj_ids, self._run(jobs), strict=True):
            answer = _answer(outcome, f"the environment {self.environment.spec}", self.timeout_s)
            if answer.status == "ok":
                self._envs.add(traj)
                first = outcome.value.get("text")
                out.append(readable(first) if isinstance(first, str) else None)
            else:
                self._failed[traj] = answer.text.removeprefix("error: ")
                out.append(None)
        return out

    def call(self, calls: list[tuple[str, ToolCall, dict]]) -> list[ToolResult]:
        """The results of `calls`, ``(trajectory id, call, extra keyword arguments from the
        data)`` each, in order; run concurrently over the children, each bounded by
        ``timeout_s``. A trajectory's calls of its environment run in the order given.
        `collect` of `submit`."""
        return self.collect(self.submit(calls))

    def submit(self, calls: list[tuple[str, ToolCall, dict]]) -> Submitted:
        """Send `calls` (as `call` takes them) to the children and return at once; their
        results come from `collect`. Calls submitted earlier that are still queued run
        first in the children they went to."""
        early: list[ToolResult | None] = [None] * len(calls)
        jobs: list[tuple[int, dict]] = []
        where: list[int] = []
        plain: list[tuple[int, dict]] = []
        for i, (traj, call, extra) in enumerate(calls):
            refused = self._refuse(traj, call)
            if refused is not None:
                early[i] = refused
                continue
            payload = {"arguments": _plain(call.arguments), "extra": _plain(extra) if extra else {},
                       "max_chars": self.max_chars}
            if call.name in self.tools:
                plain.append((i, {"op": "call", "spec": self.tools[call.name].spec, "name": call.name, **payload}))
            else:
                jobs.append((self._pin(traj), {"op": "env_call", "traj": traj, "method": call.name, **payload}))
                where.append(i)
        sent = self._submit(jobs)
        if plain:  # the first child free takes each (started ones, and more started for them)
            taken, bound = self._enqueue([payload for _, payload in plain])
            sent.parts += [(f, [len(jobs) + k], None) for k, f in enumerate(taken)]
            sent.count += len(plain)
            if bound > sent.bound_s:
                sent.bound_s, sent.deadline = bound, time.monotonic() + bound
        return Submitted(list(calls), early, where + [i for i, _ in plain], sent)

    def collect(self, submitted: Submitted) -> list[ToolResult]:
        """The results of the calls `submitted` (`submit`), in their order: waits for those
        still running (each bounded by ``timeout_s`` in its child)."""
        results = list(submitted.early)
        for i, outcome in zip(submitted.where, self._collect(submitted.jobs), strict=True):
            results[i] = _answer(outcome, submitted.calls[i][1].name, self.timeout_s, self.max_chars)
        return results  # type: ignore[return-value]

    def done(self, submitted: Submitted) -> bool:
        """Every call of `submitted` is answered (`collect` returns at once)."""
        return all(f.done() for f, _, _ in submitted.jobs.parts)

    def wait_any(self, submitted: list[Submitted]) -> None:
        """Wait until one of `submitted` is `done` (none: return at once). Bounded like
        `collect`: past the earliest bound of theirs, RuntimeError naming the tool worker(s)
        that did not answer."""
        if not submitted or any(self.done(s) for s in submitted):
            return
        first = min(submitted, key=lambda s: s.jobs.deadline)
        pending = {f for s in submitted for f, _, _ in s.jobs.parts if not f.done()}
        with self._children_killed_on_interrupt():
            while not any(self.done(s) for s in submitted):
                left = first.jobs.deadline - time.monotonic()
                if left <= 0:
                    self._collect(first.jobs)  # raises: a worker of it did not answer in time
                    return
                _, pending = concurrent.futures.wait(pending, timeout=left,
                                                     return_when=concurrent.futures.FIRST_COMPLETED)

    @property
    def processes(self) -> int:
        """Tool processes running now (they start as calls need them, see the module docstring)."""
        return sum(child.running for child in self._children)

    @property
    def ready(self) -> int:
        """Tool processes that have imported the tools (they take calls without a start)."""
        return sum(self._loaded)

    def reward(self, traj_ids: list[str]) -> list[float | None]:
        """Each trajectory's environment's ``reward()`` (None: no environment or no reward,
        or it failed: `reward_errors` says why)."""
        self.reward_errors = {}
        if self.environment is None or not self.environment.has_reward:
            return [None] * len(traj_ids)
        out: list[float | None] = [None] * len(traj_ids)
        jobs, where = [], []
        for i, traj in enumerate(traj_ids):
            if traj in self._envs:
                jobs.append((self._pin(traj), {"op": "reward", "traj": traj}))
                where.append(i)
            else:
                self.reward_errors[traj] = self._failed.get(traj, _NO_ENVIRONMENT)
        for i, outcome in zip(where, self._run(jobs), strict=True):
            answer = _answer(outcome, f"{self.environment.spec}.reward", self.timeout_s)
            if answer.status == "ok":
                out[i] = float(outcome.value["value"])
            else:
                self.reward_errors[traj_ids[i]] = answer.text.removeprefix("error: ")
        return out

    def end(self, traj_ids: list[str]) -> None:
        """Close (their ``close()``, if any) and forget those trajectories' environments."""
        jobs = []
        for traj in traj_ids:
            self._failed.pop(traj, None)
            if traj in self._envs:
                self._envs.discard(traj)
                jobs.append((self._pin(traj), {"op": "end", "traj": traj}))
        self._run(jobs)

    def close(self) -> None:
        """Kill every child with what it started; safe to call twice. Calls submitted and
        not collected are cut short (their children are killed)."""
        if self._closed:
            return
        self._closed = True
        # The children first, while the threads that started them live: a child dies with the
        # thread that started it (PR_SET_PDEATHSIG), and what its code started would be
        # orphaned past the reach of the kill below had its tree died that way first.
        close_all(self._children)
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            waiting, self._pending = list(self._pending), deque()
        for _, future in waiting:  # taken by no child: cut short
            if future.set_running_or_notify_cancel():
                future.set_result(Outcome("crash", reason="the tool runner was closed"))
        close_all(self._children)  # a call still running ends with its child...
        for lane in self._lanes:  # ...so its thread ends (and starts no child: _serve checks _closed)
            lane.shutdown(wait=True)
        close_all(self._children)
        killed = self.killed
        if killed:  # one note for the run: what the tools left running
            note = (f"the tools left {killed} processes running (started by a call and not ended, or escaped "
                    "into a session of their own); they were killed")
            logging.getLogger(__name__).warning("%s", note)
            if self._budget is not None:
                self._budget._note(note)
        if self._budget is not None:
            self._budget.close()
        if self._own_output is not None:
            self._own_output.close()

    @property
    def killed(self) -> int:
        """Processes the tools started that had to be killed (left running by a call that
        returned, or escaped from a process that was stopped), over the runner's life."""
        return sum(child.killed for child in self._children)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inside
    def _pin(self, traj: str) -> int:
        return zlib.crc32(str(traj).encode()) % len(self._children)

    def _refuse(self, traj: str, call: ToolCall) -> ToolResult | None:
        """The result of a call answered without running it, or None."""
        if call.error is not None:
            return ToolResult(self._cut(f"error: {call.error}"), "error")
        if call.name in self.tools:
            return None
        if call.name in self.methods:
            if traj in self._failed:
                return ToolResult(self._cut(f"error: the environment of this trajectory could not be started: "
                                            f"{self._failed[traj]}"), "error")
            if traj not in self._envs:
                return ToolResult(self._cut(f"error: {_NO_ENVIRONMENT}"), "error")
            return None
        names = [*self.tools, *self.methods]
        hint = did_you_mean(call.name, names) if names else "there are no tools"
        return ToolResult(self._cut(f"error: unknown tool {call.name!r}" + (f" ({hint})" if hint else "")),
                          "error")

    def _cut(self, text: str) -> str:
        return text[:self.max_chars]

    def _run(self, jobs: list[tuple[int, dict]]) -> list[Outcome]:
        """The outcomes of `jobs` (``(child, payload)``), in order: each child's payloads in
        its thread, in order."""
        return self._collect(self._submit(jobs))

    def _submit(self, jobs: list[tuple[int, dict]]) -> _Jobs:
        """`jobs` (``(child, payload)``) queued on their children's threads."""
        if jobs and self._closed:
            raise RuntimeError("the ToolRunner is closed")
        groups: dict[int, list[int]] = {}
        for j, (worker, _) in enumerate(jobs):
            groups.setdefault(worker, []).append(j)
        with self._lock:
            ahead = {w: self._queued[w] + len(idx) for w, idx in groups.items()}
            for w, idx in groups.items():
                self._queued[w] += len(idx)
        parts = [(self._lane_task(w, self._serve_counted, w, [jobs[j][1] for j in idx]), idx, w)
                 for w, idx in groups.items()]
        # Each payload is bounded by the children (timeout_s after the previous answer, a
        # start by start_timeout_s), those queued before it in its child included; this
        # bound only catches a runner bug.
        bound = max(ahead.values(), default=0) * self._per_payload_s() + BOUND_SLACK_S
        return _Jobs(parts, len(jobs), bound, time.monotonic() + bound)

    def _per_payload_s(self) -> float:
        return self.timeout_s + self.start_timeout_s + BOUND_PER_CALL_S

    def _enqueue(self, payloads: list[dict]) -> tuple[list[_Taken], float]:
        """Plain calls queued for the first child free: the futures of their outcomes and
        the bound on their answers. Idle children are woken to take them; more start (up to
        `workers`) while the calls waiting outnumber the children without a call, so that
        N slow calls sent together run at once (a new child imports the tools first, then
        takes what is still waiting: a call never waits for a start while a child is free)."""
        if self._closed:
            raise RuntimeError("the ToolRunner is closed")
        futures = [_Taken() for _ in payloads]
        with self._lock:
            self._pending.extend(zip(payloads, futures, strict=True))
            waiting = len(self._pending)
            ahead = waiting + sum(self._queued)
            free = [w for w in range(self._grown) if not self._queued[w]]
            grow = max(0, min(waiting - len(free), len(self._children) - self._grown))
            wake = [w for w in free if not self._tasks[w]][:waiting]
            for w in wake:
                self._tasks[w] += 1
        for w in wake:
            self._lanes[w].submit(self._task, w, None)
        for _ in range(grow):
            self._grow()
        # each payload waiting or queued before these may take a child's turn (the runner-bug bound)
        free_after = max(1, len(free) + grow)
        return futures, -(-ahead // free_after) * self._per_payload_s() + BOUND_SLACK_S

    def _lane_task(self, worker: int, fn: Callable, *args: Any) -> concurrent.futures.Future:
        """`fn(*args)` on child `worker`'s thread, followed by `_drain` (so the thread takes
        the plain calls waiting once it is free)."""
        with self._lock:
            self._tasks[worker] += 1
        return self._lanes[worker].submit(self._task, worker, fn, *args)

    def _task(self, worker: int, fn: Callable | None, *args: Any) -> Any:
        try:
            return fn(*args) if fn is not None else None
        finally:
            self._drain(worker)

    def _drain(self, worker: int) -> None:
        """In child `worker`'s thread: run the plain calls waiting, one at a time, until none
        is left; then the thread counts as idle (in the same lock as the look that found
        none, so a call queued meanwhile wakes it)."""
        while True:
            with self._lock:
                # payloads pinned to this child (an environment's) go first: their task drains after them
                if self._closed or not self._pending or self._queued[worker]:
                    self._tasks[worker] -= 1
                    return
                payload, future = self._pending.popleft()
                self._queued[worker] += 1
            future.worker = worker
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        (outcome,) = self._serve(worker, [payload])
                    except BaseException as e:  # a runner bug: the caller's collect raises it
                        future.set_exception(e)
                    else:
                        future.set_result([outcome])
            finally:
                with self._lock:
                    self._queued[worker] -= 1
                self._rewarm(worker)

    def _collect(self, sent: _Jobs) -> list[Outcome]:
        """The outcomes of the payloads `sent`, in the order submitted, once all are answered."""
        if not sent.count:
            return []
        with self._children_killed_on_interrupt():
            _, pending = concurrent.futures.wait([f for f, _, _ in sent.parts],
                                                 timeout=max(0.0, sent.deadline - time.monotonic()))
        if pending:
            stuck: set[int] = set()
            for f, _, w in sent.parts:
                if f in pending:
                    taken = getattr(f, "worker", None)
                    # a plain call no child took: every child started could have
                    stuck |= {w} if w is not None else {taken} if taken is not None else set(range(self._grown))
                    f.cancel()
            for w in sorted(stuck):
                self._children[w].close()
            raise RuntimeError(f"tool worker(s) {sorted(stuck)} did not answer within {sent.bound_s:g} s")
        out: list[Outcome | None] = [None] * sent.count
        for f, idx, _ in sent.parts:
            for j, outcome in zip(idx, f.result(), strict=True):
                out[j] = outcome
        return out  # type: ignore[return-value]

    @contextlib.contextmanager
    def _children_killed_on_interrupt(self) -> Iterator[None]:
        """A wait on the children's threads; an interrupt (Ctrl-C) in it kills the children,
        so their threads wake and end."""
        try:
            yield
        except BaseException:
            for child in self._children:
                child.close()
            raise

    def _grow(self) -> None:
        """Start one more child for plain calls, its tools imported in its thread meanwhile."""
        worker = self._grown
        self._grown += 1
        self._children[worker].start()
        self._lane_task(worker, self._warm_up, worker)

    def _warm_up(self, worker: int) -> None:
        """In child `worker`'s thread: import the tools (`_serve`'s first step), so that the
        child takes calls without a start."""
        if not self._closed and not self._loaded[worker]:
            self._load(worker)

    def _load(self, worker: int) -> Outcome:
        """Child `worker` (started if it has no process) imports the user's modules; whether
        it did is `_loaded[worker]`."""
        started = self._children[worker].call({"op": "load", "specs": self._specs}, self.start_timeout_s)
        self._loaded[worker] = started.ok
        return started

    def _serve_counted(self, worker: int, payloads: list[dict]) -> list[Outcome]:
        try:
            return self._serve(worker, payloads)
        finally:
            with self._lock:
                self._queued[worker] -= len(payloads)
            self._rewarm(worker)

    def _rewarm(self, worker: int) -> None:
        """A child for plain calls whose process ended: a fresh one, importing the tools."""
        if worker < self._grown and not self._loaded[worker] and not self._closed:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self._lane_task(worker, self._warm_up, worker)

    def _serve(self, worker: int, payloads: list[dict]) -> list[Outcome]:
        """`payloads` run in child `worker`, in order. A payload that timed out or crashed
        ends that child; the payloads after it go to a fresh one (where the environments of
        the old one are lost)."""
        child = self._children[worker]
        out: list[Outcome] = []
        while len(out) < len(payloads):
            if self._closed:  # closed while this ran: no fresh child
                return out + [Outcome("crash", reason="the tool runner was closed")] * (len(payloads) - len(out))
            if not self._loaded[worker]:
                started = self._load(worker)
                if not started.ok:  # the user's modules' import hung or ended the process (their errors are the calls')
                    failed = Outcome("crash", reason=f"the tool process could not start: {started.reason}")
                    return out + [failed] * (len(payloads) - len(out))
            got = child.map(payloads[len(out):], self.timeout_s)
            out.extend(got)
            if not got or got[-1].kind in ("timeout", "crash"):
                self._loaded[worker] = False
        return out


def _answer(outcome: Outcome, name: str, timeout_s: float, max_chars: int | None = None) -> ToolResult:
    """`outcome` of a request as the text the model reads."""
    if outcome.kind == "ok" and isinstance(outcome.value, dict) and outcome.value.get("status") in _STATUSES:
        status = outcome.value["status"]
        text = outcome.value.get("text")
        if status != "ok":
            text = f"error: {text}"
    elif outcome.kind == "timeout":
        status, text = "timeout", f"error: {name} did not return within {timeout_s:g} s (it was stopped)"
    elif outcome.kind == "crash":
        status, text = "crash", f"error: {name} crashed: {outcome.reason}"
    else:
        status, text = "error", f"error: {name} failed: {outcome.reason or 'no answer'}"
    if isinstance(text, str) and max_chars is not None:
        text = text[:max_chars]
    return ToolResult(readable(text) if isinstance(text, str) else "", status)


def readable(text: str) -> str:
    """`text` as the tokenizer can take it: what cannot be written as UTF-8 (a lone
    surrogate, e.g. ``"12\\udcff"`` from bytes decoded with ``surrogateescape``) becomes
    U+FFFD; a surrogate pair becomes its character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _named(payload: Any) -> str:
    """A payload sent to a tool process, named in a note (`OutputBudget`)."""
    if isinstance(payload, dict):
        name = payload.get("name") or payload.get("method") or payload.get("env") or payload.get("op")
        return f"a call of {name}" if payload.get("op") in ("call", "env_call") else f"{payload.get('op')} of {name}"
    return "a call"
