"""The worker side of `shardwise.agents.execute.ToolRunner`: what runs in each contained
child (`shardwise.contained.Contained` with target ``shardwise.agents.host:serve``).

One request is a JSON object ``{"op": ..., ...}``; the answer is JSON too, and every fault
of the user's code becomes ``{"status": "error", "text": one line}`` (the runner turns it
into the text the model reads). Kept here, in this process, between requests: the user's
functions and classes, imported on first use (or by ``load``), and the environments of the
trajectories pinned to this child, by trajectory id. When this process ends (a tool hung,
crashed or killed it) they are gone with it, and a later call of one of those trajectories
is answered as lost.

Standard library only: a child starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

__all__ = ["LOST", "serve"]

LOST = "the environment of this trajectory was lost (its process ended)"
_REASON_LIMIT = 300

_objects: dict[str, Any] = {}
"""``module:attr`` -> the function or class, imported once."""
_environments: dict[str, Any] = {}
"""Trajectory id -> its environment instance."""


def _one_line(text: object, limit: int = _REASON_LIMIT) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _failed(e: BaseException) -> str:
    return _one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _resolve(spec: str) -> Any:
    if spec not in _objects:
        module_name, _, attr_path = spec.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr_path.split(".") if attr_path else ():
            obj = getattr(obj, part)
        _objects[spec] = obj
    return _objects[spec]


def _error(text: str) -> dict:
    return {"status": "error", "text": text}


def _bind(fn: Callable, name: str, arguments: dict, extra: dict) -> tuple[dict | None, str]:
    """``(the keyword arguments, "")`` to call `fn` with: the model's `arguments` and, over
    them, those of the data's `extra` that `fn` takes (all of them when it takes
    ``**kwargs``); ``(None, why)`` when they do not fit its signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {**arguments, **extra}, ""
    params = sig.parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.KEYWORD_ONLY)}
        extra = {k: v for k, v in extra.items() if k in names}
    kwargs = {**arguments, **extra}
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        return None, f"wrong arguments for {name}: {_one_line(e)} (it takes {_one_line(sig, 200)})"
    return kwargs, ""


def _text(name: str, value: Any, max_chars: int) -> dict:
    """A tool's return value as the answer: a string, cut to its first `max_chars`
    characters; anything else is an error naming its type."""
    if not isinstance(value, str):
        return _error(f"{name} returned {type(value).__name__}, not a string (a tool returns the text the model "
                      "reads)")
    return {"status": "ok", "text": value[:max_chars]}


def _call(fn: Callable, name: str, arguments: Any, extra: Any, max_chars: int) -> dict:
    if not isinstance(arguments, dict):
        return _error(f"the arguments of {name} are not an object")
    kwargs, why = _bind(fn, name, arguments, extra if isinstance(extra, dict) else {})
    if kwargs is None:
        return _error(why)
    try:
        value = fn(**kwargs)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the model's error, one line
        return _error(f"{name} raised {_failed(e)}")
    return _text(name, value, max_chars)


def _load(specs: list[str]) -> dict:
    """Import `specs` ahead of the first call (their import is not timed as a call)."""
    problems = []
    for spec in specs:
        try:
            _resolve(spec)
        except BaseException as e:
            problems.append(f"{spec}: {_failed(e)}")
    return {"status": "error", "text": "; ".join(problems)} if problems else {"status": "ok", "text": ""}


def _reset(env: str, traj: str, row: Any, max_chars: int) -> dict:
    _environments.pop(traj, None)
    try:
        instance = _resolve(env)()
    except BaseException as e:
        return _error(f"constructing {env} raised {_failed(e)}")
    observation = None
    reset = getattr(instance, "reset", None)
    if reset is not None:
        row = row if isinstance(row, dict) else {}
        kwargs, why = _bind(reset, "reset", {}, row)
        if kwargs is None:
            return _error(f"{env}.reset cannot take the row's fields: {why}")
        try:
            observation = reset(**kwargs)
        except BaseException as e:
            return _error(f"{env}.reset raised {_failed(e)}")
        if observation is not None and not isinstance(observation, str):
            return _error(f"{env}.reset returned {type(observation).__name__}, not a string or None (the first "
                          "observation the model reads)")
    _environments[traj] = instance
    return {"status": "ok", "text": None if observation is None else observation[:max_chars]}


def _env_call(traj: str, method: str, arguments: Any, extra: Any, max_chars: int) -> dict:
    instance = _environments.get(traj)
    if instance is None:
        return _error(LOST)
    fn = getattr(instance, method, None)
    if fn is None or not callable(fn):
        return _error(f"the environment has no method {method!r}")
    return _call(fn, method, arguments, extra, max_chars)


def _reward(traj: str) -> dict:
    instance = _environments.get(traj)
    if instance is None:
        return _error(LOST)
    try:
        value = instance.reward()
    except BaseException as e:
        return _error(f"reward() raised {_failed(e)}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return _error(f"reward() returned {_one_line(repr(value), 80)}, not a finite number")
    return {"status": "ok", "value": float(value)}


def _end(traj: str) -> dict:
    instance = _environments.pop(traj, None)
    close = getattr(instance, "close", None)
    if close is not None:
        try:
            close()
        except BaseException as e:
            return _error(f"close() raised {_failed(e)}")
    return {"status": "ok", "text": ""}


def serve(op: str, **fields: Any) -> dict:
    """One request (called by `shardwise.contained` with the request's fields):

    - ``load``: ``specs`` imported;
    - ``call``: the function ``spec`` called as ``name`` with ``arguments`` and ``extra``;
    - ``reset``: an environment ``env`` constructed for trajectory ``traj`` and reset with
      ``row``; ``text`` is its first observation or None;
    - ``env_call``: the method ``method`` of ``traj``'s environment;
    - ``reward``: ``traj``'s environment's ``reward()`` as ``value``;
    - ``end``: ``traj``'s environment closed (its ``close()``, if any) and forgotten.

    Returns ``{"status": "ok" | "error", "text": ...}`` (``value`` for reward); texts are cut
    to their first ``max_chars`` characters."""
    max_chars = int(fields.get("max_chars", 4096))
    if op == "load":
        return _load(list(fields.get("specs", [])))
    if op == "call":
        name = str(fields.get("name", ""))
        try:
            fn = _resolve(fields["spec"])
        except BaseException as e:
            return _error(f"importing {fields.get('spec')} failed: {_failed(e)}")
        return _call(fn, name, fields.get("arguments"), fields.get("extra"), max_chars)
    if op == "reset":
        return _reset(fields["env"], str(fields["traj"]), fields.get("row"), max_chars)
    if op == "env_call":
        return _env_call(str(fields["traj"]), str(fields["method"]), fields.get("arguments"), fields.get("extra"),
                         max_chars)
    if op == "reward":
        return _reward(str(fields["traj"]))
    if op == "end":
        return _end(str(fields["traj"]))
    return _error(f"unknown request {op!r}")
