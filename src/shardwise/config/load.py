"""Load a YAML file plus `a.b=c` overrides into a typed `Config`, with clear errors.

YAML is read by `shardwise.config.safe_yaml` (plain data only, never eval'd; bounded in
size, nesting depth and values with aliases expanded; duplicate keys refused); override
values are parsed as YAML scalars/flow collections, so `x=3`, `x=true`, `x=[a,b]`,
`x={k: v}` work. Numbers in exponent form without a dot (`1e-5`, `3E4`) are floats.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from shardwise.config import safe_yaml
from shardwise.config.schema import Config
from shardwise.errors import ConfigError, did_you_mean, short_repr


def _yaml(text: str) -> Any:
    """Plain data of one YAML document, read with the bounds of `safe_yaml` (never eval'd)."""
    return safe_yaml.loads(text)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (or nothing) + overrides -> validated Config. Raises ConfigError."""
    raw = {} if path is None else read_yaml_mapping(path)
    return config_from_dict(apply_overrides(raw, overrides))


def read_yaml_file(path: str | Path) -> Any:
    """The plain data of a YAML file, read with the bounds of `shardwise.config.safe_yaml`
    (`read_config_text`'s checks first). ConfigError naming the file (and line) otherwise."""
    p = Path(path)
    try:
        return _yaml(read_config_text(p))
    except safe_yaml.YamlLimit as e:
        where = f"{p}:{e.line}" if e.line is not None else str(p)
        raise ConfigError(where, e.problem, e.hint) from None
    except yaml.YAMLError as e:
        raise _not_yaml(p, e) from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file that holds a mapping (empty file: {}), read with the bounds of
    `shardwise.config.safe_yaml`. ConfigError naming the file (and line) otherwise."""
    p = Path(path)
    loaded = read_yaml_file(p)
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError("", f"{p} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def read_config_text(p: Path) -> str:
    """The text of config file `p`: at most `safe_yaml.MAX_FILE_BYTES`, strict UTF-8 (a
    leading byte-order mark dropped). ConfigError for a missing file, a directory, one that
    cannot be read, is too large or is not UTF-8 text."""
    if p.is_dir():
        inside = sorted(x.name for x in p.iterdir() if x.suffix in (".yaml", ".yml"))[:3] if _readable(p) else []
        raise ConfigError("", f"config file {str(p)!r} is a directory, not a YAML file",
                          f"did you mean {p / inside[0]}?" if inside else "name the YAML file")
    if not p.exists():
        raise ConfigError("", f"config file {str(p)!r} does not exist")
    limit = safe_yaml.MAX_FILE_BYTES
    try:
        with open(p, "rb") as f:  # read() of at most limit + 1 bytes: also a FIFO or /dev/zero ends
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError("", f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConfigError(str(p), f"is larger than {limit // 2**20} MiB, far more than a config holds",
                          "a config file is a few KiB: is this a data file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{p}:{line}", f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})",
                          "save the file as UTF-8") from None
    return text.removeprefix("\ufeff")


def _not_yaml(p: Path, e: yaml.YAMLError) -> ConfigError:
    """The parser's complaint about `p` as one ConfigError naming the file and line."""
    mark = getattr(e, "problem_mark", None)
    if mark is None or getattr(e, "problem", None) is None:
        return ConfigError(str(p), f"is not valid YAML: {_short(' '.join(str(e).split()), 300)}")
    context = f"{e.context} (line {e.context_mark.line + 1}), " if getattr(e, "context", None) and e.context_mark else ""
    return ConfigError(f"{p}:{mark.line + 1}", f"is not valid YAML: {context}{_short(e.problem, 300)} "
                       f"(column {mark.column + 1})")


def _readable(p: Path) -> bool:
    try:
        next(iter(p.iterdir()), None)
        return True
    except OSError:
        return False


def _short(text: str, limit: int = 200) -> str:
    """`text` cut to at most `limit` characters (a value quoted in an error line)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate a plain dict into a Config, translating the first problem into a ConfigError."""
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise translate_error(e, raw) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b.c=value` set (value parsed as YAML)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like key.sub=value", f"e.g. {item}=...")
        key, _, text = item.partition("=")
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(key, "empty key in override", "e.g. train.max_steps=10")
        try:
            value = parse_override_value(text)
        except safe_yaml.YamlLimit as e:
            raise ConfigError(key, f"the value: {e.problem}", e.hint) from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(parts[: i + 1]), f"is a {type(nxt).__name__}, cannot set {key}")
            node = nxt
        node[parts[-1]] = value
    return out


# A module path with brace groups, e.g. model.layers.{0-3}.mlp: not valid flow YAML unquoted.
_BRACE_PATH = re.compile(r"(?<![\w\"'])((?:\w+\.)+\{[^{}]*\}(?:\.(?:\w+|\{[^{}]*\}))*)")


def parse_override_value(text: str) -> Any:
    """YAML value of an override; a [list] of brace patterns (not valid flow YAML) still works."""
    if not text.strip():
        return None
    try:
        return _yaml(text)
    except yaml.YAMLError:
        pass
    quoted = _BRACE_PATH.sub(lambda m: '"' + m.group(1) + '"', text)
    if quoted != text:
        try:
            return _yaml(quoted)
        except yaml.YAMLError:
            pass
    t = text.strip()
    if t.startswith("[") and t.endswith("]"):
        items, depth, cur = [], 0, ""
        for ch in t[1:-1]:
            depth += (ch == "{") - (ch == "}")
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
            else:
                cur += ch
        items.append(cur)
        return [parse_override_value(i) for i in items if i.strip()]
    return t


def _fields_at(loc: tuple, model: type[BaseModel] = Config) -> list[str] | None:
    """Field names (by alias) of the section at `loc`, or None if loc does not lead to a model."""
    cls: Any = model
    for part in loc:
        if get_origin(cls) is dict:  # a user-chosen key (e.g. a module_precision pattern)
            cls = _model_in(get_args(cls)[1])
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        field = _field_by_name(cls, part)
        if field is None:
            return None
        ann = field.annotation
        cls = ann if get_origin(ann) is dict else _model_in(ann)
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return [f.alias or name for name, f in cls.model_fields.items()]
    return None


def _field_by_name(cls: type[BaseModel], name: object):
    for fname, f in cls.model_fields.items():
        if name in (fname, f.alias):
            return f
    return None


def _model_in(annotation: Any) -> Any:
    """The BaseModel class inside an annotation (Optional[X], Union[...]), else the annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if isinstance(found, type) and issubclass(found, BaseModel):
            return found
    return annotation if get_origin(annotation) is None else None


def _dotted(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def translate_error(e: ValidationError, raw: dict[str, Any]) -> ConfigError:
    """One ConfigError for the most useful entry of a pydantic error (unknown keys first)."""
    errors = e.errors(include_url=False)
    for err in errors:
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ConfigError):
            return ctx_err
    # Union members produce several entries for one key; the user needs one line.
    # Within a union, the deepest error belongs to the member the input was meant for
    # (a mapping given for `dtype | {param_dtype: ...}` is judged as the mapping).
    errors.sort(key=lambda er: (er["type"] != "extra_forbidden", -len(er["loc"])))
    err = errors[0]
    loc = tuple(p for p in err["loc"] if not _is_union_tag(p))
    key = _dotted(loc)
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1]) or []
        prefix = _dotted(loc[:-1]) + "." if len(loc) > 1 else ""
        return ConfigError(key, "unknown key", did_you_mean(str(loc[-1]), fields, prefix))
    if kind == "literal_error" and len([er for er in errors if er["loc"][: len(err["loc"]) - 1] == err["loc"][:-1]]) == 1:
        expected = [s.strip().strip("'\"") for s in err["ctx"]["expected"].replace(" or ", ",").split(",")]
        return ConfigError(key, f"{short_repr(value)} is not a valid choice", did_you_mean(str(value), expected))
    if kind == "value_error":
        msg = str(err["ctx"]["error"]) if err.get("ctx") else err["msg"]
        return ConfigError(key, msg)
    if kind == "finite_number":
        return ConfigError(key, f"got {short_repr(value)}: must be a finite number", _finite_hint(loc))
    if kind == "missing":
        return ConfigError(key, "is required")
    if kind in ("model_type", "dict_type"):
        return ConfigError(key, f"must be a mapping, got {type(value).__name__} {short_repr(value)}")
    same_key = [er for er in errors if tuple(p for p in er["loc"] if not _is_union_tag(p)) == loc]
    expected = " or ".join(dict.fromkeys(_expected(er) for er in same_key))
    return ConfigError(key, f"got {short_repr(value)} ({type(value).__name__}), expected {expected}")


def _finite_hint(loc: tuple) -> str:
    """The nearest valid choice for an inf / nan given to the float key at `loc`: its
    default, or null where null is its off switch."""
    default, nullable = _default_at(loc)
    if default is None:
        return "e.g. null, the default"
    return f"e.g. {default!r}, the default" + ("; null turns it off" if nullable else "")


def _default_at(loc: tuple) -> tuple[object, bool]:
    """The schema's default at `loc` (an index into a tuple default included; None when it
    is not a number) and whether the key takes null."""
    cls: Any = Config
    value: Any = None
    nullable = False
    for part in loc:
        if isinstance(part, int) and isinstance(value, (tuple, list)) and part < len(value):
            value = value[part]
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None, False
        field = _field_by_name(cls, part)
        if field is None:
            return None, False
        value = field.default
        nullable = type(None) in get_args(field.annotation)
        cls = _model_in(field.annotation)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (value if number else None), nullable


def _expected(err: dict) -> str:
    """What a pydantic error entry says the value should have been, in a few words."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "literal_error":
        return "one of " + ctx["expected"]
    if kind.startswith("int"):
        return "an integer"
    if kind.startswith("float"):
        return "a number"
    if kind.startswith("bool"):
        return "true/false"
    if kind.startswith(("string", "str")):
        return "a string"
    if kind.startswith("list"):
        return "a list"
    if kind.startswith("tuple"):
        return "a list"
    for bound, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if bound in ctx:
            return f"a value {word} {ctx[bound]}"
    return err["msg"].lower()


def _is_union_tag(part: object) -> bool:
    """pydantic puts the union member's name into `loc` (e.g. 'int', "literal['auto']")."""
    if not isinstance(part, str):
        return False
    return part in ("int", "bool", "str", "float", "list", "dict", "tuple", "function-before[canonical_dtype(), str]") or part.startswith(("literal[", "constrained-", "function-", "PrecisionOverride", "union["))
