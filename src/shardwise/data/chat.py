"""Conversations: chat messages checked, rendered with a chat template, and the tokens of
the assistant turns found.

A conversation is a list of turns ``{"role": ..., "content": str}`` with the roles of
`ROLES`; ShareGPT turns ``{"from": "human" | "gpt" | "system", "value": ...}`` are mapped
onto them (`normalize_messages`). It is rendered by the tokenizer's chat template
(``tokenizer.chat_template``, or the file ``data.chat_template`` names, set on the
tokenizer by `use_chat_template`) through transformers' ``apply_chat_template``: jinja2,
offline.

Which tokens are trained (`conversation_example`) is found on the rendered text, never by
searching for a turn's content:

- a template with ``{% generation %}`` markers marks the assistant text itself;
- any other template is rendered for growing prefixes of the conversation: assistant turn
  ``i`` spans from the end of ``messages[:i]`` rendered with ``add_generation_prompt`` to
  the end of ``messages[:i+1]``, whitespace the template writes after the turn's
  end-of-turn token (Qwen's newline after ``<|im_end|>``) left out. Each prefix must render
  as a prefix of the whole; a template that rewrites earlier turns (Qwen3 drops the
  reasoning of earlier turns) is an error that says to give one with markers.

The whole text is tokenized once (a fast tokenizer's character offsets place each token in
or out of a span), so the ids are those a model sees at inference, merges across turn
boundaries included. A prompt (`prompt_ids`) is its messages rendered with
``add_generation_prompt=True`` and tokenized the same way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from shardwise.errors import ConfigError, DataError, did_you_mean

__all__ = ["ROLES", "SHAREGPT_ROLES", "TRAIN_ON", "conversation_example", "export_template", "has_generation_markers",
           "normalize_messages", "prompt_ids", "prompt_text", "render_text", "text_prompts_as_chat",
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


def normalize_messages(value: Any, where: str) -> list[dict[str, str]]:
    """`value` (a row's messages column) as ``[{"role", "content"}, ...]``.

    OpenAI / TRL turns (``role`` / ``content``) are kept (other keys of a turn, e.g.
    ``tool_calls``, pass through to the template); ShareGPT turns (``from`` / ``value``)
    are mapped with `SHAREGPT_ROLES`. Raises `DataError` naming `where` (config key, file,
    row) for a value that is not a non-empty list of turns, an unknown role or a content
    that is not a string.
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
        if not isinstance(content, str):
            raise DataError(f"{where}: turn {i} ({role}) has content {_describe(content)}; "
                            "every turn's content must be a string")
        turns.append({"role": role, "content": content, **extra})
    return turns


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
    return tokenizer


def text_prompts_as_chat(data) -> bool:
    """A text prompt is asked as one user turn of a chat (``data.format: messages``, or a
    template file in ``data.chat_template``) rather than as ``bos + text``; `data` is the
    config's ``data`` section. Training prompts and the held-out ones follow it alike."""
    return data.format == "messages" or data.chat_template not in ("auto", "none")


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


def render_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool, where: str) -> str:
    """`messages` rendered by the tokenizer's template (text, nothing tokenized). Raises
    DataError naming `where` with jinja's message when the template fails."""
    check_template(tokenizer, where)
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's TemplateError, raise_exception() in a template, a TypeError inside it
        message = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"data.chat_template: {where}: the chat template failed to render this conversation: "
                        f"{message}") from None
    assert isinstance(text, str), type(text)
    return text


def _tokenize(tokenizer, text: str, where: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of `text` (no special tokens added: the template wrote them) and each token's
    character span."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: conversations need a fast tokenizer (a tokenizer.json) to place tokens in "
                        "the assistant turns; convert the tokenizer with transformers (use_fast=True)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


# ---------------------------------------------------------------- prompts


def prompt_text(tokenizer, messages: Sequence[dict], where: str = "prompt") -> str:
    """The text a model is asked: `messages` with the template's generation prompt."""
    return render_text(tokenizer, messages, True, where)


def prompt_ids(tokenizer, messages: Sequence[dict], where: str = "prompt") -> list[int]:
    """Token ids of `prompt_text` (untruncated)."""
    return _tokenize(tokenizer, prompt_text(tokenizer, messages, where), where)[0]


# ---------------------------------------------------------------- SFT examples


def assistant_spans(tokenizer, messages: Sequence[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span ``[start, end)`` of each assistant
    turn in it, in order (see the module docstring for how they are found)."""
    full = render_text(tokenizer, messages, False, where)
    if has_generation_markers(tokenizer):
        spans = _marked_spans(tokenizer, messages, full, where)
    else:
        spans = _prefix_spans(tokenizer, messages, full, where)
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    if len(spans) != n_assistant:
        raise DataError(f"{where}: the chat template marks {len(spans)} assistant spans for {n_assistant} "
                        "assistant turns; check its {% generation %} blocks (one around each assistant turn)")
    return full, spans


def _marked_spans(tokenizer, messages: Sequence[dict], full: str, where: str) -> list[tuple[int, int]]:
    try:
        rendered, indices = render_jinja_template(
            conversations=[list(messages)], chat_template=tokenizer.chat_template,
            return_assistant_tokens_mask=True, add_generation_prompt=False, **tokenizer.special_tokens_map)
    except Exception as e:
        raise DataError(f"data.chat_template: {where}: the chat template failed to render this conversation: "
                        f"{' '.join(str(e).split())}") from None
    if rendered[0] != full:
        raise DataError(f"{where}: the chat template renders differently with and without its generation markers")
    return [(int(a), int(b)) for a, b in indices[0] if b > a]


def _prefix_spans(tokenizer, messages: Sequence[dict], full: str, where: str) -> list[tuple[int, int]]:
    special = set(getattr(tokenizer, "all_special_tokens", [])) | {
        str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = render_text(tokenizer, messages[:i], True, where) if i else ""
        upto = render_text(tokenizer, messages[: i + 1], False, where)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(
                f"{where}: the chat template does not render turn {i} as a prefix of the whole conversation "
                "(it rewrites earlier turns), so the assistant tokens cannot be found from prefixes; set "
                "data.chat_template to a template whose assistant text is in {% generation %} ... "
                "{% endgeneration %} blocks")
        start, end = len(before), len(upto)
        # Layout the template writes after the end-of-turn token is not the answer.
        stripped = upto[:end].rstrip()
        if len(stripped) > start and any(stripped.endswith(tok) for tok in special if tok):
            end = len(stripped)
        spans.append((start, end))
    return spans


def conversation_example(tokenizer, messages: Sequence[dict], max_length: int, train_on: str,
                         where: str) -> tuple[dict[str, list[int]], int, int]:
    """One SFT example from a conversation: ``({"input_ids", "loss_mask"}, length, lost)``.

    `train_on` (`TRAIN_ON`): loss on the tokens of every assistant turn (their content and
    the end-of-turn marker), of the last one only, or on every token. The example keeps its
    first `max_length` tokens; `length` is the untruncated token count and `lost` counts the
    trained tokens cut off.
    """
    if train_on not in TRAIN_ON:
        raise ConfigError("data.train_on", f"{train_on!r} is not one of {', '.join(TRAIN_ON)}",
                          did_you_mean(train_on, TRAIN_ON))
    text, spans = assistant_spans(tokenizer, messages, where)
    if train_on == "last_assistant":
        spans = spans[-1:]
    ids, offsets = _tokenize(tokenizer, text, where)
    if train_on == "all":
        mask = [1] * len(ids)
    else:
        mask = [int(any(a <= s < b for a, b in spans)) if e > s else 0 for s, e in offsets]
    lost = sum(mask[max_length:])
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}, len(ids), lost
