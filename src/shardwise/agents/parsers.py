"""Tool calls read from a model's turn: the text a model generated becomes its content and
the calls it made, whatever the text holds.

A parser never raises. A call that cannot be read (bad JSON, not an object, no name,
arguments that are not an object, a block left open at the end of the turn) is still a
`ToolCall`, with ``name`` (``""`` when none could be read), empty ``arguments`` and a
one-line ``error``: the runner answers it with that error, so the model sees what it got
wrong and the tool turns answer the calls one to one.

``hermes`` (Qwen2.5 / Qwen3 / Hermes templates)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

any number of them in one turn; the turn's content is its text with the blocks removed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOL_PARSERS", "ParsedTurn", "ToolCall", "parse_hermes", "tool_call_message"]

_ERROR_LIMIT = 200
"""Most characters of a malformed call's error line."""


@dataclass(frozen=True)
class ToolCall:
    """One call a model made: the tool's `name` (``""`` when unparseable), its `arguments`
    (a JSON object) and, for a call that cannot be run as written, a one-line `error`."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn: its `content` (the text without the call blocks, stripped) and its
    `calls`, in the order they were written."""

    content: str
    calls: list[ToolCall]


def _one_line(text: str, limit: int = _ERROR_LIMIT) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.){0,200})"')
"""A name quoted in a block that is not valid JSON (to say which call was malformed)."""


def _guess_name(body: str) -> str:
    m = _NAME.search(body)
    if not m:
        return ""
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return ""
    return name if isinstance(name, str) else ""


def parse_call_json(body: str) -> ToolCall:
    """The call in one block's text: ``{"name": str, "arguments": {...}}``. ``arguments`` may
    be absent (no arguments) or a string holding a JSON object (OpenAI's wire form);
    ``parameters`` is taken for ``arguments`` (Llama 3's form). Never raises."""
    body = body.strip()
    try:
        obj: Any = json.loads(body)
    except (ValueError, RecursionError) as e:
        return ToolCall(_guess_name(body), {}, _one_line(f"the call is not valid JSON: {e}"))
    if not isinstance(obj, dict):
        return ToolCall("", {}, f"the call is a JSON {type(obj).__name__}, not an object "
                                '{"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall("", {}, 'the call has no "name" (a string naming the tool)')
    name = name.strip()
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return ToolCall(name, {}, _one_line(f'the "arguments" of {name} are not valid JSON: {e}'))
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, {}, f'the "arguments" of {name} are a JSON {type(args).__name__}, not an object')
    return ToolCall(name, args)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str) -> ParsedTurn:
    """`text`'s ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any
    number; a ``<tool_call>`` left open at the end of the turn (the budget ran out inside it)
    is a malformed call, and what follows it is not content. Never raises."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            body = text[start + len(_OPEN):]
            calls.append(ToolCall(_guess_name(body), {}, "the call was not closed (no </tool_call> before the "
                                                          "turn ended)"))
            break
        calls.append(parse_call_json(text[start + len(_OPEN):end]))
        pos = end + len(_CLOSE)
    return ParsedTurn("".join(content).strip(), calls)


TOOL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}
"""Parsers by the name ``rl.multi_turn.tool_parser`` takes."""


def tool_call_message(turn: ParsedTurn) -> dict:
    """`turn` as the OpenAI assistant message the chat templates render:
    ``{"role": "assistant", "content": str, "tool_calls": [{"type": "function", "function":
    {"name": str, "arguments": dict}}, ...]}``. Every call is listed, malformed ones too (with
    the name read, or ``""``, and empty arguments), so the tool turns that follow answer the
    calls one to one; a turn without calls has no ``tool_calls`` key."""
    message: dict = {"role": "assistant", "content": turn.content}
    if turn.calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                                 for c in turn.calls]
    return message
