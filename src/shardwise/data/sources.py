"""Load the records named by ``data.source``: a built-in task or a local file.

Every source becomes a list of ``{"prompt": str, "response": str | None}``. Files are read
here by three small readers, with nothing cached and no network:

- ``.jsonl``: one JSON object per line, blank lines skipped;
- ``.json``: a JSON array of objects. A ``.json`` file that is JSON Lines (or a
  ``.jsonl`` file that is one array) is read all the same, as the `datasets` library did;
- ``.parquet``: through ``pyarrow.parquet`` (imported only for such a file).

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

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
) -> list[dict[str, str | None]]:
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
    `response_key`; the encoder tasks read ``data.text_key`` / ``data.label_key``).
    `image_key` (VL models): each record also keeps ``"image"``, the row's value of that
    column as it is (a path, or a built-in task's in-memory image; `shardwise.models.vision`
    checks it).
    """
    pkey, rkey = key_names
    del cache_dir  # kept so older callers still work; there is no cache any more
    if source.startswith(BUILTIN_PREFIX):
        task = get_builtin_task(source)
        examples = (task.heldout_examples if heldout else task.make_examples)(num_builtin, seed)
        columns = list(examples[0]) if examples else ["prompt", "response"]
        found = _Rows(examples, [f"row {i}" for i in range(len(examples))], columns)
    else:
        found = _read_file(source)
    _check_key(prompt_key, found.columns, source, pkey)
    if response_key is not None:
        _check_key(response_key, found.columns, source, rkey)
    if image_key is not None:
        _check_key(image_key, found.columns, source, "data.image_key")

    records = []
    for row, where in zip(found.rows, found.where):
        prompt = _value(row, prompt_key, source, where, pkey)
        if not isinstance(prompt, str):
            raise _error(
                f"{pkey}: '{source}' {where}: {_quote(prompt_key)} must be text, got "
                f"{_describe(prompt)}; make every {_quote(prompt_key)} a string"
            )
        response = None
        if response_key is not None:
            response = _value(row, response_key, source, where, rkey)
            if isinstance(response, (int, float)) and not isinstance(response, bool):
                response = str(response)
            if not isinstance(response, str):
                raise _error(
                    f"{rkey}: '{source}' {where}: {_quote(response_key)} must be text, got "
                    f"{_describe(response)}; make every {_quote(response_key)} a string or number"
                )
        records.append({"prompt": prompt, "response": response})
        if image_key is not None:
            records[-1]["image"] = row.get(image_key) if isinstance(row, dict) else None
    return records


# ---------------------------------------------------------------- files


def _read_file(source: str) -> _Rows:
    """The rows of the local file `source`, after the checks on the path itself."""
    path = Path(source).expanduser()
    if path.is_dir():
        try:
            inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in FILE_FORMATS)
        except OSError:
            inside = []
        has = f" (it holds {_names(inside)})" if inside else f" (it holds no {', '.join(FILE_FORMATS)} file)"
        raise _error(
            f"data.source: '{source}' is a directory{has}; point data.source at one "
            f"{', '.join(FILE_FORMATS)} file"
        )
    suffix = path.suffix.lower()
    if suffix not in FILE_FORMATS:
        what = f"unsupported extension '{path.suffix}'" if path.suffix else "no file extension"
        tasks = ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_TASKS)
        raise _error(
            f"data.source: '{source}' has {what}: use a file ending in "
            f"{', '.join(FILE_FORMATS)}, or builtin:NAME ({tasks})"
        )
    if not path.is_file():
        raise _error(
            f"data.source: file '{source}' does not exist (resolved path {path.resolve()}); "
            "fix data.source (a relative path is read from the working directory)"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _error(f"data.source: cannot read '{source}': {e.strerror or e}; check its permissions") from None

    if suffix == ".parquet":
        found = _read_parquet(path, source)
    else:
        found = _read_json(_decode(data, source), source)
    if not found.rows:
        fix = {".json": "make it a JSON array of objects", ".parquet": "write at least one row into it"}
        raise _error(
            f"data.source: '{source}' holds no records; "
            f"{fix.get(suffix, 'write one JSON object per line into it')}"
        )
    return found


def _decode(data: bytes, source: str) -> str:
    """`data` as text: strict UTF-8, a leading byte-order mark dropped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        raise _error(
            f"data.source: '{source}' is not UTF-8: line {line} has byte 0x{data[e.start]:02x} at "
            f"byte offset {column} of the line (offset {e.start} in the file); save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


def _read_json(text: str, source: str) -> _Rows:
    """Rows of a JSON array of objects, or of JSON Lines.

    A document that starts with ``[`` is an array; anything else is read as JSON Lines,
    and, if that fails, as one (pretty-printed) object, which `datasets` also accepted.
    """
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise _error(
                f"data.source: '{source}' is not valid JSON: {e.msg} (line {e.lineno}, column "
                f"{e.colno}); fix the file (a .json file is one array of objects, or JSON Lines)"
            ) from None
        except RecursionError:
            raise _error(f"data.source: '{source}' is nested too deeply to read as JSON") from None
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _error(
                    f"data.source: '{source}' element [{i}] is {_describe(item)}, not an object; "
                    'every element of the array must be an object like {"prompt": ..., "response": ...}'
                )
        return _Rows(items, [f"row {i}" for i in range(len(items))], _columns(items))

    try:
        return _read_json_lines(text, source)
    except DataError:
        if text.lstrip().startswith("{"):
            try:
                one = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                one = None
            if isinstance(one, dict):
                return _Rows([one], ["row 0"], list(one))
        raise


def _read_json_lines(text: str, source: str) -> _Rows:
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
                f"data.source: '{source}' line {number} is not valid JSON: {e.msg} (column {e.colno}); "
                "fix or remove that line (JSON Lines: one object per line)"
            ) from None
        except RecursionError:
            raise _error(f"data.source: '{source}' line {number} is nested too deeply to read as JSON") from None
        if not isinstance(row, dict):
            raise _error(
                f"data.source: '{source}' line {number} is {_describe(row)}, not an object; "
                'write one object per line, like {"prompt": ..., "response": ...}'
            )
        where.append(f"line {number}, row {len(rows)}")
        rows.append(row)
    return _Rows(rows, where, _columns(rows))


def _read_parquet(path: Path, source: str) -> _Rows:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise _error(
            f"data.source: reading '{source}' needs pyarrow, which is not installed; "
            "pip install pyarrow, or convert the file to .jsonl"
        ) from None
    try:
        table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        why = re.sub(r"^Could not open Parquet input source '.*?': ", "", str(e).strip().splitlines()[0])
        raise _error(
            f"data.source: '{source}' is not a readable Parquet file ({_shorten(why, 120)}); "
            "rewrite it (e.g. pyarrow.parquet.write_table) or use a .jsonl file"
        ) from None
    rows = table.to_pylist()
    return _Rows(rows, [f"row {i}" for i in range(len(rows))], list(table.column_names))


def _columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(key for row in rows for key in row))


# ---------------------------------------------------------------- keys and values


def _check_key(key: str, columns: list[str], source: str, config_key: str) -> None:
    if key in columns:
        return
    near = nearest(key, columns)
    ordered = near + [c for c in columns if c not in near]
    hint = f"; did you mean '{near[0]}'?" if near else ""
    raise _error(
        f"{config_key}: key {_quote(key)} not found in data source '{source}'; its keys are "
        f"{_names(ordered) or '(none)'}{hint}"
    )


def _value(row: dict[str, Any], key: str, source: str, where: str, config_key: str) -> Any:
    """`row[key]`, for a key that other rows of the file have (`_check_key` passed)."""
    if key in row:
        return row[key]
    raise _error(
        f"{config_key}: '{source}' {where} has no key {_quote(key)}, which other rows have "
        f"(this row's keys: {_names(list(row)) or '(none)'}); add it to that row or remove the row"
    )


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
