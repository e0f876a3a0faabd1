"""What a config resolves to and where each value came from; every key with its type,
default and doc. ``shardwise config`` prints these.

The schema documents itself: every field carries a docstring, which pydantic reads into the
field's description (``use_attribute_docstrings``); `schema_keys` walks the fields in the
schema's order, and is the one walk both ``shardwise config --defaults`` and the test that
every field is documented (tests/test_house.py) read.

`resolve` loads a config the way every command does (YAML file or dialect file, then the
``key=value`` overrides, then validation, with the same errors) and gives each leaf key its
value and its origin:

- ``default``: nothing set it;
- ``file``: the YAML file (where: ``FILE:LINE`` of the key);
- ``dialect``: a ROLL / MindSpeed / RLinf file through `shardwise.config.dialects` (where: the
  dialect key it came from, as the converter says, and ``FILE:LINE`` when that key is written
  in the file);
- ``override``: a ``key=value`` of the command line (where: the override; a value that an
  override only partly set, e.g. ``model.config.hidden_size=64`` into the file's
  ``model.config``, names the file too).
"""

from __future__ import annotations

import re
import textwrap
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

from shardwise.config import safe_yaml
from shardwise.config.dialects import read_dialect
from shardwise.config.dtypes import canonical_dtype
from shardwise.config.load import apply_overrides, config_from_dict, read_config_text, read_yaml_mapping
from shardwise.config.schema import Config
from shardwise.errors import ConfigError, did_you_mean
from shardwise.registry import Registry

__all__ = ["Entry", "Key", "Resolved", "defaults", "format_defaults", "format_resolved", "keys_under", "resolve",
           "schema_keys",
           "type_text"]

ORIGINS = ("default", "file", "dialect", "override")
"""Where a resolved value can come from."""


@dataclass(frozen=True)
class Key:
    """One field of the schema."""

    name: str
    """Dotted, as a user types it (aliases: ``checkpoint.async``)."""
    path: tuple[str, ...]
    attr: str
    """The field's Python name (``async_save``), which a config may also use."""
    field: FieldInfo
    section: bool
    """A nested section (its keys follow it in the walk), not a value."""

    @property
    def doc(self) -> str:
        """The field's docstring, on one line."""
        return " ".join((self.field.description or "").split())


def schema_keys(model: type[BaseModel] = Config, prefix: tuple[str, ...] = ()) -> Iterator[Key]:
    """Every field of `model` and of its sections, depth first, in the schema's order."""
    for name, field in model.model_fields.items():
        path = (*prefix, field.alias or name)
        sub = _section(field.annotation)
        yield Key(".".join(path), path, name, field, sub is not None)
        if sub is not None:
            yield from schema_keys(sub, path)


def keys_under(prefix: str) -> set[str]:
    """Names of the schema keys at or under `prefix` (``rl.rollout.vllm``: that section and
    its keys); ConfigError naming the nearest key when there is none."""
    names = [k.name for k in schema_keys()]
    found = {n for n in names if n == prefix or n.startswith(prefix + ".")}
    if not found:
        raise ConfigError("--only", f"{prefix!r} is no key or section", did_you_mean(prefix, names))
    return found


def _section(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


# --------------------------------------------------------------------------- types


def type_text(field: FieldInfo) -> str:
    """The field's type in a few words: ``int >= 1``, ``float > 0 | null``, ``auto | int >= 1``,
    ``sdpa | eager | flash_attention_2``, ``dtype (fp32 | bf16 | fp16)``, ``list[str]``."""
    return _type(field.annotation, field.metadata)


def _type(ann: Any, metadata: Sequence[Any] = ()) -> str:
    origin = get_origin(ann)
    if origin is Annotated:
        base, *meta = get_args(ann)
        return _type(base, [*meta, *metadata])
    meta: list[Any] = []
    for m in metadata:  # Field(ge=1) inside Annotated carries its constraints in .metadata
        meta.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    if origin in (Union, types.UnionType):
        return " | ".join(dict.fromkeys(_type(a) for a in get_args(ann)))
    if ann is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(ann))
    for m in meta:
        func = getattr(m, "func", None)
        if isinstance(m, BeforeValidator) and func is canonical_dtype:
            return "dtype (fp32 | bf16 | fp16)"
        if isinstance(m, AfterValidator) and isinstance(getattr(func, "__self__", None), Registry):
            path = " | module:function" if func.__name__ == "check_or_path" else ""
            return " | ".join(func.__self__.names()) + path + " (registered names)"
    if ann is Any:
        return "any"
    if origin is list:
        return f"list[{_type(get_args(ann)[0])}]"
    if origin is tuple:
        return "[" + ", ".join(_type(a) for a in get_args(ann)) + "]"
    if origin is dict:
        key, value = get_args(ann)
        return "mapping" if value is Any else f"{{{_type(key)}: {_type(value)}}}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "{" + ", ".join(f.alias or n for n, f in ann.model_fields.items()) + "}"
    name = ann.__name__ if isinstance(ann, type) else str(ann)
    return _bounded(name, meta)


def _bounded(name: str, meta: Sequence[Any]) -> str:
    """`name` with the bounds in `meta`: ``int >= 1``, ``0 <= float <= 1``."""
    low = high = None
    for m in meta:  # annotated_types' Ge / Gt / Le / Lt, one bound each
        for attr, word in (("ge", ">="), ("gt", ">")):
            if getattr(m, attr, None) is not None:
                low = (word, getattr(m, attr))
        for attr, word in (("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                high = (word, getattr(m, attr))
    if low and high:
        flip = {">=": "<=", ">": "<"}
        return f"{low[1]} {flip[low[0]]} {name} {high[0]} {high[1]}"
    if low:
        return f"{name} {low[0]} {low[1]}"
    if high:
        return f"{name} {high[0]} {high[1]}"
    return name


# --------------------------------------------------------------------------- resolving


@dataclass(frozen=True)
class Entry:
    """One leaf key of a resolved config."""

    key: str
    value: Any
    """As JSON holds it (tuples as lists, dtypes by their canonical names)."""
    origin: str
    """One of `ORIGINS`."""
    where: str | None = None
    """FILE:LINE, the dialect key, or the override; None for a default."""


@dataclass
class Resolved:
    config: Config
    entries: list[Entry]
    notes: list[str]
    """A dialect file's keys read but not converted (said on stderr, as every command does)."""

    def by_key(self) -> dict[str, Entry]:
        return {e.key: e for e in self.entries}

    def to_json(self) -> dict[str, dict[str, Any]]:
        """``{key: {"value", "origin", "where"}}``: the values load back as the same Config."""
        return {e.key: {"value": e.value, "origin": e.origin, "where": e.where} for e in self.entries}


def resolve(path: str | Path | None, overrides: Sequence[str] = (), dialect: str | None = None) -> Resolved:
    """Load the config as the commands do and say where each leaf value came from.
    ConfigError for what `load_config` / `load_dialect_config` refuse."""
    overrides = list(overrides)
    notes: list[str] = []
    if dialect is None:
        raw = {} if path is None else read_yaml_mapping(path)
        kind = "file"
        sources = {} if path is None else {p: f"{path}:{n}" for p, n in _key_lines(path).items()}
    else:
        if path is None:
            raise ConfigError("--dialect", "needs CONFIG, the dialect file to convert")
        conv = read_dialect(path, dialect)
        raw, kind, notes = conv.config, "dialect", conv.notes
        lines = _key_lines(path)
        sources = {p: _dialect_where(path, text, lines) for p, text in conv.origins.items()}
    merged = apply_overrides(raw, overrides)
    cfg = config_from_dict(merged)
    dumped = cfg.model_dump(mode="json", by_alias=True)
    set_by = [(tuple(item.partition("=")[0].strip().split(".")), item) for item in overrides]
    entries = []
    for key in schema_keys():
        if key.section:
            continue
        spellings = dict.fromkeys([key.path, (*key.path[:-1], key.attr)])  # checkpoint.async / .async_save
        origin, where = next((o for o in (_origin(p, merged, raw, kind, sources, set_by, path) for p in spellings)
                              if o[0] != "default"), ("default", None))
        entries.append(Entry(key.name, _get(dumped, key.path), origin, where))
    return Resolved(cfg, entries, notes)


def _key_lines(path: str | Path) -> dict[tuple[str, ...], int]:
    """Line of each key of a config file that `read_yaml_mapping` already accepted."""
    return safe_yaml.key_lines(read_config_text(Path(path)))


_LEADING_KEY = re.compile(r"^[\w.\-]+")


def _dialect_where(path: str | Path, text: str, lines: dict[tuple[str, ...], int]) -> str:
    """The converter's words for a key's source, with FILE:LINE when it names a key of the file."""
    m = _LEADING_KEY.match(text)
    line = lines.get(tuple(m.group(0).split("."))) if m else None
    return text if line is None else f"{text} ({path}:{line})"


def _present(data: Any, path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        data = data[part]
    return data


def _origin(path: tuple[str, ...], merged: dict, raw: dict, kind: str, sources: dict[tuple[str, ...], str],
            set_by: list[tuple[tuple[str, ...], str]], source: str | Path | None) -> tuple[str, str | None]:
    if not _present(merged, path):
        return "default", None
    n = len(path)
    touching = [(p, item) for p, item in set_by if p[:n] == path[: len(p)]]
    # The last override at this key or above it replaced the value whole; later deeper
    # ones (model.config.hidden_size=64) changed part of it.
    whole = max((i for i, (p, _) in enumerate(touching) if len(p) <= n), default=None)
    if whole is not None or (touching and not _present(raw, path)):
        return "override", ", ".join(item for _, item in touching[whole or 0:])
    below = sorted({w for p, w in sources.items() if p[:n] == path})
    above = [sources[path[:i]] for i in range(n - 1, 0, -1) if path[:i] in sources]
    where = sources.get(path) or (", ".join(below) if below and kind == "dialect" else None) or \
        (above[0] if above else str(source))
    if touching:  # an override set part of what the file holds
        return "override", ", ".join(item for _, item in touching) + f" over {kind} {where}"
    assert _present(raw, path), path
    return kind, where


# --------------------------------------------------------------------------- printing


def flow(value: Any) -> str:
    """One value as flow YAML on one line (strings quoted where YAML needs it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def format_resolved(resolved: Resolved, width: int = 56) -> str:
    """``key: value  # origin where``, one line per leaf key, comments aligned."""
    heads = [f"{e.key}: {flow(e.value)}" for e in resolved.entries]
    col = min(width, max(map(len, heads)))
    return "\n".join(f"{h:<{col}}  # {e.origin}" + (f" {e.where}" if e.where else "")
                     for h, e in zip(heads, resolved.entries))


def defaults(resolved: Resolved | None = None) -> dict[str, dict[str, Any]]:
    """Every key of the schema: ``{key: {"type", "default", "doc"}}`` (a section's type is
    ``section`` and it has no default); with `resolved`, each leaf's ``value``, ``origin`` and
    ``where`` in that config too."""
    default = Config().model_dump(mode="json", by_alias=True)
    here = resolved.by_key() if resolved is not None else {}
    out: dict[str, dict[str, Any]] = {}
    for key in schema_keys():
        item: dict[str, Any] = {"type": "section"} if key.section else \
            {"type": type_text(key.field), "default": _get(default, key.path)}
        item["doc"] = key.doc
        if key.name in here:
            e = here[key.name]
            item.update(value=e.value, origin=e.origin, where=e.where)
        out[key.name] = item
    return out


def format_defaults(table: dict[str, dict[str, Any]], width: int = 92) -> str:
    """Each key on a line (``key: type = default``; a section: ``key:`` after a blank line),
    its doc wrapped below it, and the config's value where it is not the default."""
    lines: list[str] = []
    for name, item in table.items():
        if item["type"] == "section":
            lines += ["", f"{name}:"]
        else:
            lines.append(f"{name}: {item['type']} = {flow(item['default'])}")
        lines += textwrap.wrap(item["doc"], width, initial_indent="    ", subsequent_indent="    ",
                               break_on_hyphens=False, break_long_words=False)
        if item.get("origin") not in (None, "default"):
            lines.append(f"    -> {flow(item['value'])}  ({item['origin']} {item['where']})")
    return "\n".join(lines).lstrip("\n")
