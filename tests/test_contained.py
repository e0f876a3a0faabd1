"""`shardwise.contained`: user code in a killable child. Each probe is code a user could
write (or a library it calls): it catches every exception around a sleep, ignores SIGALRM,
kills its parent, ends its process, starts processes in a session of their own, returns
what is not JSON or too much. Every call ends in an Outcome within its timeout, and
nothing the code started is left once the child is closed."""

from __future__ import annotations

import os
import signal
import textwrap
import time
import uuid

import pytest
from dist.launcher import alive

from shardwise.contained import Contained

PROBES = """
import os, signal, subprocess, time

def double(x):
    return 2 * x

def swallows(x):  # every exception caught, the old SIGALRM timeout included
    while True:
        try:
            time.sleep(3600)
        except BaseException:
            pass

def ignores_alarm(x):  # as some scoring libraries' own timers leave it
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(3600)

def kills_parent(x):
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)

def leaves(x):
    os._exit(3)

def raises(x):
    raise ValueError(f"cannot score {x}")

def prints():
    import sys
    print("a" * 100_000)
    print("b", file=sys.stderr)
    return 0

def not_json(x):
    return object()

def megabytes(x):
    return "a" * (4 << 20)

def starts(pids_file, hang):  # one in its session, one in a session of its own
    a = subprocess.Popen(["sleep", "600"])
    b = subprocess.Popen(["sleep", "600"], start_new_session=True)
    with open(pids_file, "w") as f:
        f.write(f"{a.pid} {b.pid}")
    if hang:
        swallows(0)
    return 0
"""


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """The probes' module name, importable from the working directory (as users' are)."""
    name = f"probes_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PROBES))
    monkeypatch.chdir(tmp_path)
    return name


@pytest.mark.parametrize("fn,kind,words", [
    ("swallows", "timeout", "did not return within 0.5 s"),
    ("ignores_alarm", "timeout", "did not return within 0.5 s"),
    ("kills_parent", "crash", "its process was killed by SIGKILL"),
    ("leaves", "crash", "its process exited with status 3"),
    ("raises", "error", "ValueError: cannot score 1"),
    ("not_json", "error", "TypeError: Object of type object is not JSON serializable"),
    ("megabytes", "error", "over the limit of 1048576"),
])
def test_every_call_ends_in_an_outcome_and_the_next_call_works(fn, kind, words, probes):
    with Contained(f"{probes}:{fn}") as child:
        t0 = time.monotonic()
        out = child.map([1, 2], timeout_s=0.5)
        assert out[0].kind == kind and words in out[0].reason, out
        # a timeout or a crash stops the batch there; an error does not
        assert len(out) == (2 if kind == "error" else 1), out
        assert time.monotonic() - t0 < 30
    with Contained(f"{probes}:double") as child:
        assert [o.value for o in child.map([1, 2, 3], timeout_s=30)] == [2, 4, 6]


def test_what_the_code_prints_goes_to_its_output(probes, tmp_path):
    with open(tmp_path / "log", "w") as log, Contained(f"{probes}:prints", output=log) as child:
        assert child.call([], timeout_s=30).value == 0
    assert (tmp_path / "log").read_text() == "a" * 100_000 + "\nb\n"


@pytest.mark.parametrize("end", ["close", "timeout"])
def test_what_the_code_started_is_gone_when_the_child_is_stopped(end, probes, tmp_path):
    """Processes the code started, in its session or a session of their own, are gone once
    the child is closed (the end of a job) or killed for a timeout."""
    pids_file = tmp_path / "pids"
    with Contained(f"{probes}:starts") as child:
        out = child.call([str(pids_file), end == "timeout"], timeout_s=2)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert out.kind == ("timeout" if end == "timeout" else "ok"), out
        if end == "close":
            assert len(alive(pids)) == 2
    deadline = time.monotonic() + 10
    while alive(pids):
        assert time.monotonic() < deadline, f"left running: {alive(pids)}"
        time.sleep(0.05)


def test_an_interrupt_while_waiting_kills_the_child(probes):
    """Ctrl-C in the caller (here a KeyboardInterrupt from a timer) while the code hangs:
    the child is killed and the interrupt goes on."""
    child = Contained(f"{probes}:swallows")
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        child.start()
        keeper = child._proc.pid
        with pytest.raises(KeyboardInterrupt):
            child.map([1], timeout_s=None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert child._proc is None and not alive([keeper])


def test_a_subreaper_finds_what_a_dead_child_left(probes, tmp_path):
    """What a child's code started carries the child's mark: `kill_left_under` (the RL
    supervisor's sweep, for a controller that died with its child) kills it, not others."""
    import subprocess

    from shardwise.contained import kill_left_under

    other = subprocess.Popen(["sleep", "600"])
    child = Contained(f"{probes}:starts")
    try:
        assert child.call([str(tmp_path / "pids"), False], timeout_s=30).ok
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        killed = kill_left_under(os.getpid())
        assert set(pids) <= set(killed) and other.pid not in killed
        deadline = time.monotonic() + 10
        while alive(pids):
            assert time.monotonic() < deadline, f"left running: {alive(pids)}"
            time.sleep(0.05)
        assert alive([other.pid])
    finally:
        child.close()
        other.kill()
        other.wait()
