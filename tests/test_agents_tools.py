"""Agents' tools: schemas derived from plain functions, every mistake in the config one
ConfigError line, model turns parsed whatever they hold, and calls run in real worker
processes that contain whatever a tool does (raise, hang, os._exit, kill its parent, flood
its output, return what is not a string) and leave no process behind."""

from __future__ import annotations

import os
import textwrap
import threading
import time
import uuid

import pytest
from dist.launcher import alive

from shardwise.agents import execute
from shardwise.agents.execute import ToolResult, ToolRunner
from shardwise.agents.parsers import TOOL_PARSERS, ToolCall, parse_hermes, tool_call_message
from shardwise.agents.tools import all_schemas, load_environment, load_tools
from shardwise.contained import descendants
from shardwise.errors import ConfigError

TOOLS = '''
import os, signal, subprocess, sys, time

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: digits and + - * /, e.g. 123*456
    """
    return str(eval(expression, {"__builtins__": {}}))

def lookup(key: str, table: dict = None) -> str:
    """Look a key up in the row's table (the table comes from the data, hidden from the model).

    Args:
        key: the key to look up
        table: the row's table
    """
    return str((table or {}).get(key, "absent"))

def raises(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise ValueError(f"no {x}")

def hangs(x: int) -> str:
    """Hang, catching everything.

    Args:
        x: anything
    """
    while True:
        try:
            time.sleep(3600)
        except BaseException:
            pass

def exits(x: int) -> str:
    """End the process.

    Args:
        x: anything
    """
    os._exit(3)

def kills_parent(x: int) -> str:
    """Kill the process's parent.

    Args:
        x: anything
    """
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)
    return ""

def floods(x: int) -> str:
    """Print megabytes, return a long text.

    Args:
        x: anything
    """
    for _ in range(8):
        sys.stdout.write("a" * (1 << 20))
        sys.stderr.write("b" * (1 << 20))
    return "c" * 100_000

def number(x: int) -> int:
    """Return a number.

    Args:
        x: anything
    """
    return x

def spawns(path: str) -> str:
    """Start a process in a session of its own and hang.

    Args:
        path: where to write its pid
    """
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    with open(path, "w") as f:
        f.write(str(p.pid))
    return str(p.pid)

def barrier(folder: str, n: int) -> str:
    """Wait until n calls arrived in folder (at most 20 s).

    Args:
        folder: the shared folder
        n: how many calls to wait for
    """
    open(os.path.join(folder, str(os.getpid())), "w").close()
    for _ in range(2000):
        if len(os.listdir(folder)) >= n:
            return "met"
        time.sleep(0.01)
    return "alone"

class Counter:
    def reset(self, start: int = 0, **row):
        self.n = start
        return f"at {start}"

    def add(self, k: int) -> str:
        """Add to the counter.

        Args:
            k: how much
        """
        self.n += k
        return str(self.n)

    def crash(self) -> str:
        """End the process."""
        os._exit(1)

    def reward(self) -> float:
        return float(self.n)

class Broken:
    def reset(self, **row):
        raise RuntimeError("no board")

    def move(self, k: int) -> str:
        """Move.

        Args:
            k: where
        """
        return "moved"

def nohint(x):
    """No hints.

    Args:
        x: anything
    """
    return ""

def nodoc(x: int) -> str:
    return ""
'''

NAMES = ["calculator", "lookup", "raises", "hangs", "exits", "kills_parent", "floods", "number", "spawns", "barrier"]


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    """The tools' module name, importable from the working directory (as users' are)."""
    folder = tmp_path_factory.mktemp("agent_tools")
    name = f"tools_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(textwrap.dedent(TOOLS))
    (folder / f"{name}_bad.py").write_text("raise ImportError('needs a package that is not installed')\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        yield name


@pytest.fixture(scope="module")
def runner(mod):
    """One runner for the faults (2 children, 2 s per call, 64 characters per answer)."""
    tools = load_tools([f"{mod}:{n}" for n in NAMES])
    before = set(descendants(os.getpid()))
    r = ToolRunner(tools, load_environment(f"{mod}:Counter"), timeout_s=2, workers=2, max_chars=64)
    yield r
    r.close()
    assert not set(alive(descendants(os.getpid()))) - before


def _call(runner, name, traj="t", extra=None, **arguments) -> ToolResult:
    return runner.call([(traj, ToolCall(name, arguments), extra or {})])[0]


# ---------------------------------------------------------------------- schemas and config


def test_schemas_come_from_hints_and_docstrings(mod):
    calc, lookup = load_tools([f"{mod}:calculator", f" {mod}:lookup "])
    assert (calc.name, calc.spec) == ("calculator", f"{mod}:calculator")
    fn = calc.schema["function"]
    assert calc.schema["type"] == "function" and fn["name"] == "calculator"
    assert fn["description"] == "Evaluate an arithmetic expression."
    assert fn["parameters"]["properties"]["expression"] == {"type": "string",
                                                             "description": "digits and + - * /, e.g. 123*456"}
    assert fn["parameters"]["required"] == ["expression"]
    assert lookup.schema["function"]["parameters"]["required"] == ["key"]
    env = load_environment(f"{mod}:Counter")
    assert env.has_reward and [t.name for t in env.tools] == ["add", "crash"]  # not reset / reward
    assert env.tools[0].spec == f"{mod}:Counter.add"
    assert list(env.tools[0].schema["function"]["parameters"]["properties"]) == ["k"]  # no self
    names = [s["function"]["name"] for s in all_schemas([calc, lookup], env)]
    assert names == ["calculator", "lookup", "add", "crash"]
    assert load_environment(None) is None


@pytest.mark.parametrize("specs,words", [
    (["{mod}:calculatr"], "rl.tools[0]': {mod} has no attribute 'calculatr' (did you mean calculator?)"),
    (["{mod}:calculator", "{mod}:nohint"], "rl.tools[1]': cannot derive the JSON schema of nohint"),
    (["{mod}:nodoc"], "nodoc"),
    (["no_such_module_x:f"], "no module named 'no_such_module_x'"),
    (["{mod}_bad:f"], "importing '{mod}_bad' failed: ImportError: needs a package"),
    (["calculator"], "is not of the form module:function"),
    (["{mod}:Counter"], "is a class, not a function"),
    (["{mod}:calculator", "{mod}:calculator"], "two tools are named 'calculator'"),
])
def test_bad_tools_are_one_config_error_line(mod, specs, words):
    with pytest.raises(ConfigError) as e:
        load_tools([s.format(mod=mod) for s in specs])
    text = str(e.value)
    assert words.format(mod=mod) in text and "\n" not in text
    if "schema" in words or "nodoc" in words:
        assert "type hints" in text and "docstring" in text


def test_bad_environments_are_one_config_error_line(mod):
    for spec, words in [(f"{mod}:calculator", "not a class"), (f"{mod}:Countr", "did you mean Counter?"),
                        ("x", "not of the form module:Class")]:
        with pytest.raises(ConfigError, match="rl.environment") as e:
            load_environment(spec)
        assert words in str(e.value) and "\n" not in str(e.value)
    tools = load_tools([f"{mod}:calculator"])
    env = load_environment(f"{mod}:Counter")
    clash = type(env)(env.spec, [type(tools[0])("calculator", env.spec + ".calculator", {})], True)
    with pytest.raises(ConfigError, match="has the name of the tool"):
        all_schemas(tools, clash)


# ---------------------------------------------------------------------- parsing


def test_hermes_calls_are_parsed_and_garbage_never_raises():
    turn = parse_hermes('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
                        '</tool_call>\n<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>')
    assert turn.content == "I will compute."
    assert turn.calls == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("lookup", {"key": "a"})]
    assert tool_call_message(turn) == {"role": "assistant", "content": "I will compute.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}},
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}}]}
    assert tool_call_message(parse_hermes("42")) == {"role": "assistant", "content": "42"}
    assert TOOL_PARSERS["hermes"] is parse_hermes
    bad = {
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>': ("calculator", "not valid JSON"),
        "<tool_call>[1, 2]</tool_call>": ("", "a JSON list, not an object"),
        '<tool_call>{"arguments": {}}</tool_call>': ("", 'no "name"'),
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': ("f", "not an object"),
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>': ("f", "not valid JSON"),
        'text <tool_call>{"name": "calculator", "argu': ("calculator", "not closed"),
        "<tool_call>" + "[" * 100_000 + "</tool_call>": ("", ""),
        "<tool_call></tool_call>": ("", "not valid JSON"),
    }
    for text, (name, words) in bad.items():
        (call,) = parse_hermes(text).calls
        assert call.name == name and call.arguments == {} and words in call.error and "\n" not in call.error
    assert parse_hermes('text <tool_call>{"name"').content == "text"
    assert parse_hermes(None).calls == [] and parse_hermes("</tool_call> x").calls == []


# ---------------------------------------------------------------------- running


def test_tools_run_with_arguments_from_the_model_and_the_data(runner):
    assert _call(runner, "calculator", expression="123*456") == ToolResult("56088", "ok")
    # the data's keyword arguments join the model's; those a function does not take are left out
    res = runner.call([("t", ToolCall("lookup", {"key": "a"}), {"table": {"a": "x"}, "other": 1}),
                       ("t", ToolCall("calculator", {"expression": "1+1"}), {"table": {}})])
    assert res == [ToolResult("x", "ok"), ToolResult("2", "ok")]
    assert runner.call([]) == []


@pytest.mark.parametrize("name,arguments,status,words", [
    ("raises", {"x": 1}, "error", "error: raises raised ValueError: no 1"),
    ("hangs", {"x": 1}, "timeout", "error: hangs did not return within 2 s"),
    ("exits", {"x": 1}, "crash", "error: exits crashed: its process exited with status 3"),
    ("kills_parent", {"x": 1}, "crash", "error: kills_parent crashed: its process"),
    ("number", {"x": 1}, "error", "error: number returned int, not a string"),
    ("calculatr", {"expression": "1"}, "error", "error: unknown tool 'calculatr' (did you mean calculator?)"),
    ("calculator", {"expression": "1", "base": 2}, "error", "error: wrong arguments for calculator: got an unexpected"),
    ("calculator", {}, "error", "error: wrong arguments for calculator: missing a required argument"),
    ("calculator", {"expression": "1/0"}, "error", "error: calculator raised ZeroDivisionError"),
])
def test_every_fault_is_an_error_the_model_reads(runner, name, arguments, status, words):
    res = _call(runner, name, **arguments)
    assert res.status == status and res.text.startswith(words[:64]), res
    assert len(res.text) <= 64 and "\n" not in res.text
    assert _call(runner, "calculator", expression="6*7") == ToolResult("42", "ok")  # the job goes on


def test_floods_go_nowhere_and_answers_keep_their_head(runner):
    assert _call(runner, "floods", x=1) == ToolResult("c" * 64, "ok")
    (res,) = runner.call([("t", ToolCall("", {}, "the call is not valid JSON: " + "x" * 100), {})])
    assert res.status == "error" and res.text == ("error: the call is not valid JSON: " + "x" * 100)[:64]


def test_calls_behind_a_hang_run_in_a_fresh_process(runner):
    calls = [("t", ToolCall("hangs", {"x": 1}), {})] + [
        ("t", ToolCall("calculator", {"expression": f"{i}+{i}"}), {}) for i in (1, 2, 3)]
    res = runner.call(calls)
    assert [r.status for r in res] == ["timeout", "ok", "ok", "ok"]
    assert [r.text for r in res[1:]] == ["2", "4", "6"]


def test_prints_go_to_the_output_given(mod, tmp_path):
    """Up to the bound per call (1 MiB by default; tests/test_agents_hostile.py has the
    bounds), then a note of what was dropped."""
    log = tmp_path / "tools.log"
    with ToolRunner(load_tools([f"{mod}:floods"]), None, timeout_s=10, workers=1, output=log) as r:
        assert _call(r, "floods", x=1).status == "ok"
    head, *notes = log.read_bytes().split(b"\n[shardwise] ")
    assert len(head) == 1 << 20 and set(head) <= set(b"ab") and len(notes) == 2, notes
    assert b"printed 16777216 bytes: the first 1048576 kept, 15728640 dropped" in notes[0], notes


def test_environments_keep_state_per_trajectory(runner):
    assert runner.reset(["a", "b"], [{"start": 1, "prompt": "p"}, {"start": 10}]) == ["at 1", "at 10"]
    calls = [("a", ToolCall("add", {"k": 1}), {}), ("b", ToolCall("add", {"k": 5}), {}),
             ("a", ToolCall("add", {"k": 2}), {}), ("a", ToolCall("calculator", {"expression": "2+2"}), {})]
    assert [r.text for r in runner.call(calls)] == ["2", "15", "4", "4"]
    assert runner.reward(["a", "b", "never"]) == [4.0, 15.0, None]
    runner.end(["a"])
    assert _call(runner, "add", traj="a", k=1).text.startswith("error: the environment of this trajectory")
    assert runner.reward(["b"]) == [15.0]
    # a crash loses the environments of that process; the next call starts a fresh one
    res = _call(runner, "crash", traj="b")
    assert res.status == "crash"
    lost = _call(runner, "add", traj="b", k=1)
    assert lost == ToolResult("error: the environment of this trajectory was lost (its process ended)"[:64], "error")
    assert runner.reward(["b"]) == [None] and "lost" in runner.reward_errors["b"]
    runner.end(["b"])


def test_submitted_calls_keep_their_order_and_are_collected_in_any_order(runner):
    """`ToolRunner.submit` sends calls and returns; a trajectory's environment calls sent
    later run after those sent earlier (one thread per process, in the order sent), and
    `collect` gives each submission its own results whatever the order of collecting."""
    assert runner.reset(["s"], [{"start": 0}]) == ["at 0"]
    first = runner.submit([("s", ToolCall("add", {"k": 1}), {}), ("t", ToolCall("calculator", {"expression": "1+1"}), {}),
                           ("s", ToolCall("nope", {}), {})])
    second = runner.submit([("s", ToolCall("add", {"k": 2}), {})])
    assert [r.text for r in runner.collect(second)] == ["3"]
    got = runner.collect(first)
    assert [r.text for r in got[:2]] == ["1", "2"] and got[2].text.startswith("error: unknown tool 'nope'")
    assert runner.reward(["s"]) == [3.0]
    runner.end(["s"])


def test_close_ends_calls_submitted_and_not_collected(mod):
    """A call still running when the runner closes (sent, never collected) is cut short:
    its process is killed and none is started after."""
    before = set(descendants(os.getpid()))
    r = ToolRunner(load_tools([f"{mod}:hangs"]), None, timeout_s=60, workers=1)
    r.submit([("t", ToolCall("hangs", {"x": 1}), {})])
    r.close()
    assert not set(alive(descendants(os.getpid()))) - before


def test_a_tool_worker_that_never_answers_ends_the_wait_in_one_line_naming_it(mod, monkeypatch):
    """The runner's own bound (beyond each call's timeout, which the child enforces) fires on
    a child's thread that never comes back: `wait_any` and `collect` end in one line naming
    the tool worker, instead of waiting for ever."""
    monkeypatch.setattr(execute, "BOUND_PER_CALL_S", 0.0)
    monkeypatch.setattr(execute, "BOUND_SLACK_S", 0.0)
    stuck = threading.Event()
    with ToolRunner(load_tools([f"{mod}:calculator"]), None, timeout_s=0.5, start_timeout_s=5, workers=1) as r:
        for _ in range(600):  # until its process imported the tools (at most 60 s)
            if r.ready:
                break
            time.sleep(0.1)
        r.start_timeout_s = 0.5
        r._lanes[0].submit(stuck.wait)  # the child's thread taken by something that does not return
        sent = r.submit([("t", ToolCall("calculator", {"expression": "1+1"}), {})])
        for wait in (lambda: r.wait_any([sent]), lambda: r.collect(sent)):
            with pytest.raises(RuntimeError) as e:
                wait()
            assert str(e.value) == "tool worker(s) [0] did not answer within 1 s", str(e.value)
        stuck.set()


def test_an_environment_that_cannot_start_answers_why(mod):
    env = load_environment(f"{mod}:Broken")
    with ToolRunner([], env, timeout_s=5, workers=1) as r:
        assert r.reset(["x"], [{}]) == [None]
        res = _call(r, "move", traj="x", k=1)
        assert res.status == "error" and "could not be started" in res.text and "RuntimeError: no board" in res.text
        assert r.reward(["x"]) == [None]


def test_calls_run_concurrently_and_close_leaves_no_process(mod, tmp_path):
    """Four calls that each wait (at most 20 s) until all four arrived meet only when they
    run at the same time; the pool grows to them only (of 8 processes allowed: one at the
    start, one more for each call that finds all busy); a process a tool started in a
    session of its own is gone after close."""
    before = set(descendants(os.getpid()))
    tools = load_tools([f"{mod}:barrier", f"{mod}:spawns"])
    r = ToolRunner(tools, None, timeout_s=30, workers=8)
    assert r.processes == 1
    (tmp_path / "alone").mkdir()
    assert _call(r, "barrier", folder=str(tmp_path / "alone"), n=1).text == "met"
    assert r.processes == r.ready == 1  # one call at a time: one process
    alone = [(f"t{i}", ToolCall("barrier", {"folder": str(tmp_path / "alone"), "n": 1}), {}) for i in range(4)]
    assert [x.text for x in r.call(alone)] == ["met"] * 4  # run by the ready one while 3 more start
    assert r.processes == 4
    for _ in range(600):  # until the new ones imported the tools (at most 60 s)
        if r.ready == 4:
            break
        time.sleep(0.1)
    (tmp_path / "meet").mkdir()
    res = r.call([(f"t{i}", ToolCall("barrier", {"folder": str(tmp_path / "meet"), "n": 4}), {}) for i in range(4)])
    assert [x.text for x in res] == ["met"] * 4 and r.processes == 4
    pid = int(_call(r, "spawns", path=str(tmp_path / "pid")).text)
    assert alive([pid])
    r.close()
    r.close()
    assert not alive([pid])
    assert not set(alive(descendants(os.getpid()))) - before
