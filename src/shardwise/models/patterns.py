"""The module path pattern grammar, as one pure function over module paths.

A pattern is a dotted module path in which any segment may be a brace group:
  {*}            every child (index of a ModuleList/Sequential, or key of a ModuleDict)
  {3}            one index
  {0-23}         an inclusive range
  {1,3,5}        a list; items may mix: {0-3,8,10-11}
Several groups per path and literal suffixes after them are allowed:
  model.layers.{0-3}.mlp.experts.{*}
A brace group of names stands for each of them, inside a segment too:
  model.layers.{0-11}.self_attn.{q,k,v,o}_proj   (q_proj, k_proj, v_proj, o_proj)
and each name must match some module.

`match_pattern(pattern, module_paths, param_paths)` returns the matching module paths in
model order, or raises PatternError that names the pattern and the nearest real paths.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.errors import PatternError, nearest

_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class Segment:
    """One dotted segment: a literal name, every child (`any`), or a set of indices."""

    literal: str | None = None
    any: bool = False
    indices: frozenset[int] | None = None

    def matches(self, name: str) -> bool:
        if self.literal is not None:
            return name == self.literal
        if self.any:
            return True
        assert self.indices is not None
        return name.isdigit() and int(name) in self.indices


def parse_pattern(pattern: str, key: str = "pattern") -> tuple[Segment, ...]:
    """'model.layers.{0-3}' -> segments. Raises PatternError for a malformed pattern."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise PatternError(key, f"empty module pattern {pattern!r}")
    if pattern.count("{") != pattern.count("}"):
        raise PatternError(key, f"unbalanced braces in {pattern!r}")
    segments = []
    for raw in _split_dots(pattern):
        if raw == "":
            raise PatternError(key, f"empty segment in {pattern!r} (two dots in a row?)")
        if "{" not in raw and "}" not in raw:
            if raw == "*":
                raise PatternError(key, f"bare '*' in {pattern!r}", "write {*}")
            segments.append(Segment(literal=raw))
            continue
        if not (raw.startswith("{") and raw.endswith("}")) or raw.count("{") != 1:
            raise PatternError(key, f"segment {raw!r} of {pattern!r} mixes text and a brace group",
                               "a brace group is a whole segment, e.g. layers.{0-3}")
        body = raw[1:-1].strip()
        if body == "*":
            segments.append(Segment(any=True))
            continue
        segments.append(Segment(indices=_parse_indices(body, pattern, key)))
    return tuple(segments)


def _split_dots(pattern: str) -> list[str]:
    """Split on dots outside braces (a brace group never holds a dot, but say so clearly)."""
    parts, depth, cur = [], 0, []
    for ch in pattern:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "." and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _parse_indices(body: str, pattern: str, key: str) -> frozenset[int]:
    if not body:
        raise PatternError(key, f"empty brace group in {pattern!r}", "use {*} or indices like {0-3}")
    out: set[int] = set()
    for item in body.split(","):
        m = _ITEM.match(item)
        if not m:
            raise PatternError(key, f"bad item {item.strip()!r} in brace group {{{body}}} of {pattern!r}",
                               "items are n or a-b, e.g. {0-3,8}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise PatternError(key, f"range {lo}-{hi} in {pattern!r} runs backwards", f"write {{{hi}-{lo}}}")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def match_pattern(
    pattern: str,
    module_paths: Sequence[str],
    param_paths: Sequence[str] = (),
    key: str = "pattern",
) -> list[str]:
    """Module paths (in the given order) that `pattern` names.

    `module_paths` are the model's `named_modules()` names (the root "" may be included and
    is never matched); `param_paths` are used only to explain a parameter path given by
    mistake. Raises PatternError when nothing matches or an index is out of range.
    """
    expanded = expand_names(pattern)
    if len(expanded) > 1:
        found_any: list[str] = []
        for one in expanded:
            found_any += match_pattern(one, module_paths, param_paths, key)
        chosen = set(found_any)
        return [p for p in module_paths if p in chosen]
    segments = parse_pattern(pattern, key)
    split = [(p, p.split(".")) for p in module_paths if p]
    found = [p for p, parts in split if len(parts) == len(segments) and all(
        s.matches(n) for s, n in zip(segments, parts))]
    _check_indices_exist(pattern, segments, split, key)
    if found:
        return found
    if pattern in set(param_paths):
        owner = pattern.rsplit(".", 1)[0]
        raise PatternError(key, f"{pattern!r} names a parameter, not a module",
                           f"use the module path {owner!r}")
    collapsed = [".".join("{*}" if n.isdigit() else n for n in parts) for _, parts in split]
    near = nearest(pattern, list(dict.fromkeys(collapsed + [p for p, _ in split])), n=3)
    hint = ("nearest modules: " + ", ".join(near)) if near else None
    raise PatternError(key, f"pattern {pattern!r} matches no module", hint)


_GROUP = re.compile(r"\{([^{}]*)\}")
_INDEX_ITEM = re.compile(r"^\s*(\*|\d+\s*(-\s*\d+\s*)?)$")
_NAME_ITEM = re.compile(r"^\s*[A-Za-z_][\w-]*\s*$")


def expand_names(pattern: str) -> list[str]:
    """`pattern` with each brace group of names (``{q,k,v,o}``: an item that is not an
    index, a range or ``*``) written out, one pattern per combination, in order; a pattern
    without such a group is returned alone."""
    for m in _GROUP.finditer(pattern):
        items = m.group(1).split(",")
        # a group of names (every item a name); anything else is left to the index grammar
        if not all(_NAME_ITEM.match(i) for i in items):
            continue
        head, tail = pattern[:m.start()], pattern[m.end():]
        return [e for item in items for e in expand_names(head + item.strip() + tail)]
    return [pattern]


def _check_indices_exist(pattern: str, segments: tuple[Segment, ...], split, key: str) -> None:
    """An explicit index that no child has is an error, even if other indices matched."""
    for depth, seg in enumerate(segments):
        if seg.indices is None:
            continue
        prefix_segs = segments[:depth]
        present: set[int] = set()
        parents: set[str] = set()
        for _, parts in split:
            if len(parts) == depth + 1 and all(s.matches(n) for s, n in zip(prefix_segs, parts[:depth])):
                parents.add(".".join(parts[:depth]))
                if parts[depth].isdigit():
                    present.add(int(parts[depth]))
        if not parents:
            return  # the prefix itself does not exist; reported as "matches no module"
        missing = sorted(seg.indices - present)
        if missing:
            have = compress_indices(sorted(present)) if present else "no numbered children"
            where = sorted(parents)[0]
            raise PatternError(key, f"index {compress_indices(missing)} in {pattern!r} is out of range",
                               f"{where} has {{{have}}}")


def compress_indices(indices: Sequence[int]) -> str:
    """[0,1,2,3,8,10,11] -> '0-3,8,10-11'."""
    out: list[str] = []
    idx = sorted(set(indices))
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ",".join(out)


def looks_like_class_name(spec: str) -> bool:
    """'Qwen3DecoderLayer' is a class name; 'model.layers.{*}' or 'lm_head' is a path."""
    return "." not in spec and "{" not in spec and spec[:1].isupper()
