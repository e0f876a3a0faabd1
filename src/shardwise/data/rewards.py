"""Scoring generated text: reward functions named in the config, and the decoding they read.

- `resolve_reward_fn` turns a spec (``builtin:NAME`` or ``module:function``, the value of
  ``rl.reward.function`` or ``infer.reward``) into a ``(prompt, response, ground_truth)
  -> float`` callable, by import and attribute lookup only (never eval). A function of
  verl's form, ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``,
  is recognised from its signature (`reward_form`) and called with each row's
  ``data_source`` and ``extra_info``. Built-ins: each task's scorer, ``gsm8k``,
  ``gsm8k_flexible``, ``math`` (`shardwise.data.scorers`, equal to verl's) and
  ``by_source`` (one of those chosen by the row's data_source, as verl's default does).
- A function may return a number, or a dict whose ``"score"`` is the reward and whose
  other numeric entries become metrics ``reward/<key>`` (their mean over the rows).
- `decode_responses` is the text a scorer sees: a row's response tokens up to (not
  including) the first EOS, decoded without special tokens.
- `score_sequences` scores each row and puts the score on its last response token
  (``token_level_scores``); the generation engine's output layout is its input. A
  multi-turn trajectory (`shardwise.agents.loop`) is scored on its final answer; a
  function with a ``messages`` parameter gets the conversation, verl's ``extra_info``
  gets ``num_turns`` and ``tool_calls``, and an environment's ``reward()`` or
  ``rl.multi_turn.truncated_reward`` can give the score instead.
- `contain` makes a user's ``module:function`` a `ContainedReward`: called in a child
  process of its own (`shardwise.contained`), a batch's rows in one round trip, so that a
  function that hangs whatever it catches, ignores SIGALRM, ends or kills its process or
  its parent, or starts processes is stopped with all it started and named in one line.
  The built-in scorers (ours) are called in this process, under a SIGALRM timer.

A user's module (a reward function's, a tool's, an environment's) is imported first in a
child process (`shardwise.contained.Contained`), bounded by `IMPORT_TIMEOUT_S` (environment
variable ``SHARDWISE_IMPORT_TIMEOUT_S``): a module whose top level never returns (a loop,
a network call without a timeout) or ends its process is one ConfigError line naming the
module and the bound, and Ctrl-C while it imports is one line and exit 130
(`ImportInterrupted`); then in this process, for the checks that read the function.

Used by `shardwise infer`, the held-out evaluation of every job and RL rewards alike.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardwise.contained import Contained
from shardwise.data import scorers
from shardwise.data.batch import Batch
from shardwise.data.reward_row import RewardFunctionError, checked, describe, invoke, raised, row_info, short, where
from shardwise.data.tasks import BUILTIN_PREFIX, BUILTIN_TASKS, get_builtin_task
from shardwise.errors import ConfigError, DataError, ShardwiseError, did_you_mean
from shardwise.telemetry import activity

__all__ = ["BUILTIN_REWARDS", "IMPORT_TIMEOUT_ENV", "IMPORT_TIMEOUT_S", "ContainedReward", "ImportInterrupted", "RewardFn", "RewardFunctionError", "VerlReward", "check_data_sources",
           "MULTI_TURN_ARRAYS", "call_within", "contain", "decode_responses", "resolve_reward_fn", "reward_form", "score_sequences",
           "takes_messages"]

RewardFn = Callable[[str, str, str], float]
"""``(prompt, response_text, ground_truth) -> reward``."""

_KEY = "rl.reward.function"
DEFAULT_TIMEOUT_S = 60.0
"""How long one reward call may take (``rl.reward.timeout_s``, ``infer.reward_timeout_s``)."""
_FORMS = "builtin:NAME or module:function (e.g. builtin:arithmetic or my_rewards:score)"


_VERL_ARGS = ("data_source", "solution_str", "ground_truth")


class VerlReward:
    """A reward function of verl's form, ``fn(data_source=, solution_str=, ground_truth=,
    extra_info=)`` (keywords, as verl calls it), callable as ``(prompt, response,
    ground_truth)`` too (data_source and extra_info None), or with them as keywords."""

    form = "verl"

    def __init__(self, fn: Callable, takes_extra_info: bool = True, takes_messages: bool = False):
        self.fn = fn
        self.takes_extra_info = takes_extra_info
        self.takes_messages = takes_messages
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
        self.__module__ = getattr(fn, "__module__", None)

    def __call__(self, prompt: str, response: str, ground_truth: str, data_source=None, extra_info=None,
                 messages=None):
        return invoke(self.fn, prompt, response, ground_truth, data_source, extra_info, True, self.takes_extra_info,
                      messages, self.takes_messages)


def reward_form(fn: Callable, spec: str, key: str = _KEY) -> str:
    """``"verl"`` when `fn` takes verl's keywords (data_source, solution_str,
    ground_truth[, extra_info]), ``"plain"`` when it takes (prompt, response, ground_truth)
    positionally; either may also take ``messages`` (`takes_messages`); decided from the
    signature once. ConfigError on `key` for neither."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to inspect (some builtins): the plain form
        return "plain"
    names = [p.name for p in sig.parameters.values()]
    more = {"messages": None} if takes_messages(fn) else {}
    if any(n in names for n in _VERL_ARGS[:2]):  # verl's own names decide
        try:
            sig.bind(data_source="", solution_str="", ground_truth="", **more)
        except TypeError as e:
            raise ConfigError(key, f"{spec} looks like verl's form but cannot be called as "
                              f"compute_score(data_source=, solution_str=, ground_truth=, extra_info=None): {e}",
                              "give it verl's signature, or (prompt, response, ground_truth)") from None
        return "verl"
    try:
        sig.bind("", "", "", **more)
    except TypeError as e:
        raise ConfigError(key, f"{spec} takes neither (prompt, response, ground_truth) nor verl's (data_source, "
                          f"solution_str, ground_truth, extra_info=None): {e}",
                          "give it one of those two signatures") from None
    return "plain"


def _takes_extra_info(fn: Callable) -> bool:
    more = {"messages": None} if takes_messages(fn) else {}
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth="", extra_info=None, **more)
    except TypeError:
        return False
    return True


def takes_messages(fn: Callable) -> bool:
    """Whether `fn` (a reward function, either form, or a `VerlReward`) has a parameter
    named ``messages`` that can be passed by keyword: it then receives each row's
    conversation (a multi-turn trajectory's OpenAI messages; None for a single-turn row)."""
    fn = fn.fn if isinstance(fn, VerlReward) else fn
    try:
        param = inspect.signature(fn).parameters.get("messages")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


_by_source = VerlReward(scorers.score_by_source)
"""``builtin:by_source``: verl's default scorer (one of the built-ins by each row's data_source)."""


BUILTIN_REWARDS: dict[str, RewardFn] = {name: scorer for name, scorer in scorers.SCORERS.items()}
"""Built-in scorers beside the tasks' (``builtin:NAME``), ``(prompt, response, ground_truth)``."""
_BY_SOURCE = "by_source"


def check_data_sources(fn: RewardFn | None, records: list[dict], key: str = _KEY) -> None:
    """``builtin:by_source`` knows every row's data_source (DataError naming the first row
    whose source it does not know, before anything starts)."""
    if fn is not _by_source:
        return
    for r in records:
        source = r.get("data_source")
        if source not in scorers.SOURCE_SCORERS:
            raise DataError(f"{key}: builtin:by_source cannot score {r.get('where', 'a row')}: its data_source "
                            f"{source!r} is none of {', '.join(sorted(scorers.SOURCE_SCORERS))} "
                            f"(data.data_source_key: {'set' if 'data_source' in r else 'absent'}); "
                            "use builtin:gsm8k / builtin:math or a module:function of your own")


# ---------------------------------------------------------------------- resolving


def resolve_reward_fn(spec: str, key: str = _KEY) -> RewardFn:
    """The reward function named by `spec` (the value of config key `key`, by default
    ``rl.reward.function``).

    - ``builtin:NAME``: the scorer of the built-in task NAME (`shardwise.data.tasks`);
    - ``module:function``: ``function`` (a dotted attribute path is allowed, e.g.
      ``mod:Scorer.score``) of ``module``, imported with the current working directory
      and ``PYTHONPATH``'s entries on ``sys.path`` for the duration of the import.

    Raises ConfigError on `key` for a malformed spec, an unknown
    builtin, a module that is missing or fails to import, a missing attribute (with the
    nearest names) and a value that is not callable with three arguments.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(key, f"{spec!r} names no reward function", f"use {_FORMS}")
    spec = spec.strip()
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name == _BY_SOURCE:
            return _by_source
        if name in BUILTIN_REWARDS:
            return BUILTIN_REWARDS[name]
        if name not in BUILTIN_TASKS:
            names = [*BUILTIN_TASKS, *BUILTIN_REWARDS, _BY_SOURCE]
            raise ConfigError(key, f"unknown built-in reward {name!r}",
                              did_you_mean(name, names, prefix=BUILTIN_PREFIX))
        return get_builtin_task(name).score
    module_name, _, attr_path = spec.partition(":")
    if not (dotted_name(module_name) and dotted_name(attr_path)):
        raise ConfigError(key, f"{spec!r} is not of the form {_FORMS}", "write module:function, with a dotted "
                          "module path and a function name, or builtin:NAME")
    obj = import_attribute(module_name, attr_path, key, "(prompt, response, ground_truth)")
    if not callable(obj):
        raise ConfigError(key, f"{spec} is a {type(obj).__name__}, not a function",
                          "point it at a function (prompt, response, ground_truth) -> float")
    if reward_form(obj, spec, key) == "verl":
        return VerlReward(obj, _takes_extra_info(obj), takes_messages(obj))
    return obj  # type: ignore[return-value]


def import_attribute(module_name: str, attr_path: str, key: str, signature: str = "") -> object:
    """`module_name` imported for the setting `key` (the working directory and PYTHONPATH on
    sys.path; `_import`'s one-line errors) and its dotted `attr_path` walked; a missing
    attribute is a ConfigError naming its owner and the nearest public name there (else
    "define NAME" followed by `signature`)."""
    obj: object = _import(module_name, key)
    for i, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            owner = module_name + "".join(f".{p}" for p in attr_path.split(".")[:i])
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(key, f"{owner} has no attribute {part!r}",
                              did_you_mean(part, names) or f"define {part}{signature} in {owner}")
        obj = getattr(obj, part)
    return obj


def dotted_name(text: str) -> bool:
    """``a`` or ``a.b.c`` of Python identifiers (so no code, no second colon)."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


@contextlib.contextmanager
def _import_path() -> Iterator[None]:
    """The working directory and PYTHONPATH's entries on sys.path, removed again after."""
    wanted = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    added = [p for p in dict.fromkeys(wanted) if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


IMPORT_TIMEOUT_ENV = "SHARDWISE_IMPORT_TIMEOUT_S"
IMPORT_TIMEOUT_S = 120.0
"""The longest the import of one user module may take during the checks (in a child
process; `IMPORT_TIMEOUT_ENV` sets another bound, in seconds)."""


class ImportInterrupted(ShardwiseError):
    """Ctrl-C (or SIGTERM taken as it) while a user's module was being imported for the
    checks: one line, exit 130."""

    exit_status = 130


def import_timeout_s() -> float:
    """The bound on one user module's import: `IMPORT_TIMEOUT_ENV`, else `IMPORT_TIMEOUT_S`."""
    raw = os.environ.get(IMPORT_TIMEOUT_ENV, "").strip()
    if not raw:
        return IMPORT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(IMPORT_TIMEOUT_ENV, f"{raw!r} is not a number of seconds above 0",
                          f"set it to e.g. {IMPORT_TIMEOUT_S:g}, or unset it")
    return value


def _interrupted(module_name: str, key: str) -> ImportInterrupted:
    return ImportInterrupted(f"interrupted while importing {module_name!r} for {key}; nothing was started")


def _import_in_child(module_name: str, key: str) -> None:
    """`module_name` imported in a child process first, bounded by `import_timeout_s`: an
    import that does not return, or ends its process, is a ConfigError on `key` (an import
    that raises is left to the import in this process, whose error says more)."""
    bound = import_timeout_s()
    path = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
            *(p for p in sys.path if p)]
    child = Contained(module_name, start_timeout_s=bound, output=subprocess.DEVNULL,
                      env={"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))})
    try:
        outcome = child.wait_started()
    except KeyboardInterrupt:
        raise _interrupted(module_name, key) from None
    finally:
        child.close()
    if outcome.kind == "timeout":
        raise ConfigError(key, f"importing {module_name!r} did not finish within {bound:g} s (its top level never "
                          "returned: a loop, or a network call without a timeout?)",
                          f"make the module's import return; a slow one may take longer with {IMPORT_TIMEOUT_ENV}="
                          f"{max(bound * 4, IMPORT_TIMEOUT_S):g}")
    if outcome.kind == "crash":
        raise ConfigError(key, f"importing {module_name!r} ended its process: {outcome.reason}",
                          "fix the module so that it imports cleanly (no os._exit or sys.exit at its top level)")


def _import(module_name: str, key: str):
    if module_name not in sys.modules:
        _import_in_child(module_name, key)
    with _import_path():
        try:
            return importlib.import_module(module_name)
        except KeyboardInterrupt:
            raise _interrupted(module_name, key) from None
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                raise ConfigError(key, f"no module named {missing!r} (looked in the working directory "
                                  f"{os.getcwd()!r}, PYTHONPATH and the installed packages)",
                                  f"run from the folder that holds {module_name.split('.')[0]}.py, or add "
                                  "that folder to PYTHONPATH") from None
            raise ConfigError(key, f"importing {module_name!r} failed: {e}",
                              "install what the module imports") from e
        except Exception as e:  # the module's own code raised while being imported
            raise ConfigError(key, f"importing {module_name!r} failed: {type(e).__name__}: {e}",
                              "fix the module so that it imports cleanly") from e


# ---------------------------------------------------------------------- scoring text


class _Timeout(BaseException):
    """Raised into a reward call that outlived its time (a BaseException: a function's own
    ``except Exception`` does not swallow it)."""


def _within(seconds: float | None, call: Callable[[], Any]) -> Any:
    """``call()``, or `_Timeout` once it has run `seconds`. In the main thread a SIGALRM
    timer interrupts it (Python code, sleeps and most blocking calls); elsewhere it runs in
    a daemon thread that is left behind when it overruns (the job then ends with the error)."""
    if seconds is None:
        return call()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def alarm(_signum, _frame):
            raise _Timeout

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="shardwise-reward")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise _Timeout
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_within(seconds: float | None, call: Callable[[], Any], late: str) -> Any:
    """``call()`` (user code run in this process, e.g. the ``extract`` beside a reward), or
    RewardFunctionError(`late`) once it has run `seconds` (None: no limit); bounded as the
    built-in scorers are (`_within`)."""
    try:
        return _within(seconds, call)
    except _Timeout:
        raise RewardFunctionError(late) from None


def _call(fn: RewardFn, prompt: str, response: str, truth: str, row: int, data_source=None,
          extra_info=None, timeout_s: float | None = None,
          timeout_key: str = "rl.reward.timeout_s", messages=None,
          with_messages: bool = False) -> tuple[float, dict[str, float], dict[str, Any]]:
    """``(reward, extra metrics, row info)`` of one row (`checked`, `row_info`), `fn` called in this process (with a copy of
    `messages` when `with_messages`); RewardFunctionError naming the row otherwise (also
    when the call takes longer than `timeout_s`)."""
    at = where(row, prompt)
    verl = isinstance(fn, VerlReward)
    call = fn.fn if verl else fn
    messages = copy.deepcopy(messages)  # the function gets its own: the row's stay as they are
    try:
        # Recorded for a supervising parent: a function that ends the process (os._exit)
        # or crashes it raises nothing here, and the parent's line names it.
        with activity.doing(f"reward function {describe(fn)} on {at}"):
            value = _within(timeout_s, lambda: invoke(call, prompt, response, truth, data_source, extra_info, verl,
                                                      verl and fn.takes_extra_info, messages, with_messages))
    except _Timeout:
        raise RewardFunctionError(f"reward function {describe(fn)} did not return within {timeout_s:g} s on {at}, "
                                  f"response {short(response)}; make it faster or raise {timeout_key}") from None
    except Exception as e:
        raise raised(describe(fn), e, at, response) from e
    return (*checked(describe(fn), value, at), row_info(value))


class ContainedReward:
    """A user's reward function (``module:function``) called in a child process of its own
    (`shardwise.contained.Contained`): whatever it does (catches every exception around a
    sleep, ignores SIGALRM, ends or kills its process or its parent, starts processes), the
    call ends within its timeout, the job names the function and nothing it started is
    left. `score_rows` scores a whole batch in one round trip. `fn` is the function as
    `resolve_reward_fn` returned it in this process (its name and form); `spec` names it
    for the child. `start` starts the child ahead of the first call; `close` kills it."""

    def __init__(self, fn: RewardFn, spec: str):
        self.fn, self.spec = fn, spec
        self.name = describe(fn)
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
        self.__module__ = getattr(fn, "__module__", None)
        self._verl = isinstance(fn, VerlReward)
        self._takes_extra_info = self._verl and fn.takes_extra_info
        self.takes_messages = takes_messages(fn)
        self._child = Contained(spec, "shardwise.data.reward_row:score_row")

    def start(self) -> None:
        self._child.start()

    def close(self) -> None:
        self._child.close()

    def __call__(self, prompt: str, response: str, ground_truth: str, data_source=None, extra_info=None,
                 messages=None) -> float:
        """One row's reward (as the function itself would be called, with the checks of `score_rows`)."""
        return self.score_rows([(prompt, response, ground_truth, data_source, extra_info, messages)],
                               DEFAULT_TIMEOUT_S)[0][0]

    def score_rows(self, rows: list[tuple], timeout_s: float | None, timeout_key: str = "rl.reward.timeout_s",
                   numbers: list[int] | None = None) -> list[tuple[float, dict[str, float], dict[str, Any]]]:
        """``(reward, extra metrics, row info)`` (`shardwise.data.reward_row.row_info`) of each ``(prompt, response, ground_truth, data_source,
        extra_info[, messages])`` row (`numbers`: the rows' numbers in the batch, for the
        messages; by default 0, 1, ...); RewardFunctionError naming the function and the
        first row that failed: it raised or returned a bad value, took longer than
        `timeout_s` (None: no limit) or its process ended (the child is then killed with
        all it started)."""
        numbers = list(range(len(rows))) if numbers is None else numbers
        payloads = []
        for n, (p, r, t, s, x, *m) in zip(numbers, rows, strict=True):
            payload = {"name": self.name, "row": n, "prompt": p, "response": r, "truth": t, "data_source": s,
                       "extra_info": _plain(x), "verl": self._verl, "takes_extra_info": self._takes_extra_info}
            if self.takes_messages:
                payload |= {"messages": _plain(m[0] if m else None), "takes_messages": True}
            payloads.append(payload)
        out = []
        for i, outcome in enumerate(self._child.map(payloads, timeout_s)):
            prompt, response = rows[i][0], rows[i][1]
            at = where(numbers[i], prompt)
            if outcome.kind == "timeout" and i == 0 and outcome.reason.startswith("its process"):
                raise RewardFunctionError(f"reward function {self.name} ({self.spec}): {outcome.reason}")
            if outcome.kind == "timeout":
                raise RewardFunctionError(f"reward function {self.name} did not return within {timeout_s:g} s on "
                                          f"{at}, response {short(response)}; it was stopped with the processes it "
                                          f"started; make it faster or raise {timeout_key}")
            if outcome.kind == "crash":
                raise RewardFunctionError(f"reward function {self.name} crashed on {at}, response {short(response)}: "
                                          f"{outcome.reason} (user code calling os._exit, killing its parent, or a "
                                          "crash); what it started was stopped")
            if outcome.kind == "error":  # the child could not import it or send its answer
                raise RewardFunctionError(f"reward function {self.name} failed on {at}: {outcome.reason}")
            value = outcome.value
            if "error" in value:
                raise RewardFunctionError(value["error"])
            out.append((float(value["score"]), {str(k): float(v) for k, v in value["extra"].items()},
                        dict(value.get("info") or {})))
        return out


def _plain(value: Any) -> Any:
    """`value` as a JSON value for the contained child (a row's ``extra_info``, read from the
    data file, is one; what is not becomes its string)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def contain(fn: RewardFn | None, spec: str | None) -> RewardFn | None:
    """`fn` as resolved from `spec`, contained (`ContainedReward`) when it is a user's
    ``module:function``; the built-in scorers (ours) stay in this process."""
    if fn is None or spec is None or spec.strip().startswith(BUILTIN_PREFIX):
        return fn
    return ContainedReward(fn, spec.strip())


def decode_responses(batch: Batch, tokenizer, decode: bool = True) -> tuple[list[str], list[int | None]]:
    """Each row's response text and the column of its last response token (None for a
    row without one). The text is the ``response_mask`` tokens of ``input_ids`` up to (not
    including) the first EOS, decoded without special tokens (`decode` False: "" for each,
    the columns alone)."""
    ids = batch.tensors["input_ids"].cpu()
    mask = batch.tensors["response_mask"].cpu().bool()
    if mask.shape != ids.shape:
        raise ValueError(f"response_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}")
    eos = tokenizer.eos_token_id
    token_lists, last = [], []
    for row in range(ids.shape[0]):
        where = mask[row].nonzero().flatten()
        tokens = ids[row, where].tolist()
        if eos is not None and eos in tokens:
            tokens = tokens[:tokens.index(eos)]
        token_lists.append(tokens)
        last.append(int(where[-1]) if len(where) else None)
    if not decode:
        return [""] * len(token_lists), last
    texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True) if token_lists else []
    return texts, last


MULTI_TURN_ARRAYS = ("final_answer", "messages", "num_turns", "tool_calls", "truncated", "env_reward")
"""The per-row arrays of a multi-turn rollout (`shardwise.agents.loop.run_multi_turn`)."""


def _with_counts(extra_info: Any, num_turns: int, tool_calls: int) -> Any:
    """A copy of a row's ``extra_info`` with ``num_turns`` and ``tool_calls`` added (a dict
    for a row without one); a value that is not a dict is passed as it is."""
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        return extra_info
    return {**copy.deepcopy(extra_info), "num_turns": int(num_turns), "tool_calls": int(tool_calls)}


def score_sequences(batch: Batch, tokenizer, fn: RewardFn | None, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                    timeout_key: str = "rl.reward.timeout_s", truncated_reward: float | None = None) -> Batch:
    """Score each row's response text with `fn`; not collective (any rows, any process).

    `batch`: ``input_ids`` and ``response_mask`` ``(B, T)``, arrays ``prompt`` and
    ``ground_truth`` (str). The response text is the row's ``response_mask`` tokens up
    to (not including) the first EOS, decoded with `tokenizer` without special tokens;
    ``fn(prompt, response_text, ground_truth)`` must return a finite real number.

    Multi-turn rows (the batch has the arrays of `MULTI_TURN_ARRAYS`): the response text
    is the row's ``final_answer``; a function that takes ``messages`` gets the row's
    conversation (a copy), a verl-form one an ``extra_info`` with ``num_turns`` and
    ``tool_calls`` added (a copy); a row whose ``env_reward`` is not None is scored by it
    (the environment's ``reward()``, `fn` not called), and a ``truncated`` row by
    `truncated_reward` when that is not None (``rl.multi_turn.truncated_reward``; before
    the environment's). `fn` may be None: rows the environment gave no reward (its
    ``reward()`` raised or returned None, or its process was lost) then score 0, counted in
    "reward/env_missing".

    Returns a batch with tensor ``token_level_scores`` ``(B, T)`` fp32 (the row's score
    at its last ``response_mask`` token, 0 elsewhere), arrays ``response_text``, ``score``
    (each row's reward, float; also for a row without a response token) and
    ``reward_info`` (each row's dict of the keys a dict-returning function gave beside
    "score", as plain JSON, `shardwise.data.reward_row.row_info`; {} otherwise), and
    ``meta["metrics"]``: "reward/score_mean", "reward/score_min", "reward/score_max" over
    all rows, and "reward/empty_responses", the rows without a response token (scored,
    but their score has no token to sit on); a dict-returning function's other keys as
    "reward/<key>" (their mean over the rows it scored). Raises `RewardFunctionError`
    naming the function and the row's prompt when `fn` raises or returns a non-finite or
    non-number value, or does not return within `timeout_s` seconds (None: no limit;
    `timeout_key` is the setting the message names).
    """
    multi = "final_answer" in batch.arrays
    optional = [k for k in ("data_source", "extra_info", *(MULTI_TURN_ARRAYS if multi else ())) if k in batch.arrays]
    data = batch.select(tensor_keys=["input_ids", "response_mask"],
                        array_keys=["prompt", "ground_truth", *optional], meta_keys=[])
    ids = data.tensors["input_ids"]
    texts, last = decode_responses(data, tokenizer, decode=not multi)
    arrays = data.arrays
    n = len(texts)
    prompts, truths = arrays["prompt"], arrays["ground_truth"]
    sources = arrays.get("data_source", [None] * n)
    infos = list(arrays.get("extra_info", [None] * n))
    messages = arrays.get("messages", [None] * n)
    fixed: list[float | None] = [None] * n  # rows scored without fn
    if multi:
        texts = [str(t) for t in arrays["final_answer"]]
        infos = [_with_counts(x, k, c) for x, k, c in zip(infos, arrays["num_turns"], arrays["tool_calls"],
                                                           strict=True)]
        env = arrays.get("env_reward", [None] * n)
        cut = arrays.get("truncated", [False] * n)
        fixed = [float(truncated_reward) if truncated_reward is not None and bool(cut[row])
                 else None if env[row] is None else float(env[row]) for row in range(n)]
    missing = 0  # environment rows without a reward and no function: scored 0 (a lost environment never stops the job)
    if fn is None:
        missing = sum(f is None for f in fixed)
        fixed = [0.0 if f is None else f for f in fixed]
    todo = [row for row in range(n) if fixed[row] is None]
    with_messages = fn is not None and not isinstance(fn, ContainedReward) and takes_messages(fn)
    results: dict[int, tuple[float, dict[str, float], dict[str, Any]]] = {}
    if isinstance(fn, ContainedReward) and todo:  # one round trip to its process for the whole batch
        got = fn.score_rows([(str(prompts[r]), texts[r], str(truths[r]), sources[r], infos[r], messages[r])
                             for r in todo], timeout_s, timeout_key, numbers=todo)
        results = dict(zip(todo, got, strict=True))
    elif todo:
        results = {r: _call(fn, str(prompts[r]), texts[r], str(truths[r]), r, sources[r], infos[r], timeout_s,
                            timeout_key, messages[r], with_messages) for r in todo}
    scores = torch.zeros(ids.shape, dtype=torch.float32)
    row_scores = []
    infos_out: list[dict[str, Any]] = []
    extras: dict[str, list[float]] = {}
    for row in range(n):
        s, extra, info = results[row] if fixed[row] is None else (fixed[row], {}, {})
        row_scores.append(s)
        infos_out.append(info)
        for k, v in extra.items():
            extras.setdefault(k, []).append(v)
        if last[row] is not None:
            scores[row, last[row]] = s
    metrics: dict[str, float] = {"reward/empty_responses": float(sum(p is None for p in last))}
    if multi and fn is None:
        metrics["reward/env_missing"] = float(missing)
    if row_scores:
        metrics |= {"reward/score_mean": sum(row_scores) / len(row_scores),
                    "reward/score_min": min(row_scores), "reward/score_max": max(row_scores)}
    metrics |= {f"reward/{k}": sum(v) / len(v) for k, v in extras.items()}
    return Batch.from_dict(tensors={"token_level_scores": scores.to(batch.tensors["input_ids"].device)},
                           arrays={"response_text": texts, "score": row_scores, "reward_info": infos_out},
                           meta={"metrics": metrics})
