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
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

from shardwise.contained import kill_left_under
from shardwise.distributed.launch import describe_exit, kill_tree
from shardwise.rl.cluster import _is_ray_process
from shardwise.telemetry import activity

__all__ = ["abrupt_status", "record_said", "record_run_dir", "supervise"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
              # the terminal is gone: stop the run as cleanly as on SIGTERM
              signal.SIGHUP: signal.SIGTERM}
_SWEEP_S = 3.0
"""How long the parent keeps killing Ray's processes that appear under it after an abrupt end
(an agent orphaned by a dying raylet is reparented a moment later)."""


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


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
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
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


def _child(command: Callable[[], int], record: activity.SharedRecord, parent: int) -> int:
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
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
