"""Config files as the commands read them: a command's config (`load`, its own YAML or, with
``--dialect``, another system's converted), and the commands about config files
themselves: `shardwise convert` (another system's config as a shardwise YAML;
`shardwise.config.dialects`) and `shardwise config` (the resolved config, each value with
its origin, or every key's type, default and doc; `shardwise.config.describe`).
"""

from __future__ import annotations

import json
import os
import sys

from shardwise.config import describe, load_config
from shardwise.config.dialects import check_out_file, load_dialect_config, read_dialect
from shardwise.config.schema import Config
from shardwise.distributed.launch import under_torchrun
from shardwise.errors import ConfigError

__all__ = ["convert", "load", "show"]


def load(path: str, overrides: list[str], dialect: str | None = None) -> tuple[Config, int | None]:
    """A command's config (`path` with `overrides`; with `dialect`, converted from another
    system's first, what was not converted said on stderr by the launching process only),
    and the rank count its file names (a dialect's device list), or None."""
    if dialect is None:
        return load_config(path, overrides), None
    cfg, conv = load_dialect_config(path, dialect, overrides)
    if not under_torchrun():  # said once, by the launching process
        for note in conv.notes:
            print(f"shardwise: note: not converted: {note}", file=sys.stderr)
    return cfg, conv.world_size


def convert(file: str, dialect: str, out: str | None) -> None:
    """Print `file`, a config of `dialect`, as a shardwise YAML, or write it to `out`; what
    was not converted is said on stderr, one note a line."""
    if out is not None:
        check_out_file(out, file)
    conv = read_dialect(file, dialect)
    text = conv.to_yaml()
    for note in conv.notes:
        print(f"shardwise: note: not converted: {note}", file=sys.stderr)
    if out is None:
        print(text, end="")
        return
    try:
        with open(out, "w") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError("--out", f"{out!r} cannot be written: {e.strerror or e}") from None
    print(f"converted {file} ({dialect}) -> {out}", file=sys.stderr)


def show(path: str | None, overrides: list[str], dialect: str | None = None, *, only: str | None = None,
         defaults: bool = False, as_json: bool = False) -> None:
    """Print the config of `path` (a file, optional with `defaults`; a first argument with
    ``=`` that names no file is an override) with `overrides`: each value with its origin,
    or with `defaults` every key with its type, default and doc (and its value, where
    something set it); `only`: the key or section given and the keys under it."""
    if path is not None and "=" in path and not os.path.exists(path):  # overrides alone, no file
        path, overrides = None, [path, *overrides]
    if path is None and not overrides and not defaults:
        raise ConfigError("CONFIG", "name the config file to resolve",
                          "or --defaults: every key with its type, default and doc")
    resolved = None
    if path is not None or overrides or dialect is not None:
        resolved = describe.resolve(path, overrides, dialect)
        for note in resolved.notes:
            print(f"shardwise: note: not converted: {note}", file=sys.stderr)
    keep = describe.keys_under(only) if only is not None else None
    if defaults:
        table = {k: v for k, v in describe.defaults(resolved).items() if keep is None or k in keep}
        print(json.dumps(table, indent=2) if as_json else describe.format_defaults(table))
        return
    if keep is not None:
        resolved.entries = [e for e in resolved.entries if e.key in keep]
    print(json.dumps(resolved.to_json(), indent=2) if as_json else describe.format_resolved(resolved))
