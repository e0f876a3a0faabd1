"""Load the records named by ``data.source``: a built-in task or a local file.

Every source becomes a list of records: ``{"prompt": str, "response": str | None}`` for
text; ``{"messages": [turns]}`` for a conversation (SFT, `load_records`'s
`conversations`); ``{"prompt": [turns], ...}`` for a prompt given as chat messages (verl's
format); plus ``"data_source"`` / ``"extra_info"`` when asked for (what a reward function
receives). Turns are checked and normalised by `shardwise.data.chat.normalize_messages`
(ShareGPT's ``from`` / ``value`` mapped to roles). Every key may be a dotted path into
nested columns (``reward_model.ground_truth``, ``extra_info.answer``, ``turns.0.value``):
JSON objects, Parquet structs and maps, and lists by index; a column whose name itself
holds the dots is taken first. Files are read here by three small readers, with nothing
cached and no network:

- ``.jsonl``: one JSON object per line, blank lines skipped;
- ``.json``: a JSON array of objects. A ``.json`` file that is JSON Lines (or a
  ``.jsonl`` file that is one array) is read all the same, as the `datasets` library did;
- ``.parquet``: through ``pyarrow.parquet`` (imported only for such a file).

A path with ``*`` / ``?`` / ``[...]`` that names no file as it is reads every file it
matches, in name order (``data/train-*.parquet``): how a Hub dataset's split arrives
(`shardwise.models.hub` resolves a dataset id into such a path in the Hub cache).

Text must be UTF-8 (a leading byte-order mark is allowed). Every problem with the source
(a missing file, a directory, an unknown extension, bytes that are not UTF-8, bad JSON, a
line that is not an object, no records at all, a key the rows lack, a value that is not
text) raises one `DataError` whose message is a single line: it names the config key
(``data.source`` / ``data.prompt_key`` / ``data.response_key``) and the file, the line or
row where that applies, and what to change. `load_records` reads and checks every row
before it returns, so a job can call it in its ``prepare`` step and fail before any
process starts.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.data.chat import check_tools, normalize_messages
from shardwise.data.tasks import BUILTIN_PREFIX, BUILTIN_TASKS, get_builtin_task
from shardwise.errors import DataError, nearest

FILE_FORMATS: tuple[str, ...] = (".jsonl", ".json", ".parquet")
"""The file extensions `load_records` reads (case-insensitive)."""

_MAX_VALUE_CHARS = 60
"""Longest quoted value (a bad line, a non-text value) a message shows before '...'."""
_MAX_KEYS_SHOWN = 12
"""Most keys a key-not-found message lists before 'and N more'."""


@dataclass
class _Rows:
    """What a reader found: the row objects, where each came from, and every key seen."""

    rows: list[dict[str, Any]]
    where: list[str]
    """Per row, its place for a message: ``line 4, row 3`` (JSON Lines) or ``row 3``."""
    columns: list[str]
    """Every key of any row, in order of first appearance."""


def load_records(
    source: str,
    prompt_key: str,
    response_key: str | None,
    seed: int,
    num_builtin: int = 2048,
    cache_dir: str | None = None,
    heldout: bool = False,
    key_names: tuple[str, str] = ("data.prompt_key", "data.response_key"),
    image_key: str | None = None,
    *,
    messages_key: str | None = None,
    fmt: str = "text",
    conversations: bool = False,
    as_chat: bool = False,
    extra_keys: dict[str, tuple[str, str, bool]] | None = None,
    source_key: str = "data.source",
) -> list[dict[str, Any]]:
    """The records of `source`, in file order (or the task's order), as plain dicts.

    `source` is ``builtin:NAME`` (`num_builtin` examples of that task, generated from
    `seed`; with `heldout`, its held-out examples, which carry true answers) or a path (``~`` expanded) to a local ``.jsonl`` / ``.json`` / ``.parquet``
    file. Each record is ``{"prompt": row[prompt_key], "response": row[response_key]}``;
    ``"response"`` is None when `response_key` is None (prompt-only data, e.g. RL
    prompts). Built-in task examples have the keys ``prompt`` and ``response`` and go
    through the same key selection. Numbers in the response column (an answer stored as
    ``46``) become strings. `cache_dir` is accepted and ignored: files are read directly,
    nothing is cached.

    Raises `DataError` (a ValueError), with a one-line message, for every problem listed
    in the module docstring; all rows are read and checked before anything is returned.
    Messages name the config keys `key_names` (those that set `prompt_key` and
    `response_key`; the encoder tasks read ``data.text_key`` / ``data.label_key``) and
    `source_key` (the key that named `source`: ``data.source``, ``eval.source``).
    `image_key` (VL models): each record also keeps ``"image"``, the row's value of that
    column as it is (a path, or a built-in task's in-memory image; `shardwise.models.vision`
    checks it).

    Conversations and chat prompts (`shardwise.data.chat`): `fmt` is ``data.format``
    (``auto``: messages when the data hold them). With `conversations` (SFT) and messages,
    each record is ``{"messages": turns}`` read from `messages_key`, which must hold at
    least one assistant turn, plus ``"tools"`` (function schemas for the template) when the
    row has a ``tools`` column. Otherwise a prompt column holding a list of turns gives
    ``"prompt": turns``; a text prompt stays text unless `fmt` is ``messages`` or `as_chat`
    (a chat template was asked for), which make it one user turn (with `conversations`:
    the user turn and the response as the assistant's). `extra_keys`: record field ->
    ``(column, config key, required)``, each read like the other keys (a column missing
    from the data gives None unless required); values must survive JSON (numbers, text,
    lists, objects).
    """
    pkey, rkey = key_names
    del cache_dir  # kept so older callers still work; there is no cache any more
    if source.startswith(BUILTIN_PREFIX):
        task = get_builtin_task(source)
        examples = (task.heldout_examples if heldout else task.make_examples)(num_builtin, seed)
        columns = list(examples[0]) if examples else ["prompt", "response"]
        found = _Rows(examples, [f"row {i}" for i in range(len(examples))], columns)
    else:
        found = _read_files(source, source_key)
    if fmt not in FORMATS:
        raise _error(f"data.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if messages_key == "messages" and not _has_key("messages", found.columns) and "conversations" in found.columns:
        messages_key = "conversations"  # ShareGPT's name, when the data have no messages column
    as_conversation = conversations and messages_key is not None and (
        fmt == "messages" or (fmt == "auto" and _has_key(messages_key, found.columns)))
    if as_conversation:
        _check_key(messages_key, found.columns, source, "data.messages_key")
    else:
        _check_key(prompt_key, found.columns, source, pkey)
        if response_key is not None:
            _check_key(response_key, found.columns, source, rkey)
    if image_key is not None:
        _check_key(image_key, found.columns, source, "data.image_key")
    extra_keys = extra_keys or {}
    present = {}
    for field, (key, config_key, required) in extra_keys.items():
        present[field] = _has_key(key, found.columns)
        if required:
            _check_key(key, found.columns, source, config_key)

    records = []
    for row, where in zip(found.rows, found.where):
        if as_conversation:
            turns = normalize_messages(_value(row, messages_key, source, where, "data.messages_key"),
                                       f"data.messages_key: '{source}' {where}")
            if not any(t["role"] == "assistant" for t in turns):
                raise _error(f"data.messages_key: '{source}' {where}: the conversation has no assistant turn, so "
                             "there is nothing to train on; add one or remove the row")
            record: dict[str, Any] = {"messages": turns}
            if isinstance(row, dict) and row.get("tools") is not None:  # the schemas its template gets
                record["tools"] = check_tools(row["tools"], f"{source_key} '{source}' {where}")
        else:
            record = {"prompt": _prompt(row, prompt_key, source, where, pkey, fmt, as_chat),
                      "response": None}
            if response_key is not None:
                response = _value(row, response_key, source, where, rkey)
                if isinstance(response, (int, float)) and not isinstance(response, bool):
                    response = str(response)
                if not isinstance(response, str):
                    raise _error(
                        f"{rkey}: '{source}' {where}: {_quote(response_key)} must be text, got "
                        f"{_describe(response)}; make every {_quote(response_key)} a string or number"
                    )
                record["response"] = response
            if conversations and isinstance(record["prompt"], list):  # SFT reads a response: the assistant's turn
                record = {"messages": record["prompt"] + [{"role": "assistant", "content": record["response"]}]}
        if "messages" in record or isinstance(record.get("prompt"), list):  # for render errors later
            record["where"] = f"{source_key} '{source}' {where}"
        for field, (key, config_key, _) in extra_keys.items():
            record[field] = _json_value(_value(row, key, source, where, config_key), source, where, config_key) \
                if present[field] else None
        records.append(record)
        if image_key is not None:
            records[-1]["image"] = row.get(image_key) if isinstance(row, dict) else None
    return records


FORMATS: tuple[str, ...] = ("auto", "text", "messages")
"""``data.format``: what a record is (auto: messages when the data hold them)."""


def _prompt(row: dict[str, Any], key: str, source: str, where: str, config_key: str, fmt: str,
            as_chat: bool) -> str | list[dict[str, Any]]:
    """A row's prompt: text, or a list of turns (a list in the data; text made one user turn
    when `fmt` is messages or `as_chat`)."""
    prompt = _value(row, key, source, where, config_key)
    if isinstance(prompt, (list, tuple)) and fmt != "text":
        return normalize_messages(prompt, f"{config_key}: '{source}' {where}")
    if not isinstance(prompt, str):
        fix = (f"make every {_quote(key)} a string, or set data.format=auto to read lists of chat messages"
               if fmt == "text" and isinstance(prompt, (list, tuple))
               else f"make every {_quote(key)} a string (or a list of chat messages)")
        raise _error(f"{config_key}: '{source}' {where}: {_quote(key)} must be text, got {_describe(prompt)}; {fix}")
    if fmt == "messages" or as_chat:
        return [{"role": "user", "content": prompt}]
    return prompt


def _json_value(value: Any, source: str, where: str, config_key: str) -> Any:
    """`value` as plain JSON data (what a reward function receives through the batch)."""
    try:
        return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError):
        raise _error(f"{config_key}: '{source}' {where}: {_describe(value)} is not JSON data (numbers, text, "
                     "lists, objects); convert that column") from None


# ---------------------------------------------------------------- files


GLOB_CHARACTERS = "*?["
"""A source path holding one of these (and naming no file as it is) is a glob of files."""


def _read_files(source: str, key: str) -> _Rows:
    """The rows of the file `source`, or of every file its glob matches (``*``, ``?``,
    ``[...]`` in the path: ``data/train-*.parquet``, the files of a Hub dataset's split),
    read in name order, each by its own reader, and concatenated; a row's place then names
    its file."""
    path = Path(source).expanduser()
    if not any(c in source for c in GLOB_CHARACTERS) or path.exists():
        return _read_file(source, key)
    files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise _error(f"{key}: '{source}' matches no file (resolved pattern {path.resolve()}); fix {key} (a "
                     "relative path is read from the working directory)")
    if len(files) == 1:
        return _read_file(files[0], key)
    rows, where, columns = [], [], []
    for f in files:
        found = _read_file(f, key)
        rows += found.rows
        where += [f"file {Path(f).name!r} {w}" for w in found.where]
        columns += [c for c in found.columns if c not in columns]
    return _Rows(rows, where, columns)


def _read_file(source: str, key: str) -> _Rows:
    """The rows of the local file `source`, after the checks on the path itself."""
    path = Path(source).expanduser()
    if path.is_dir():
        try:
            inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in FILE_FORMATS)
        except OSError:
            inside = []
        has = f" (it holds {_names(inside)})" if inside else f" (it holds no {', '.join(FILE_FORMATS)} file)"
        raise _error(
            f"{key}: '{source}' is a directory{has}; point {key} at one "
            f"{', '.join(FILE_FORMATS)} file"
        )
    suffix = path.suffix.lower()
    if suffix not in FILE_FORMATS:
        what = f"unsupported extension '{path.suffix}'" if path.suffix else "no file extension"
        tasks = ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_TASKS)
        raise _error(
            f"{key}: '{source}' has {what}: use a file ending in "
            f"{', '.join(FILE_FORMATS)}, or builtin:NAME ({tasks})"
        )
    if not path.is_file():
        raise _error(
            f"{key}: file '{source}' does not exist (resolved path {path.resolve()}); "
            f"fix {key} (a relative path is read from the working directory)"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _error(f"{key}: cannot read '{source}': {e.strerror or e}; check its permissions") from None

    if suffix == ".parquet":
        found = _read_parquet(path, source, key)
    else:
        found = _read_json(_decode(data, source, key), source, key)
    if not found.rows:
        fix = {".json": "make it a JSON array of objects", ".parquet": "write at least one row into it"}
        raise _error(
            f"{key}: '{source}' holds no records; "
            f"{fix.get(suffix, 'write one JSON object per line into it')}"
        )
    return found


def _decode(data: bytes, source: str, key: str) -> str:
    """`data` as text: strict UTF-8, a leading byte-order mark dropped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        raise _error(
            f"{key}: '{source}' is not UTF-8: line {line} has byte 0x{data[e.start]:02x} at "
            f"byte offset {column} of the line (offset {e.start} in the file); save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


def _read_json(text: str, source: str, key: str) -> _Rows:
    """Rows of a JSON array of objects, or of JSON Lines.

    A document that starts with ``[`` is an array; anything else is read as JSON Lines,
    and, if that fails, as one (pretty-printed) object, which `datasets` also accepted.
    """
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise _error(
                f"{key}: '{source}' is not valid JSON: {e.msg} (line {e.lineno}, column "
                f"{e.colno}); fix the file (a .json file is one array of objects, or JSON Lines)"
            ) from None
        except RecursionError:
            raise _error(f"{key}: '{source}' is nested too deeply to read as JSON") from None
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _error(
                    f"{key}: '{source}' element [{i}] is {_describe(item)}, not an object; "
                    'every element of the array must be an object like {"prompt": ..., "response": ...}'
                )
        return _Rows(items, [f"row {i}" for i in range(len(items))], _columns(items))

    try:
        return _read_json_lines(text, source, key)
    except DataError:
        if text.lstrip().startswith("{"):
            try:
                one = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                one = None
            if isinstance(one, dict):
                return _Rows([one], ["row 0"], list(one))
        raise


def _read_json_lines(text: str, source: str, key: str) -> _Rows:
    rows, where = [], []
    # Split on "\n" only: str.splitlines also splits on U+2028 and friends, which JSON
    # allows raw inside strings.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise _error(
                f"{key}: '{source}' line {number} is not valid JSON: {e.msg} (column {e.colno}); "
                "fix or remove that line (JSON Lines: one object per line)"
            ) from None
        except RecursionError:
            raise _error(f"{key}: '{source}' line {number} is nested too deeply to read as JSON") from None
        if not isinstance(row, dict):
            raise _error(
                f"{key}: '{source}' line {number} is {_describe(row)}, not an object; "
                'write one object per line, like {"prompt": ..., "response": ...}'
            )
        where.append(f"line {number}, row {len(rows)}")
        rows.append(row)
    return _Rows(rows, where, _columns(rows))


def _read_parquet(path: Path, source: str, key: str) -> _Rows:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise _error(
            f"{key}: reading '{source}' needs pyarrow, which is not installed; "
            "pip install pyarrow, or convert the file to .jsonl"
        ) from None
    try:
        table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        why = re.sub(r"^Could not open Parquet input source '.*?': ", "", str(e).strip().splitlines()[0])
        raise _error(
            f"{key}: '{source}' is not a readable Parquet file ({_shorten(why, 120)}); "
            "rewrite it (e.g. pyarrow.parquet.write_table) or use a .jsonl file"
        ) from None
    rows = [_plain(row) for row in table.to_pylist()]
    return _Rows(rows, [f"row {i}" for i in range(len(rows))], list(table.column_names))


def _plain(value: Any) -> Any:
    """pyarrow's Python form as JSON's: a map column (a list of ``(key, value)`` tuples,
    the only tuples `to_pylist` makes) becomes a dict, recursively."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
            return {str(k): _plain(v) for k, v in value}
        return [_plain(v) for v in value]
    return value


def _columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(key for row in rows for key in row))


# ---------------------------------------------------------------- keys and values


def _has_key(key: str, columns: list[str]) -> bool:
    """`key` (a column, or a dotted path whose first part is one) can be looked up."""
    return key in columns or key.split(".", 1)[0] in columns


def _check_key(key: str, columns: list[str], source: str, config_key: str) -> None:
    if _has_key(key, columns):
        return
    head = key.split(".", 1)[0]
    near = nearest(head, columns)
    ordered = near + [c for c in columns if c not in near]
    hint = f"; did you mean '{near[0]}'?" if near else ""
    what = f"key {_quote(key)}" if head == key else f"key {_quote(key)} (its first part {_quote(head)})"
    raise _error(
        f"{config_key}: {what} not found in data source '{source}'; its keys are "
        f"{_names(ordered) or '(none)'}{hint}"
    )


def _value(row: dict[str, Any], key: str, source: str, where: str, config_key: str) -> Any:
    """`row[key]`, or the value a dotted `key` leads to, for a key whose first part other
    rows have (`_check_key` passed)."""
    if key in row:
        return row[key]
    parts = key.split(".")
    if parts[0] not in row:
        raise _error(
            f"{config_key}: '{source}' {where} has no key {_quote(parts[0])}, which other rows have "
            f"(this row's keys: {_names(list(row)) or '(none)'}); add it to that row or remove the row"
        )
    value: Any = row
    for i, part in enumerate(parts):
        here = ".".join(parts[:i]) or "the row"
        if isinstance(value, dict):
            if part not in value:
                keys = [str(k) for k in value]
                near = nearest(part, keys)
                hint = f"; did you mean '{'.'.join(parts[:i] + [near[0]])}'?" if near else ""
                raise _error(f"{config_key}: {_quote(key)} names nothing in '{source}' {where}: {here} has no key "
                             f"{_quote(part)} (its keys: {_names(keys) or '(none)'}){hint}")
            value = value[part]
        elif isinstance(value, list):
            if not (part.isdigit() and int(part) < len(value)):
                raise _error(f"{config_key}: {_quote(key)} names nothing in '{source}' {where}: {here} is a list of "
                             f"{len(value)} items, indexed 0 to {len(value) - 1}, not by {_quote(part)}")
            value = value[int(part)]
        else:
            raise _error(f"{config_key}: {_quote(key)} names nothing in '{source}' {where}: {here} is "
                         f"{_describe(value)}, which has no key {_quote(part)}")
    return value


# ---------------------------------------------------------------- message pieces


def _error(message: str) -> DataError:
    """A DataError whose message is one line whatever went into it (a path, a key)."""
    return DataError(message.replace("\r", "\\r").replace("\n", "\\n"))


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _describe(value: Any) -> str:
    """``int 3``, ``a string 'abc'``, ``an array [1, 2]``: the kind of a value and a short form of it."""
    if value is None:
        return "null"
    kind = _JSON_KINDS.get(type(value), type(value).__name__)
    try:
        shown = json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else repr(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return f"{kind} {_shorten(shown, _MAX_VALUE_CHARS)}"


def _quote(name: str) -> str:
    """A key name in quotes, shortened, control characters escaped."""
    return repr(_shorten(str(name), _MAX_VALUE_CHARS))


def _names(names: list[str]) -> str:
    shown = ", ".join(_quote(n) for n in names[:_MAX_KEYS_SHOWN])
    if len(names) > _MAX_KEYS_SHOWN:
        shown += f" and {len(names) - _MAX_KEYS_SHOWN} more"
    return shown


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
