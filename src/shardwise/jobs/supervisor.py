"""`shardwise rl` under a small supervising parent, for the ends no exception reports.

The RL controller runs user code in its own process: the reward function is called there
for every row. A function that calls ``os._exit(3)``, or a native library that crashes,
ends the controller with no line saying what happened, and Ray's agents, started by the
controller, kept running. `supervise` forks (before Ray, or anything of the run, exists)
into this parent and the controller child:

- the child runs the command in a session of its own (a Ctrl-C in the terminal reaches the
  parent alone, which passes it on: one signal, one path, as `shardwise train` does with
  torchrun); it dies with a SIGTERM when the parent is killed (it then stops like a
  SIGTERM: Ray stopped, the checkpoint named);
- SIGINT and SIGTERM sent to the parent are passed on to the child as they are (a second
  one too: the controller's shutdown counts them), SIGHUP as SIGTERM;
- the child records what it is doing in a page shared with the parent
  (`shardwise.telemetry.activity`: the reward function and the row) and, once its last
  line is printed, the status it ends with;
- the parent is the child subreaper of what the child started (Ray's processes come to
  it when the child dies); it kills Ray's processes of the run (and what a contained
  reward function started, `shardwise.contained.kill_left_under`); when the child ended
  without its line, it prints one line naming how the child ended and what it was doing,
  and exits with the child's status (`abrupt_status`).

`control` is the controller's side of the same ends: it imports the job (with ``ahead``,
while Ray's head starts beside the imports: `shardwise.rl.cluster.init_ray_while`; no Ray
worker starts before the checks pass, and a failed check stops Ray before its line), and
after the job's checks runs the RL job holding the run folder's lock, with SIGTERM taken as Ctrl-C, and stops Ray on the way out however the run
ends (`shardwise.rl.cluster.shutdown_ray`). An interrupt prints one line naming the signal
and the last committed checkpoint (exit 130 / 143); a worker's failure names the
checkpoint too; the traceback of a bug or of a worker is kept in the run folder.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from shardwise.checkpoint.layout import resume_line
from shardwise.config.schema import Config
from shardwise.contained import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, kill_left_under, prctl
from shardwise.data.reward_row import RewardFunctionError
from shardwise.distributed.capacity import check_plan
from shardwise.distributed.launch import describe_exit, kill_tree
from shardwise.errors import ShardwiseError
from shardwise.jobs.rundir import RunDirLock, check_run_dir, command_line, write_error_file
from shardwise.rl.cluster import WorkerError, _is_ray_process, init_ray_while, ray_cpus, shutdown_ray
from shardwise.rl.local import resolve_backend, start_pool, stop_pool
from shardwise.telemetry import activity
from shardwise.telemetry.logs import ThirdPartyToFile
from shardwise.telemetry.startup import StartupClock, launched_at

__all__ = ["abrupt_status", "control", "record_said", "record_run_dir", "supervise"]

_FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
              # the terminal is gone: stop the run as cleanly as on SIGTERM
              signal.SIGHUP: signal.SIGTERM}
_SWEEP_S = 3.0
"""How long the parent keeps killing Ray's processes that appear under it after an abrupt end
(an agent orphaned by a dying raylet is reparented a moment later)."""


def abrupt_status(waitstatus: int) -> int:
    """The exit status of a command whose controller ended without its line: the child's own
    status, 128 + N for a child killed by signal N, and 1 for a child that exited with 0
    (the run did not finish: nothing recorded that it did)."""
    code = os.waitstatus_to_exitcode(waitstatus)
    return 128 - code if code < 0 else code or 1


def supervise(command: Callable[[], int], what: str, checkpoint_line: Callable[[str], str]) -> int:
    """Run `command` (it returns an exit status, having printed its last line) in a forked
    child and return the status to exit with; see the module docstring. `what` names the
    child in the parent's line (``the RL controller``); `checkpoint_line(run_dir)` says where
    the run can resume from, for a run that recorded its ``run_dir`` (`record_run_dir`).
    On platforms without fork, `command` runs in this process."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return command()
    record = activity.SharedRecord()
    sys.stdout.flush()
    sys.stderr.flush()
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        return _child(command, record, parent)
    return _parent(child, record, what, checkpoint_line)


def record_run_dir(run_dir: str) -> None:
    """The run folder of the supervised command (for the parent's checkpoint line)."""
    record = activity.installed()
    if record is not None:
        record.update(run_dir=str(run_dir))


def record_said(status: int) -> None:
    """The supervised command has printed its last line and will end with `status`; what is
    left is clean-up (Ray's shutdown). Should a further signal end it there (a second
    SIGTERM inside Ray's own shutdown takes the default action), the parent adds no line of
    its own: it stops Ray's leftovers and exits with `status`."""
    record = activity.installed()
    if record is not None:
        record.finish(status)


def control(job_name: str, cfg: Config, nproc: int, ahead: bool = False) -> int:
    """`shardwise rl` in this process, the single controller over `nproc` Ray workers: the
    job module `job_name` (``shardwise.jobs.rl``, imported here: torch, transformers and the
    workers' code; with `ahead` and no ``RAY_ADDRESS``, while a local Ray's head starts
    beside the imports), its ``prepare(cfg, nproc, clock)`` (input errors exit 2 here, before
    any Ray worker starts; Ray's head, when started ahead, is stopped first), the capacity
    line, then ``run(prepared)`` as the module docstring says; the job's ``report(cfg,
    summary)`` prints the summary of a run that ended, after Ray stopped and the run
    folder's lock was released. Returns the exit status."""
    run_dir = cfg.run.dir
    check_run_dir(run_dir)
    RunDirLock(run_dir, command_line()).check_free()
    record_run_dir(run_dir)  # for a supervising parent's line, should this process end abruptly
    clock = StartupClock(launched_at())
    local = resolve_backend(cfg) == "local"
    # a cluster is joined after the checks; without Ray (rl.backend local) there is none to start
    ahead = ahead and not local and not os.environ.get("RAY_ADDRESS")
    held = _held_log() if ahead else None
    try:
        with ThirdPartyToFile(held) if held else contextlib.nullcontext():
            job = _import_job(job_name, cfg, nproc, ahead, clock)
        if local:  # the ranks' processes, forked while nothing but this thread runs (`start_pool`)
            clock.lap("launch")
            start_pool(ray_cpus(cfg, nproc))
        prepared = job.prepare(cfg, nproc, clock)
    except BaseException:
        if ahead:  # nothing of Ray's is left when a check fails
            shutdown_ray()
        if local:  # nor a rank's process
            stop_pool()
        if held:
            held.unlink(missing_ok=True)
        raise
    print(check_plan(nproc, prepared.plan, cfg.fsdp.offload.enabled).line(), file=sys.stderr)
    interrupts: list[str] = []
    with RunDirLock(run_dir, command_line()), _signals_as_interrupt(interrupts), _workers_stopped(interrupts):
        if held:
            _keep_log(held, Path(run_dir) / "logs" / "controller.log")
        try:
            summary = job.run(prepared)
        except KeyboardInterrupt:
            sig = interrupts[-1] if interrupts else "SIGINT"
            status = 143 if sig == "SIGTERM" else 130
            print(f"\nshardwise: interrupted by {sig}; {resume_line(run_dir)}", file=sys.stderr, flush=True)
            record_said(status)  # a signal during Ray's shutdown below ends it with this status, no other line
            return status
        except Exception as e:
            if not isinstance(e, ShardwiseError):  # a bug or a worker's: its traceback is kept
                e.error_file = write_error_file(run_dir, "the controller" if not isinstance(e, WorkerError)
                                                else "a worker", "".join(traceback.format_exception(e)))
            if isinstance(e, RewardFunctionError):  # the user's function stopped the run: where to resume from
                raise RewardFunctionError(f"{e}; {resume_line(run_dir)}") from e
            if isinstance(e, WorkerError):  # a worker failed or was lost with its node: where to resume from
                resume = WorkerError(f"{e}; {resume_line(run_dir)}")
                resume.error_file = e.error_file
                raise resume from e
            raise
    job.report(cfg, summary)
    return 0


def _held_log() -> Path:
    """A file outside the run folder for the libraries' log lines and warnings while Ray
    starts ahead (Ray's start-up notes: the console shows only the checks' line, and nothing
    of the run is written before the checks pass); kept with the run's once they passed."""
    fd, path = tempfile.mkstemp(prefix="shardwise-startup-", suffix=".log")
    os.close(fd)
    return Path(path)


def _keep_log(held: Path, log: Path) -> None:
    """`held` appended to `log` (``run.dir/logs/controller.log``, where the rest of the
    controller's third-party lines go) and removed."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as out:
            out.write(held.read_text(encoding="utf-8", errors="replace"))
    except OSError:  # the lines are notes, the run goes on without them
        pass
    held.unlink(missing_ok=True)


def _import_job(name: str, cfg: Config, nproc: int, ahead: bool, clock: StartupClock) -> ModuleType:
    """The job module `name`; with `ahead` imported while a local Ray's head starts, the
    seconds Ray took beyond the imports charged to the start-up part ``ray`` (the imports
    and what came before are ``launch``)."""
    if not ahead:
        return importlib.import_module(name)
    cpus = ray_cpus(cfg, nproc)  # a config error here is the job's first check's: before Ray starts
    job, ray_past_imports = init_ray_while(lambda: importlib.import_module(name), cpus)
    clock.lap("launch")
    clock.split("launch", {"ray": ray_past_imports})
    return job


@contextlib.contextmanager
def _workers_stopped(interrupts: list[str]) -> Iterator[None]:
    """The local ranks' processes (`stop_pool`) and Ray are stopped on the way out of the
    block however it ends (`shutdown_ray`: more signals during the shutdown do not
    interrupt it, a third kills what is left; after an interrupt, signals until the process
    ends only say it is ending)."""
    try:
        yield
    finally:
        stop_pool()  # the local ranks' processes a group did not end (rl.backend local)
        shutdown_ray(restore_signals=not interrupts)


@contextlib.contextmanager
def _signals_as_interrupt(seen: list[str]) -> Iterator[None]:
    """SIGTERM ends the controller like Ctrl-C: the worker groups are stopped on the way out.
    The names of the signals received are appended to `seen`."""
    def handler(signum, _frame):
        seen.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            if not seen:
                signal.signal(sig, h)
            elif signal.getsignal(sig) is handler:  # interrupted and ending: more signals change nothing
                signal.signal(sig, signal.SIG_IGN)


def _child(command: Callable[[], int], record: activity.SharedRecord, parent: int) -> int:
    os.setsid()
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(143)
    activity.install(record)
    try:
        status = command()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # a bug: the interpreter's report, which is this child's last word
        record.finish(None)
        raise
    record.finish(status)
    return status


def _parent(child: int, record: activity.SharedRecord, what: str, checkpoint_line: Callable[[str], str]) -> int:
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(child, _FORWARDED[signal.Signals(signum)])

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    _, waitstatus = os.waitpid(child, 0)  # retried after each forwarded signal (PEP 475)
    # From here on the outcome is decided: a signal only ends the clean-up sooner.
    for sig in _FORWARDED:
        signal.signal(sig, signal.SIG_IGN)
    seen = record.read()
    _kill_ray_left()
    if seen.get("said"):
        status = seen.get("status")
        return status if isinstance(status, int) else os.waitstatus_to_exitcode(waitstatus) or 1
    doing = seen.get("doing")
    run_dir = seen.get("run_dir")
    parts = [f"{what} (pid {child}) {describe_exit(os.waitstatus_to_exitcode(waitstatus))}"
             + (f" in {doing}" if doing else "")
             + " without an error shardwise could report (user code calling os._exit, or a crash)",
             "Ray's processes of the run were stopped"]
    if run_dir:
        with contextlib.suppress(Exception):  # the line is said either way
            parts.append(checkpoint_line(run_dir))
    print(f"\nshardwise: {'; '.join(parts)}", file=sys.stderr, flush=True)
    return abrupt_status(waitstatus)


def _kill_ray_left() -> None:
    """Kill Ray's processes under this one (the dead child's, reparented here) and reap
    them, until a look finds none or `_SWEEP_S` passed (an agent of a dying raylet may
    still be on its way here)."""
    deadline = time.monotonic() + _SWEEP_S
    killed: set[int] = set()
    while True:
        try:
            new = set(kill_tree(os.getpid(), only=_is_ray_process)) - killed  # a killed one may linger a moment
            # and what a contained reward function started (reparented here with its child gone)
            new |= set(kill_left_under(os.getpid())) - killed
        except OSError:  # /proc unreadable: nothing more can be done
            return
        _reap()
        if not new or time.monotonic() >= deadline:
            return
        killed |= new
        time.sleep(0.1)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
