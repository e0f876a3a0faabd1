"""Load the records named by ``data.source``: a built-in task or a local file.

Every source becomes a list of ``{"prompt": str, "response": str | None}``. Files are
read through the `datasets` library with the hub switched off, so a missing file is an
error here and never a download attempt.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.errors import DataError
from shardwise.data.tasks import BUILTIN_PREFIX, get_builtin_task
from shardwise.errors import nearest

FILE_FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File extension -> the `datasets` packaged builder that reads it."""


def load_records(
    source: str,
    prompt_key: str,
    response_key: str | None,
    seed: int,
    num_builtin: int = 2048,
    cache_dir: str | None = None,
) -> list[dict[str, str | None]]:
    """The records of `source`, in file order (or the task's order), as plain dicts.

    `source` is ``builtin:NAME`` (`num_builtin` examples of that task, generated from
    `seed`) or a path to a local ``.jsonl`` / ``.json`` / ``.parquet`` file. Each record
    is ``{"prompt": row[prompt_key], "response": row[response_key]}``; ``"response"`` is
    None when `response_key` is None (prompt-only data, e.g. RL prompts). Built-in task
    examples have the keys ``prompt`` and ``response`` and go through the same key
    selection. Numbers in the response column (an answer stored as ``46``) become strings.
    `cache_dir` is where `datasets` keeps its Arrow cache (default: its own).

    Raises `DataError` (a ValueError) for a missing file, an unsupported extension, a key
    the rows lack (naming the key, the file and the keys that exist, nearest first), and a
    value that is not text.
    """
    if source.startswith(BUILTIN_PREFIX):
        rows = get_builtin_task(source).make_examples(num_builtin, seed)
        columns = list(rows[0]) if rows else ["prompt", "response"]
    else:
        rows, columns = _read_file(source, cache_dir)
    _check_key(prompt_key, columns, source, "data.prompt_key")
    if response_key is not None:
        _check_key(response_key, columns, source, "data.response_key")

    records = []
    for i, row in enumerate(rows):
        prompt = row[prompt_key]
        if not isinstance(prompt, str):
            raise DataError(
                f"{source}: row {i}: '{prompt_key}' must be text, got {type(prompt).__name__} {prompt!r}"
            )
        response = None
        if response_key is not None:
            response = row[response_key]
            if isinstance(response, (int, float)) and not isinstance(response, bool):
                response = str(response)
            if not isinstance(response, str):
                raise DataError(
                    f"{source}: row {i}: '{response_key}' must be text, "
                    f"got {type(response).__name__} {response!r}"
                )
        records.append({"prompt": prompt, "response": response})
    return records


def _read_file(source: str, cache_dir: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    path = Path(source)
    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"data source '{source}' has unsupported extension '{path.suffix}': "
            f"use builtin:NAME or a file ending in {', '.join(FILE_FORMATS)}"
        )
    if not path.is_file():
        raise DataError(f"data source file '{source}' does not exist (resolved: {path.resolve()})")

    with _hub_offline():
        import datasets

        ds = datasets.load_dataset(
            fmt, data_files=str(path.resolve()), split="train", cache_dir=cache_dir
        )
    return ds.to_list(), list(ds.column_names)


def _check_key(key: str, columns: list[str], source: str, config_key: str) -> None:
    if key in columns:
        return
    near = nearest(key, columns)
    ordered = near + [c for c in columns if c not in near]
    hint = f"; did you mean '{near[0]}'?" if near else ""
    raise DataError(
        f"{config_key}: key '{key}' not found in data source '{source}'; its keys are "
        f"{', '.join(repr(c) for c in ordered) or '(none)'}{hint}"
    )


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Keep `datasets` off the network while reading a local file.

    The environment variable covers a first import of `datasets`; the module constant
    covers an import that already happened (load.py reads it at call time).
    """
    old_env = os.environ.get("HF_DATASETS_OFFLINE")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config

    old_flag = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = old_flag
        if old_env is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = old_env
