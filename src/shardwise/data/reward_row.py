"""One reward call on one row and the check of what it returned, shared by the two ways a
reward function runs: in the job's process (the built-in scorers, `shardwise.data.rewards`)
and in a contained child (a user's ``module:function``, `shardwise.contained`), which
imports this module (with shardwise's scorers and errors, no torch: the child starts in
a fraction of a second).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from typing import Any

from shardwise.data import scorers
from shardwise.errors import ShardwiseError

__all__ = ["RewardFunctionError", "checked", "describe", "invoke", "row_info", "score_row", "short", "where"]


class RewardFunctionError(ShardwiseError, RuntimeError):
    """A reward function raised, or returned something that is not a finite number, or did
    not return in time, or its contained process ended."""


def describe(fn: Callable) -> str:
    """``module.qualname`` of `fn` (the name every reward line uses)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


def short(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def where(row: int, prompt: str) -> str:
    return f"row {row} (prompt {short(prompt)})"


def invoke(fn: Callable, prompt: str, response: str, truth: str, data_source=None, extra_info=None,
           verl: bool = False, takes_extra_info: bool = True, messages=None, takes_messages: bool = False) -> Any:
    """`fn` called on one row in its form: ``(prompt, response, ground_truth)``, or verl's
    keywords (``data_source=, solution_str=, ground_truth=[, extra_info=]``); either form
    with ``messages=`` (the trajectory's conversation, None for a single-turn row) when
    `takes_messages`."""
    more = {"messages": messages} if takes_messages else {}
    if verl:
        if takes_extra_info:
            more["extra_info"] = extra_info
        return fn(data_source=data_source, solution_str=response, ground_truth=truth, **more)
    return fn(prompt, response, truth, **more)


def raised(name: str, e: BaseException, at: str, response: str) -> RewardFunctionError:
    """The error for a call of `name` that raised `e` on the row `at`."""
    if isinstance(e, scorers.UnknownDataSource):
        return RewardFunctionError(f"{e} ({at})")
    return RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e} on {at}, "
                               f"response {short(response)}")


def checked(name: str, value: Any, at: str) -> tuple[float, dict[str, float]]:
    """``(reward, extra metrics)`` of what reward function `name` returned on the row `at`:
    a real number, or a dict whose ``"score"`` is one (its other finite numbers are the
    extra metrics). RewardFunctionError otherwise, or for a value that is not finite."""
    extra: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardFunctionError(f"reward function {name} returned a dict without 'score' on {at} "
                                      f"(keys {sorted(value)}); put the reward under 'score'")
        extra = {str(k): float(v) for k, v in value.items()
                 if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))}
        value = value["score"]
    if not isinstance(value, numbers.Real):  # bool and numpy scalars included
        hint = " (convert it with .item())" if hasattr(value, "item") else ""
        raise RewardFunctionError(f"reward function {name} returned {type(value).__name__} "
                                  f"{short(repr(value))} on {at}; it must return a float{hint}")
    value = float(value)
    if not math.isfinite(value):
        raise RewardFunctionError(f"reward function {name} returned {value} on {at}; rewards must be finite")
    return value, extra


def row_info(value: Any) -> dict[str, Any]:
    """The keys beside ``"score"`` of what a reward function returned (a dict; {} for a
    number), each as plain JSON: numbers, text, booleans, null, lists and objects of them as
    they are (a numpy scalar as its Python number), anything else as its ``str``. What a
    row of the evaluation's samples file carries (an answer ``pred`` among them)."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k == "score":
            continue
        if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
            try:
                v = v.item()
            except (TypeError, ValueError):
                pass
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            v = str(v)
        out[str(k)] = v
    return out


def score_row(fn: Callable, row: dict[str, Any]) -> dict[str, Any]:
    """The contained child's adapter (`shardwise.contained.Contained`): one row (keys
    ``name``, ``row``, ``prompt``, ``response``, ``truth``, ``data_source``, ``extra_info``,
    ``verl``, ``takes_extra_info``, optionally ``messages`` and ``takes_messages``) scored by the user's `fn`: ``{"score": float, "extra":
    {...}, "info": {...}}`` (`checked`, `row_info`), or ``{"error": the one-line message}``; plain JSON either way."""
    at = where(row["row"], row["prompt"])
    try:
        value = invoke(fn, row["prompt"], row["response"], row["truth"], row.get("data_source"),
                       row.get("extra_info"), row.get("verl", False), row.get("takes_extra_info", True),
                       row.get("messages"), row.get("takes_messages", False))
    except Exception as e:
        return {"error": str(raised(row["name"], e, at, row["response"]))}
    try:
        score, extra = checked(row["name"], value, at)
    except RewardFunctionError as e:
        return {"error": str(e)}
    return {"score": score, "extra": extra, "info": row_info(value)}
