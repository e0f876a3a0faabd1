"""What a hostile or careless tool (or reward module) still broke (issue 50, findings 1-5),
each with real tool processes and small modules written into tmp_path:

1. a module whose import never returns: the check imports it in a child with a bound (one
   line naming the module and the bound, exit 2; Ctrl-C there: one line, exit 130);
2. a tool that starts a child in a session of its own with an empty environment and then
   kills its keeper: the child is killed, and what had to be killed is counted in one note;
3. a tool that returns (or raises with) a lone surrogate: text the tokenizer reads;
4. a tool that prints megabytes per call: its log holds a bounded share, with a note of
   how much was dropped;
5. slow calls run at the same time: N calls sleeping S each overlap and take well under
   N * S / 2 from a runner that has one process started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import threading
import time
import uuid

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, alive

from shardwise.agents.execute import ToolResult, ToolRunner
from shardwise.agents.parsers import ToolCall
from shardwise.agents.tools import load_environment, load_tools
from shardwise.cli import main
from shardwise.contained import descendants
from shardwise.data.rewards import resolve_reward_fn
from shardwise.errors import ConfigError

IMPORT_TIMEOUT_ENV = "SHARDWISE_IMPORT_TIMEOUT_S"
"""The bound on one user module's import during the checks (`shardwise.data.rewards`)."""

TOOLS = '''
import os, signal, subprocess, sys, time

def escapes(path: str) -> str:
    """Start a process in a session of its own with an empty environment, kill the keeper.

    Args:
        path: where to write its pid
    """
    p = subprocess.Popen(["sleep", "600"], start_new_session=True, env={})
    with open(path, "w") as f:
        f.write(str(p.pid))
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)
    return ""

def leaves(path: str) -> str:
    """Start a process and return while it runs.

    Args:
        path: where to write its pid
    """
    p = subprocess.Popen(["sleep", "600"], env={})
    with open(path, "w") as f:
        f.write(str(p.pid))
    return "started"

def surrogate(raises: bool) -> str:
    """Return (or raise with) a lone surrogate.

    Args:
        raises: raise instead of returning
    """
    if raises:
        raise ValueError("bad \\udcff byte")
    return "12\\udcff"

def floods(x: int) -> str:
    """Print 4 MiB to stdout and 4 MiB to stderr.

    Args:
        x: anything
    """
    for _ in range(4):
        sys.stdout.write("a" * (1 << 20))
        sys.stderr.write("b" * (1 << 20))
    return "done"

def slow(folder: str, seconds: float) -> str:
    """Sleep, recording when the call started and ended.

    Args:
        folder: where to record
        seconds: how long to sleep
    """
    start = time.time()
    time.sleep(seconds)
    with open(os.path.join(folder, f"{os.getpid()}-{start}"), "w") as f:
        f.write(f"{start} {time.time()}")
    return "slept"

class Env:
    def reset(self, **row):
        return "start \\udcff"

    def look(self) -> str:
        """Look."""
        return "ok"
'''


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile_tools")
    name = f"hostile_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(textwrap.dedent(TOOLS))
    (folder / f"{name}_hangs.py").write_text(
        "import time\nwhile True:\n    try:\n        time.sleep(1)\n    except BaseException:\n        pass\n\n"
        "def calculator(expression: str) -> str:\n    \"\"\"Calc.\n\n    Args:\n        expression: e\n    \"\"\"\n"
        "    return expression\n\ndef fn(prompt, response, ground_truth):\n    return 0.0\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        yield name


def _one(runner, name, **arguments) -> ToolResult:
    return runner.call([("t", ToolCall(name, arguments), {})])[0]


# ---------------------------------------------------------------- 1. imports that never return


@pytest.mark.timeout(120, method="thread")  # a hung import swallows SIGALRM
def test_a_module_whose_import_never_returns_is_one_line_naming_it_and_the_bound(mod, monkeypatch):
    monkeypatch.setenv(IMPORT_TIMEOUT_ENV, "2")
    before = set(descendants(os.getpid()))  # what earlier tests of this worker left running (the forkserver)
    hangs = f"{mod}_hangs"
    for check in (lambda: load_tools([f"{hangs}:calculator"]), lambda: resolve_reward_fn(f"{hangs}:fn")):
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            check()
        assert time.monotonic() - t0 < 60
        line = str(e.value)
        assert "\n" not in line and f"'{hangs}'" in line and "2 s" in line and IMPORT_TIMEOUT_ENV in line, line
        assert hangs not in __import__("sys").modules
    assert not set(alive(descendants(os.getpid()))) - before  # the child that imported it is gone


@pytest.mark.timeout(120, method="thread")  # a hung import swallows SIGALRM
def test_the_cli_says_one_line_and_exits_2_or_130_on_ctrl_c(mod, monkeypatch, capsys, tmp_path):
    """Through `shardwise infer`'s checks: the hung import is one line naming the module,
    exit 2; Ctrl-C (a real SIGINT) while the check waits is one line, exit 130."""
    example = str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")
    argv = ["infer", example, "model.path=null", TINY_QWEN3, f"run.dir={tmp_path / 'run'}",
            "infer.multi_turn.enabled=true", f"infer.tools=[{mod}_hangs:calculator]", "--nproc", "1"]
    monkeypatch.setenv(IMPORT_TIMEOUT_ENV, "2")
    before = set(descendants(os.getpid()))  # what earlier tests of this worker left running (the forkserver)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and f"{mod}_hangs" in err and "2 s" in err, err
    monkeypatch.setenv(IMPORT_TIMEOUT_ENV, "100")

    def ctrl_c_once_it_imports() -> None:  # SIGINT as a terminal sends it, once the hung import runs
        for _ in range(1200):
            for p in descendants(os.getpid()):
                with contextlib.suppress(OSError), open(f"/proc/{p}/cmdline", "rb") as f:
                    if f"{mod}_hangs".encode() in f.read():
                        time.sleep(0.5)
                        os.kill(os.getpid(), signal.SIGINT)
                        return
            time.sleep(0.05)

    timer = threading.Thread(target=ctrl_c_once_it_imports, daemon=True)
    timer.start()
    code = main(argv)
    timer.join()
    out, err = capsys.readouterr()
    assert code == 130 and len(err.strip().splitlines()) == 1 and "interrupted" in err, (code, err)
    assert f"{mod}_hangs" in err and not (tmp_path / "run").exists()
    assert not set(alive(descendants(os.getpid()))) - before


# ---------------------------------------------------------------- 2. processes that escape


def test_what_a_tool_started_is_killed_even_when_it_killed_its_keeper_and_counted(mod, tmp_path):
    log = tmp_path / "tools.log"
    before = set(descendants(os.getpid()))
    r = ToolRunner(load_tools([f"{mod}:escapes", f"{mod}:leaves"]), None, timeout_s=10, workers=2, output=log)
    pids = []
    try:
        res = _one(r, "escapes", path=str(tmp_path / "a"))
        assert res.status == "crash", res
        pids.append(int((tmp_path / "a").read_text()))
        assert _one(r, "leaves", path=str(tmp_path / "b")) == ToolResult("started", "ok")
        pids.append(int((tmp_path / "b").read_text()))
        deadline = time.monotonic() + 10  # the escaped one is killed when its keeper died, not at close
        while alive(pids[:1]):
            assert time.monotonic() < deadline, f"left running: {alive(pids)}"
            time.sleep(0.05)
        assert alive(pids[1:])  # a process started by a call that returned runs until the end
        r.close()
        assert not alive(pids)
        assert r.killed == 2
        notes = [x for x in log.read_text().splitlines() if "killed" in x]
        assert len(notes) == 1 and "2 processes" in notes[0], notes
    finally:
        r.close()
        for p in alive(pids):
            os.kill(p, signal.SIGKILL)
    assert not set(alive(descendants(os.getpid()))) - before


# ---------------------------------------------------------------- 3. text the tokenizer cannot take


def test_whatever_a_tool_returns_is_text_the_tokenizer_reads(mod, qwen_tool_tokenizer):
    tokenizer, _ = qwen_tool_tokenizer
    with ToolRunner(load_tools([f"{mod}:surrogate"]), load_environment(f"{mod}:Env"), timeout_s=10, workers=1) as r:
        returned = _one(r, "surrogate", raises=False)
        raised = _one(r, "surrogate", raises=True)
        (first,) = r.reset(["e"], [{}])
    assert returned == ToolResult("12\ufffd", "ok")
    assert raised.status == "error" and raised.text.startswith("error: surrogate raised ValueError: bad \ufffd")
    assert first == "start \ufffd"
    for text in (returned.text, raised.text, first):
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


# ---------------------------------------------------------------- 4. floods


def test_what_a_tool_prints_is_bounded_per_call_and_per_run(mod, tmp_path):
    log = tmp_path / "tools.log"
    per_call, per_run = 256 << 10, 640 << 10
    with ToolRunner(load_tools([f"{mod}:floods"]), None, timeout_s=30, workers=1, output=log,
                    output_bytes_per_call=per_call, output_bytes_per_run=per_run) as r:
        for _ in range(4):  # 8 MiB each
            assert _one(r, "floods", x=1) == ToolResult("done", "ok")
    text = log.read_bytes()
    notes = [x.decode() for x in text.splitlines() if x.startswith(b"[shardwise]")]
    kept = len(text) - sum(len(n) + 2 for n in notes)  # the notes and the newlines around them aside
    assert kept == per_run, (kept, notes)
    # two calls cut at the per-call bound, then the run's bound (one note), then the total at the end
    assert sum(n.startswith("[shardwise] a call of floods printed 8388608 bytes") for n in notes) == 2, notes
    assert sum(f"reached {per_run} bytes per run" in n for n in notes) == 1 and len(notes) == 4, notes
    assert f"{4 * (8 << 20) - per_run} bytes" in notes[-1], notes


def test_the_default_bounds_hold_a_flood_to_a_few_megabytes(mod, tmp_path):
    log = tmp_path / "tools.log"
    with ToolRunner(load_tools([f"{mod}:floods"]), None, timeout_s=30, workers=1, output=log) as r:
        for _ in range(3):
            assert _one(r, "floods", x=1).ok
    assert log.stat().st_size < 3 * ((1 << 20) + 4096)  # 24 MiB printed


# ---------------------------------------------------------------- 5. concurrency


def test_slow_calls_run_at_the_same_time(mod, tmp_path):
    """N calls sleeping S each, sent together to a runner with one process ready (as a job's
    is when its first turn ends): their runs overlap (each started before any ended) and
    they take well under N * S / 2."""
    n, seconds = 6, 4.0
    with ToolRunner(load_tools([f"{mod}:slow"]), None, timeout_s=60, workers=8) as r:
        for _ in range(600):  # until its process imported the tools (at most 60 s)
            if r.ready:
                break
            time.sleep(0.1)
        t0 = time.monotonic()
        res = r.call([(f"t{i}", ToolCall("slow", {"folder": str(tmp_path), "seconds": seconds}), {})
                      for i in range(n)])
        took = time.monotonic() - t0
    assert [x.text for x in res] == ["slept"] * n
    spans = [tuple(map(float, f.read_text().split())) for f in tmp_path.iterdir()]
    assert len(spans) == n
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans  # all ran at one moment
    assert took < n * seconds / 2, took
