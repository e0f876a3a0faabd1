"""Chat templates rendered with a budget: jinja in a sandbox, bounded in output and in time.

A chat template is code from a model folder or a user's file. transformers renders it
unbounded: a 64-byte template can write ``content * 10000000`` (gigabytes in one
allocation) or loop 99,999 x 99,999 times with no output, and the launching process grows
or spins with nothing printed. Here a render (`render`) has a `Budget`:

- **output**: pieces are counted as the template writes them, and an operation that would
  build one huge value (``*``, ``**``, ``%``, ``+``, a filter or method given a huge width
  or count) is refused before it allocates;
- **time**: a watchdog thread raises `TemplateBudgetError` in the rendering thread at the
  deadline (a pending exception, delivered between bytecodes, as Ctrl-C is), so a loop
  with no output stops too. The rendering thread's Ctrl-C is not touched.

It renders like ``transformers``' ``apply_chat_template`` (the same sandbox, trim and
lstrip, ``loopcontrols``, ``tojson``, ``raise_exception``, ``strftime_now``, the
``{% generation %}`` tag) and reports, in one pass and in linear time:

- ``generation``: the character spans the template's ``{% generation %}`` blocks wrote;
- ``boundaries``: where the output stood each time the template took the next turn from
  ``messages`` (and when the turns ran out), for the templates without markers
  (`shardwise.data.encode` checks these against prefix renders before it trusts them).
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["Budget", "Rendered", "TemplateBudgetError", "render"]


class TemplateBudgetError(Exception):
    """A render went past its `Budget` (the message says which bound)."""


@dataclass(frozen=True)
class Budget:
    """Bounds on one render."""

    max_chars: int
    """Most characters the output (and any one value built while rendering) may have."""
    seconds: float
    """Wall-clock seconds the render may take."""

    @classmethod
    def for_input(cls, input_chars: int) -> Budget:
        """Room for any real template on an input of `input_chars` characters: a fixed
        4M characters (a long system prompt, tool schemas) plus 16 per input character,
        and 10 s plus 1 s per 100k input characters."""
        return cls(4_000_000 + 16 * input_chars, 10.0 + input_chars / 100_000)


@dataclass
class Rendered:
    """One render's output."""

    text: str
    generation: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` of each ``{% generation %}`` block in `text`, in order."""
    boundaries: list[list[int]] = field(default_factory=list)
    """Per full pass of the template over ``messages``: the length of the output when it
    took turn ``k`` (k = 0 .. n-1), then when the turns ran out (n + 1 values)."""


class _State:
    """The render in progress on this thread."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.pos = 0
        self.generation: list[tuple[int, int]] = []
        self.passes: list[list[int]] = []

    def check_size(self, n: int, what: str) -> None:
        if n > self.budget.max_chars:
            raise TemplateBudgetError(f"{what} would be {n:,} characters, more than the "
                                      f"{self.budget.max_chars:,} a render may write")


_local = threading.local()


def _state() -> _State | None:
    return getattr(_local, "state", None)


class _Generation(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: records the block's span in the output
    (where the output stands now, and the block's length: linear, unlike re-joining every
    piece written so far)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        text = caller()
        state = _state()
        if state is not None:
            state.generation.append((state.pos, state.pos + len(text)))
        return text


class _Turns(list):
    """``messages`` as the template sees it: a list that records, on each full iteration,
    the output length when the template takes each turn."""

    def __iter__(self) -> Iterator[Any]:
        state = _state()
        marks: list[int] = []
        for item in list.__iter__(self):
            if state is not None:
                marks.append(state.pos)
            yield item
        if state is not None:
            marks.append(state.pos)
            state.passes.append(marks)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_args(args: Sequence[Any], kwargs: dict[str, Any], what: str) -> None:
    """A width or count larger than the budget, given to a filter or method
    (``center(10**9)``, ``ljust``, ``indent``, ``wordwrap``), is refused before it runs."""
    state = _state()
    if state is None:
        return
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > state.budget.max_chars:
            state.check_size(abs(v), f"{what}'s argument")


def _checked_result(value: Any, what: str) -> Any:
    state = _state()
    if state is not None:
        state.check_size(_size(value), what)
    return value


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every size-making operation checked against the render's budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        state = _state()
        if state is not None:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, int):
                        state.check_size(_size(seq) * max(n, 0), "a repeated value ('*')")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right > 4096:
                    state.check_size(int(right * max(abs(left), 2).bit_length() / 3.3), "a power ('**')")
            elif operator == "+":
                state.check_size(_size(left) + _size(right), "a joined value ('+')")
            elif operator == "%" and isinstance(left, str):
                args = right if isinstance(right, tuple) else (right,)
                _check_args(args, {}, "a '%' format")
                for width in _format_widths(left):
                    state.check_size(width, "a '%' format's width")
        result = super().call_binop(context, operator, left, right)
        return _checked_result(result, f"a value built with {operator!r}")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        _check_args(args, kwargs, getattr(__obj, "__name__", "a call"))
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in ("format", "format_map"):
            _check_widths(re.findall(r"\{[^{}]*\}", owner), "a str.format field's width")
        _check_builder(owner, getattr(__obj, "__name__", ""), args)
        result = super().call(__context, __obj, *args, **kwargs)
        return _checked_result(result, f"the result of {getattr(__obj, '__name__', 'a call')}")


def _format_widths(fmt: str) -> list[int]:
    """The numeric widths and precisions of a ``%`` format string's conversions."""
    out, i = [], 0
    while True:
        i = fmt.find("%", i)
        if i < 0 or i + 1 >= len(fmt):
            return out
        j, digits = i + 1, ""
        while j < len(fmt) and (fmt[j].isdigit() or fmt[j] in "#0- +.("):
            if fmt[j] == "(":
                j = fmt.find(")", j) + 1 or len(fmt)
                continue
            digits = digits + fmt[j] if fmt[j].isdigit() else digits + " "
            j += 1
        out += [int(d) for d in digits.split() if d]
        i = j + 1


def _check_builder(owner: Any, name: str, args: Sequence[Any]) -> None:
    """``s.replace(old, new)`` and ``s.join(items)`` can build far more than their inputs;
    their result's size is known before they run."""
    state = _state()
    if state is None or not isinstance(owner, str):
        return
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = len(owner) + 1 if not args[0] else owner.count(args[0])
        state.check_size(len(owner) + hits * len(args[1]), "a replace()")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        state.check_size(sum(_size(x) for x in args[0]) + len(owner) * len(args[0]), "a join()")


def _check_widths(texts: Sequence[str], what: str) -> None:
    """Any run of digits in `texts` (the widths of format fields) past the budget is refused."""
    state = _state()
    if state is not None:
        for text in texts:
            for digits in re.findall(r"\d+", text):
                if len(digits) > 12 or int(digits) > state.budget.max_chars:
                    state.check_size(10**min(len(digits), 12), what)


def _bounded_filter(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _check_args(args[1:], kwargs, f"the filter {name}")
        if name == "format":
            _check_widths([a for a in args[:1] if isinstance(a, str)], "the filter format's width")
        elif name == "replace" and len(args) >= 3:
            _check_builder(str(args[0]), "replace", args[1:3])
        elif name == "join" and len(args) >= 2 and isinstance(args[1], (list, tuple)):
            _check_builder(args[2] if len(args) > 2 and isinstance(args[2], str) else "", "join", args[1:2])
        return _checked_result(fn(*args, **kwargs), f"the filter {name}'s result")
    return wrapped


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping, json.dumps' options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled once (cached, like transformers does) in the bounded sandbox.
    Raises jinja2's TemplateSyntaxError."""
    # optimized=False: jinja's optimizer would evaluate constant filters (a
    # '%0999999999d' | format(1)) while compiling, before any budget applies
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, optimized=False,
                              extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    # every filter checked: the string builders among them (center, indent, wordwrap, ...)
    # take widths; functools.wraps keeps jinja's pass_context marks on the wrapper
    for name, fn in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, fn)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------- the deadline


class _Watchdog:
    """One daemon thread for the process: when a rendering thread's deadline passes, it
    leaves a `TemplateBudgetError` pending in that thread (CPython's
    ``PyThreadState_SetAsyncExc``, delivered between bytecodes, like Ctrl-C)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._armed: dict[int, float] = {}  # thread id -> deadline
        self._fired: set[int] = set()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="shardwise-template-watchdog", daemon=True)
                self._thread.start()
            self._armed[threading.get_ident()] = deadline
            self._cond.notify()

    def disarm(self) -> None:
        tid = threading.get_ident()
        with self._cond:
            self._armed.pop(tid, None)
            if tid in self._fired:  # fired but perhaps not delivered yet: clear it
                self._fired.discard(tid)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)

    def _run(self) -> None:
        with self._cond:
            while True:
                waiting = {t: d for t, d in self._armed.items() if t not in self._fired}
                if not waiting:
                    self._cond.wait()
                    continue
                tid, deadline = min(waiting.items(), key=lambda kv: kv[1])
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._fired.add(tid)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Deadline))


class _Deadline(TemplateBudgetError):
    """Raised in the rendering thread by the watchdog."""


_watchdog = _Watchdog()


# ---------------------------------------------------------------- render


def render(source: str, messages: Sequence[dict], budget: Budget, **variables: Any) -> Rendered:
    """`source` rendered with ``messages`` and `variables` within `budget`.

    Raises `TemplateBudgetError` past the budget, and what the template raises (jinja's
    TemplateError, ``raise_exception``, a TypeError inside it) as it is.
    """
    state = _State(budget)
    if _state() is not None:
        raise RuntimeError("render() is not reentrant")
    _local.state = state
    pieces: list[str] = []
    _watchdog.arm(time.monotonic() + budget.seconds)
    try:
        try:
            template = compile_template(source)  # inside the budget too: a first compile can be slow
            for piece in template.generate(messages=_Turns(messages), **variables):
                state.pos += len(piece)
                if state.pos > budget.max_chars:
                    state.check_size(state.pos, "the output")
                pieces.append(piece)
        finally:
            _watchdog.disarm()
    except _Deadline:
        raise TemplateBudgetError(f"it ran for more than {budget.seconds:.0f} s "
                                  f"(after writing {state.pos:,} characters)") from None
    except RecursionError:
        raise TemplateBudgetError("it recursed too deeply") from None
    except MemoryError:
        raise TemplateBudgetError("it ran out of memory") from None
    finally:
        _local.state = None
    return Rendered("".join(pieces), state.generation, state.passes)
