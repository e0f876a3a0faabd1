"""Conversations: what a chat turn is, which template renders it, and the bounded render.

A conversation is a list of turns ``{"role": ..., "content": str}`` with the roles of
`ROLES`; ShareGPT turns ``{"from": "human" | "gpt" | "system", "value": ...}`` are mapped
onto them (`normalize_messages`). A tool conversation (OpenAI / TRL format) has assistant
turns with ``tool_calls`` and ``tool`` turns holding each call's result; its function
schemas (a record's ``tools``) go to the template as ``tools``. It is rendered by the
tokenizer's chat template
(``tokenizer.chat_template``, or the file ``data.chat_template`` names, set on the
tokenizer by `use_chat_template`) in a bounded jinja sandbox (`shardwise.data.template`:
the same rendering as transformers' ``apply_chat_template``, offline, with a budget of
output and time).

This module makes text only. Which tokens a record has and which of them are trained is
`shardwise.data.encode`'s (the one road from a record to ids), which calls `render` here.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise.data import template
from shardwise.data.tasks import task_needs_tools
from shardwise.data.template import Budget, Rendered, TemplateBudgetError
from shardwise.errors import ConfigError, DataError, did_you_mean

__all__ = ["ROLES", "SHAREGPT_ROLES", "TRAIN_ON", "check_tools", "export_template", "has_generation_markers",
           "normalize_messages", "normalize_tool_calls", "render", "render_text", "text_prompts_as_chat",
           "use_chat_template"]

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
"""The roles a turn may have."""
SHAREGPT_ROLES: dict[str, str] = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                                  "assistant": "assistant", "tool": "tool", "function_response": "tool",
                                  "observation": "tool"}
"""ShareGPT's ``from`` values -> roles."""
TRAIN_ON: tuple[str, ...] = ("assistant", "last_assistant", "all")
"""``data.train_on``: every assistant turn, the last one only, or every token."""

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ---------------------------------------------------------------- messages


def normalize_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """`value` (a row's messages column) as ``[{"role", "content"}, ...]``.

    OpenAI / TRL turns (``role`` / ``content``) are kept (other keys of a turn, e.g. a
    ``tool`` turn's ``name`` / ``tool_call_id``, pass through to the template); ShareGPT
    turns (``from`` / ``value``) are mapped with `SHAREGPT_ROLES`. An assistant turn's
    ``tool_calls`` (OpenAI format, `normalize_tool_calls`) are checked and written as
    ``{"type": "function", "function": {"name", "arguments": dict}}``; such a turn may have
    no content (None: ""). Raises `DataError` naming `where` (config key, file, row) for a
    value that is not a non-empty list of turns, an unknown role, a content that is not a
    string or a malformed tool call.
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: expected a non-empty list of turns like "
                        f"{{\"role\": \"user\", \"content\": \"...\"}}, got {_describe(value)}")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: turn {i} is {_describe(turn)}, not an object with role and content")
        if "role" in turn:
            role, content, allowed = turn["role"], turn.get("content"), ROLES
            extra = {k: v for k, v in turn.items() if k not in ("role", "content")}
        elif "from" in turn:
            raw, content, allowed = turn["from"], turn.get("value"), tuple(SHAREGPT_ROLES)
            role = SHAREGPT_ROLES.get(raw, raw) if isinstance(raw, str) else raw
            extra = {}
        else:
            raise DataError(f"{where}: turn {i} has neither 'role' (OpenAI / TRL messages) nor 'from' (ShareGPT); "
                            f"its keys are {sorted(turn)}")
        if role not in ROLES:
            shown = turn.get("role", turn.get("from"))
            hint = did_you_mean(str(shown), allowed) or f"valid: {', '.join(allowed)}"
            raise DataError(f"{where}: turn {i} has the unknown role {shown!r}; {hint}")
        if "tool_calls" in extra and extra["tool_calls"] is not None:
            if role != "assistant":
                raise DataError(f"{where}: turn {i} ({role}) has tool_calls; only assistant turns call tools")
            extra["tool_calls"] = normalize_tool_calls(extra["tool_calls"], f"{where}: turn {i} (assistant)")
            if content is None:
                content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: turn {i} ({role}) has content {_describe(content)}; "
                            "every turn's content must be a string")
        turns.append({"role": role, "content": content, **extra})
    return turns


def normalize_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` as ``[{"type": "function", "function": {"name":
    str, "arguments": dict}}, ...]``. Takes OpenAI's form (``arguments`` a dict or the JSON
    text of an object, as OpenAI's API writes it; ``id`` kept) and the flat
    ``{"name", "arguments"}``. Raises `DataError` naming `where` for anything else."""
    if not isinstance(value, (list, tuple)):
        raise DataError(f"{where}: tool_calls is {_describe(value)}, not a list of calls like "
                        '{"type": "function", "function": {"name": ..., "arguments": {...}}}')
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(f"{where}: tool call {j} is {_describe(call)}; give it a function with a name, like "
                            '{"type": "function", "function": {"name": ..., "arguments": {...}}}')
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise DataError(f"{where}: tool call {j} ({fn['name']}) has arguments that are not JSON: "
                                f"{e}") from None
        if not isinstance(args, dict):
            raise DataError(f"{where}: tool call {j} ({fn['name']}) has arguments {_describe(args)}; they must "
                            "be an object (or its JSON text)")
        out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and "id" in call:
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


# ---------------------------------------------------------------- the template


def use_chat_template(tokenizer, setting: str, key: str = "data.chat_template"):
    """Set the template ``data.chat_template`` asks for on `tokenizer` (in place; returned).

    ``auto`` / ``none`` leave the tokenizer's own template (``none`` is enforced where the
    data is read: messages then are an error); any other value is a file holding a jinja
    chat template (e.g. a ``chat_template.jinja``), read here. ConfigError on `key` for a
    file that does not exist or is not UTF-8 text.
    """
    if setting in ("auto", "none"):
        return tokenizer
    tokenizer.chat_template = read_template(setting, key)
    _TEMPLATE_FILES[tokenizer] = setting
    return tokenizer


_TEMPLATE_FILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Tokenizer -> the ``data.chat_template`` file set on it (errors name where a template came from)."""


def text_prompts_as_chat(data) -> bool:
    """A text prompt is asked as one user turn of a chat (``data.format: messages``, a
    template file in ``data.chat_template``, or a built-in task that calls tools) rather
    than as ``bos + text``; `data` is the config's ``data`` section. Training prompts and
    the held-out ones follow it alike."""
    return (data.format == "messages" or data.chat_template not in ("auto", "none")
            or (data.format == "auto" and task_needs_tools(data.source)))


def read_template(path: str, key: str = "data.chat_template") -> str:
    """The jinja text of the template file `path`; ConfigError on `key` otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(key, f"{path!r} is not a file" if p.exists() else f"{path!r} does not exist",
                          "use auto (the tokenizer's template), none, or the path of a jinja template file")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError(key, f"cannot read {path!r} as UTF-8 text: {e}", "give a jinja template file") from None
    if not text.strip():
        raise ConfigError(key, f"{path!r} is empty", "give a jinja template file")
    return text


def export_template(folder: str | Path, setting: str) -> None:
    """Write the template file ``data.chat_template`` names into the exported HF `folder`
    as ``chat_template.jinja`` (what transformers loads), so the trained model is sampled
    with the template it was trained with. Nothing for ``auto`` / ``none`` (the tokenizer's
    own files are exported as they are)."""
    if setting not in ("auto", "none"):
        (Path(folder) / "chat_template.jinja").write_text(read_template(setting), encoding="utf-8")


def has_generation_markers(tokenizer) -> bool:
    """The tokenizer's template marks assistant text with ``{% generation %}``."""
    return bool(tokenizer.chat_template and _GENERATION.search(tokenizer.chat_template))


def check_template(tokenizer, where: str) -> None:
    """DataError naming `where` when `tokenizer` has no chat template to render messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the data are chat messages but the tokenizer has no chat template; set "
                        "data.chat_template to a jinja template file (e.g. an instruct model's "
                        "chat_template.jinja), or use a tokenizer folder that has one")


def template_source(tokenizer) -> str:
    """The jinja text `tokenizer` renders chats with (a folder may name several templates;
    transformers' choice among them)."""
    return tokenizer.get_chat_template()


def check_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A record's ``tools`` (the schemas its template gets): None, or a list of JSON
    objects (OpenAI function schemas, ``{"type": "function", "function": {"name", ...}}``);
    DataError naming `where` otherwise. An empty list is None (no tools)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: tools is {_describe(value)}, not a list of function schemas like "
                        '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}')
    return list(value) or None


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool, where: str,
           tools: Sequence[dict] | None = None) -> Rendered:
    """`messages` rendered by the tokenizer's template within a `Budget` sized by the
    conversation (`shardwise.data.template`): text, nothing tokenized, with the spans of
    its ``{% generation %}`` blocks and where each turn began. `tools`: the function
    schemas the template gets (``apply_chat_template(tools=...)``; None: none). Raises
    DataError naming `where` with jinja's message when the template fails, and ConfigError
    on data.chat_template naming `where` when it goes past the budget (too much output or
    time: a hostile or broken template)."""
    check_template(tokenizer, where)
    source = template_source(tokenizer)
    size = sum(len(str(v)) + 8 for m in messages for v in m.values()) + len(str(tools or ""))
    try:
        return template.render(source, list(messages), Budget.for_input(size),
                               add_generation_prompt=add_generation_prompt, tools=list(tools) if tools else None,
                               documents=None, **tokenizer.special_tokens_map)
    except TemplateBudgetError as e:
        file = _TEMPLATE_FILES.get(tokenizer)
        whose = (f"the template file {file!r}" if file is not None else
                 f"the tokenizer's own template ({getattr(tokenizer, 'name_or_path', '') or 'model.tokenizer'})")
        raise ConfigError("data.chat_template", f"{where}: {whose} went past its budget rendering this "
                          f"conversation: {e}", "set data.chat_template to a template that writes each turn "
                          "once (e.g. an instruct model's chat_template.jinja)") from None
    except Exception as e:  # jinja's TemplateError, raise_exception() in a template, a TypeError inside it
        message = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"data.chat_template: {where}: the chat template failed to render this conversation: "
                        f"{message}") from None


def render_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool, where: str,
                tools: Sequence[dict] | None = None) -> str:
    """`render`'s text."""
    return render(tokenizer, messages, add_generation_prompt, where, tools).text
