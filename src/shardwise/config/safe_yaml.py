"""YAML read with bounds: the only way shardwise turns config text into data.

A config file is read whole, at most `MAX_FILE_BYTES`, decoded as strict UTF-8, then
parsed event by event (libyaml's parser where PyYAML has it, else PyYAML's own) and
composed without recursion. While composing, the nesting depth is bounded
(`MAX_DEPTH`), and so is the number of values the document holds once every alias is
expanded (`MAX_NODES`): a "billion laughs" file (nine anchors, each a list of nine
aliases of the one before) is refused at its first alias past the bound, after a few
thousand events, instead of being expanded later by whatever walks or prints the data.
An alias of a collection that is still open (``&a [*a]``, a structure that contains
itself) is refused too. Duplicate keys in one mapping are refused, naming both lines
(YAML's loaders silently keep the last). Construction is PyYAML's SafeConstructor:
plain data only, nothing is evaluated or unpickled.

Numbers in exponent form without a dot (``1e-5``, ``3E4``) are floats, as YAML 1.2 and
every config a user copies from elsewhere mean them (PyYAML's YAML 1.1 rules read them as
strings, which then reach e.g. transformers' ``rms_norm_eps`` as text).

Every refusal is a `YamlLimit` carrying the 1-based line; `shardwise.config.load` turns it
into a ConfigError naming the file and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    DocumentEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import Resolver

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_NODES", "YamlLimit", "key_lines", "loads"]

MAX_FILE_BYTES = 10 * 2**20
"""Largest config file read (10 MiB). A shardwise or dialect config is a few KiB; a bigger
file is a mistake (a data file named as the config) or hostile."""
MAX_NODES = 20_000
"""Most values (scalars, lists and mappings, each counted once per place it appears, aliases
expanded) one document may hold. The largest config a user writes holds a few hundred; at
this bound a refused text costs about 0.2 s of composing."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings. shardwise's own keys nest 5 deep; an inline HF
config adds a few levels."""

MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass
class YamlLimit(Exception):
    """The text is refused: `problem` at 1-based `line` (None: the whole text)."""

    line: int | None
    problem: str
    hint: str | None = None

    def __str__(self) -> str:
        return self.problem


class _Resolver(Resolver):
    """PyYAML's resolver, plus floats like ``1e-5`` (see the module docstring)."""


_Resolver.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)

if getattr(yaml, "__with_libyaml__", False):
    from yaml._yaml import CParser

    class _Parser(CParser):  # type: ignore[misc]
        """libyaml's event parser: linear in the text, however deep the nesting."""
else:  # pragma: no cover - PyYAML built without libyaml
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Parser(Reader, Scanner, Parser):  # type: ignore[no-redef]
        def __init__(self, stream: str):
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)


class _Loader(_Parser, SafeConstructor, _Resolver):
    """Parser events -> nodes (`compose`, bounded) -> plain data (SafeConstructor)."""

    def __init__(self, text: str):
        _Parser.__init__(self, text)
        SafeConstructor.__init__(self)
        _Resolver.__init__(self)

    def compose(self) -> Node | None:
        """The document's root node, composed with an explicit stack (no recursion); see the
        module docstring for what is refused."""
        self.get_event()  # stream start
        if self.check_event(StreamEndEvent):
            return None
        self.get_event()  # document start
        anchors: dict[str, Node] = {}
        expanded: dict[int, int] = {}  # id(anchored node) -> values it holds, aliases expanded
        # one frame per open collection: [node, total before it, its anchor, pending key node, label]
        stack: list[list[Any]] = []
        total = 0
        root: Node | None = None

        def path() -> str:
            return "".join(f[4] for f in stack).lstrip(".")

        def count(n: int, event) -> None:
            nonlocal total
            total += n
            if total > MAX_NODES:
                raise YamlLimit(_line(event), f"holds more than {MAX_NODES:,} values once its aliases are "
                                "expanded (an alias bomb?)",
                                "write the values out; a config holds a few hundred")

        def attach(node: Node) -> str:
            """Put `node` into the open collection; the label of its place (for a path)."""
            nonlocal root
            if not stack:
                root = node
                return ""
            frame = stack[-1]
            parent = frame[0]
            if isinstance(parent, SequenceNode):
                parent.value.append(node)
                return f"[{len(parent.value) - 1}]"
            if frame[3] is None:  # a key
                frame[3] = node
                return ""
            key = frame[3]
            frame[3] = None
            parent.value.append((key, node))
            return f".{key.value}" if isinstance(key, ScalarNode) else ".<key>"

        while True:
            event = self.get_event()
            if isinstance(event, AliasEvent):
                node = anchors.get(event.anchor)
                if node is None:
                    raise yaml.composer.ComposerError(None, None, f"found undefined alias {event.anchor!r}",
                                                      event.start_mark)
                size = expanded.get(id(node))
                if size is None:
                    raise YamlLimit(_line(event), f"alias *{_short(event.anchor)} refers to a list or mapping "
                                    "that contains it (a structure without end)",
                                    "write the values out instead of the alias")
                count(size, event)
                attach(node)
            elif isinstance(event, ScalarEvent):
                self._check_anchor(event, anchors)
                tag = event.tag
                if tag is None or tag == "!":
                    tag = self.resolve(ScalarNode, event.value, event.implicit)
                node = ScalarNode(tag, event.value, event.start_mark, event.end_mark, style=event.style)
                count(1, event)
                if event.anchor is not None:
                    anchors[event.anchor] = node
                    expanded[id(node)] = 1
                attach(node)
            elif isinstance(event, (SequenceStartEvent, MappingStartEvent)):
                self._check_anchor(event, anchors)
                if len(stack) >= MAX_DEPTH:
                    raise YamlLimit(_line(event), f"nests lists and mappings more than {MAX_DEPTH} deep"
                                    + (f" (at {_short(path())})" if path() else ""),
                                    "a config nests a few levels")
                cls = SequenceNode if isinstance(event, SequenceStartEvent) else MappingNode
                tag = event.tag
                if tag is None or tag == "!":
                    tag = self.resolve(cls, None, event.implicit)
                node = cls(tag, [], event.start_mark, None, flow_style=event.flow_style)
                count(1, event)
                if event.anchor is not None:
                    anchors[event.anchor] = node  # no size yet: an alias of it now is a cycle
                label = attach(node)
                stack.append([node, total - 1, event.anchor, None, label])
            elif isinstance(event, CollectionEndEvent):
                node, before, anchor, _, _ = stack[-1]
                node.end_mark = event.end_mark
                if isinstance(node, MappingNode):
                    self._check_duplicates(node, path())
                stack.pop()
                if anchor is not None:
                    expanded[id(node)] = total - before
            else:  # pragma: no cover - the parser yields nothing else inside a document
                raise AssertionError(event)
            if not stack and root is not None:
                break
        if not self.check_event(DocumentEndEvent):  # pragma: no cover - parser guarantees it
            raise AssertionError(self.peek_event())
        self.get_event()
        if not self.check_event(StreamEndEvent):
            event = self.get_event()
            raise yaml.composer.ComposerError("expected a single document in the stream", root.start_mark,
                                              "but found another document", event.start_mark)
        return root

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """SafeConstructor's, with a value its tag cannot hold (``!!int x``, an integer of
        5,000 digits, ``2001-13-45``) refused at its line instead of a bare ValueError."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            value = node.value if isinstance(node, ScalarNode) else ""
            raise YamlLimit(node.start_mark.line + 1, f"{_short(repr(value), 80)} cannot be read as "
                            f"{node.tag.rsplit(':', 1)[-1]}: {_short(str(e), 120)}", "quote it to keep it as text") from None

    @staticmethod
    def _check_anchor(event, anchors: dict[str, Node]) -> None:
        if event.anchor is not None and event.anchor in anchors:
            raise yaml.composer.ComposerError(f"found duplicate anchor {event.anchor!r}; first occurrence",
                                              anchors[event.anchor].start_mark, "second occurrence",
                                              event.start_mark)

    def _check_duplicates(self, node: MappingNode, where: str) -> None:
        """YamlLimit at a key written twice in `node` (compared as constructed values, so
        ``true`` and ``True`` are one key). Merge keys (``<<``) may repeat what they merge."""
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the constructor refuses it later
                continue
            if first is not None:
                name = f"{where}.{key_node.value}" if where else str(key_node.value)
                raise YamlLimit(line, f"duplicate key {_short(name)!r} (first on line {first}; YAML would keep "
                                "only the last)", "keep one of the two")
            seen[key] = line


def _line(event) -> int | None:
    mark = getattr(event, "start_mark", None)
    return None if mark is None else mark.line + 1


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _compose(loader: _Loader) -> Node | None:
    """`loader.compose()`, with libyaml's own depth limit (PyYAML >= 6.0.4: its scanner,
    reading ahead through a flow collection, can reach 1,000 levels before the composer sees
    the 65th) refused like `MAX_DEPTH`."""
    try:
        return loader.compose()
    except yaml.MarkedYAMLError as e:
        if "nesting depth" not in str(e.problem or ""):
            raise
        line = e.problem_mark.line + 1 if e.problem_mark is not None else None
        raise YamlLimit(line, f"nests lists and mappings more than {MAX_DEPTH} deep",
                        "a config nests a few levels") from None


def loads(text: str) -> Any:
    """The one YAML document in `text` as plain data (None for an empty text). Raises
    `YamlLimit` for what the module docstring lists and yaml.YAMLError for text that is not
    YAML."""
    if len(text) > MAX_FILE_BYTES:
        raise YamlLimit(None, f"is {len(text) / 2**20:.1f} MiB of text, more than the {MAX_FILE_BYTES // 2**20} MiB "
                        "a config may be", "a config file is a few KiB: is this a data file?")
    nul = text.find("\0")
    if nul >= 0:
        raise YamlLimit(text.count("\n", 0, nul) + 1, "holds a NUL byte: binary data, not YAML text",
                        "name the YAML config file")
    loader = _Loader(text)
    try:
        node = _compose(loader)
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The 1-based line of every mapping key in `text`, by its path of keys from the top
    (``("train", "optimizer", "lr")``), block and flow mappings alike; keys inside lists and
    merged (``<<``) keys are left out. Composed with the same bounds as `loads`, whose
    refusals it raises."""
    loader = _Loader(text)
    try:
        root = _compose(loader)
    finally:
        loader.dispose()
    lines: dict[tuple[str, ...], int] = {}
    todo: list[tuple[tuple[str, ...], Node | None]] = [((), root)]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, MappingNode):
            continue
        for key_node, value in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == MERGE_TAG:
                continue
            here = (*path, key_node.value)
            lines.setdefault(here, key_node.start_mark.line + 1)
            todo.append((here, value))
    return lines
