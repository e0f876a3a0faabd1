"""Answer scorers for GSM8K and MATH that give verl's rule-based rewards, stdlib only.

The reference is verl 0.9.1 (``verl.utils.reward_score``): tests/test_scorers.py checks
that each function here returns the same float as verl's own on several hundred strings.

- `gsm8k_score`: 1.0 when the answer read from the response's last 300 characters is
  the string `ground_truth` exactly (no normalisation of either side), else 0.0.
  Strict reads the last ``#### N`` (exactly one space after the hashes; N is digits,
  ``.`` and ``,`` with an optional leading ``-``; its commas are then dropped); flexible
  reads the last such run anywhere in the text, commas kept, a lone ``.`` skipped.
- `math_score`: 1.0 when the content of the response's last ``\\boxed{...}`` (nested
  braces balanced) equals `ground_truth` after normalising both, else 0.0 (0.0 too on any
  error). If the text has a ``\\boxed `` (with a space) anywhere, the answer is what
  follows the last one, up to the next ``$``. A ``\\fbox{...}`` never scores.
  Normalising (as in the MATH paper's evaluation) removes newlines, spaces, ``\\!``,
  ``\\left``, ``\\right``, ``^\\circ``, ``\\%``, ``\\$`` and a unit after ``\\text{ ``;
  rewrites ``tfrac`` / ``dfrac`` -> ``frac``, ``\\frac12`` -> ``\\frac{1}{2}``,
  ``\\sqrt3`` -> ``\\sqrt{3}``, ``a/b`` of integers -> ``\\frac{a}{b}``, exactly ``0.5``
  -> ``\\frac{1}{2}``, a leading ``.`` -> ``0.``; and drops up to two characters before
  the only ``=`` (``x = 5`` -> ``5``). When normalising fails (two ``\\text{ ``, a
  ``\\sqrt`` or ``\\frac`` with nothing after it) the raw strings are compared.
- `score_by_source`: the scorer verl's ``default_compute_score`` uses for a row's
  ``data_source`` (`SOURCE_SCORERS`); `UnknownDataSource` for a source it has no
  scorer for here. `SCORERS`: the scorers as ``(prompt, response, ground_truth) ->
  float`` reward functions (the prompt is ignored).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from shardwise.errors import DataError, nearest

__all__ = ["SCORERS", "SOURCE_SCORERS", "UnknownDataSource", "gsm8k_score", "math_score", "score_by_source"]

GSM8K_TAIL_CHARS = 300
"""`gsm8k_score` reads only this many characters at the end of the response."""

_NUMBER = r"-?[0-9.,]+"  # [0-9], not \d: no other scripts' digits
_STRICT_ANSWER = re.compile("#### (" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


# ---------------------------------------------------------------------- GSM8K


def _gsm8k_answer(text: str, flexible: bool) -> str | None:
    """The answer `gsm8k_score` compares, None when the text has none."""
    if len(text) > GSM8K_TAIL_CHARS:
        text = text[-GSM8K_TAIL_CHARS:]
    if not flexible:
        marked = _STRICT_ANSWER.findall(text)
        return marked[-1].replace(",", "") if marked else None
    runs = _ANY_NUMBER.findall(text)
    numbers = [r for r in runs if r != "."]
    if numbers:
        return numbers[-1]
    return "." if runs else None


def gsm8k_score(solution_str: str, ground_truth: str, flexible: bool = False) -> float:
    """1.0 when the answer of `solution_str` is the string `ground_truth`, else 0.0.

    Strict (default): the number after the last ``"#### "``, commas removed; flexible: the
    last run of digits, dots and commas (optionally ``-`` first). Only the last 300
    characters are read. A `solution_str` that is not a string raises TypeError.
    """
    answer = _gsm8k_answer(solution_str, flexible)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


# ---------------------------------------------------------------------- MATH

_BOX = "\\boxed"
_SPACED_BOX = "\\boxed "
_BRACED_BOX = "\\boxed{"
_BRACE = re.compile(r"[{}]")


class _NotNormalisable(ValueError):
    """The answer has a shape the normalisation cannot handle: compare it as it is."""


def _boxed_answer(text: str) -> str | None:
    """The content of the last box of `text`, None when there is none or it is malformed."""
    start = text.rfind(_BOX)
    if _SPACED_BOX in text:  # the space form wins over any brace form, wherever it is
        return text.rpartition(_SPACED_BOX)[2].partition("$")[0]
    if start < 0:  # verl goes on to look for an \fbox{...}, only to reject it: it never scores
        return None
    depth = 0
    for brace in _BRACE.finditer(text, start):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0 and brace.group() == "}":
            box = text[start:brace.end()]
            return box[len(_BRACED_BOX):-1] if box.startswith(_BRACED_BOX) else None
    return None


def _brace_short_args(text: str, command: str, one_arg: bool) -> str:
    """`command` followed by a bare character gets braces around it (``\\sqrt3`` ->
    ``\\sqrt{3}``); for a two-argument `command` the next character too, unless it is
    ``{`` (``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``). A
    two-argument command with a single character after it leaves the whole text as it
    was; one with nothing after it raises `_NotNormalisable`."""
    head, *pieces = text.split(command)
    out = [head]
    for piece in pieces:
        if not piece:
            raise _NotNormalisable(f"{command} without an argument")
        if piece[0] == "{":
            out.append(command + piece)
        elif one_arg:
            out.append(f"{command}{{{piece[0]}}}{piece[1:]}")
        elif len(piece) < 2:
            return text
        elif piece[1] == "{":
            out.append(f"{command}{{{piece[0]}}}{piece[1:]}")
        else:
            out.append(f"{command}{{{piece[0]}}}{{{piece[1]}}}{piece[2:]}")
    return "".join(out)


def _normalise(answer: str) -> str:
    """`answer` in the canonical form `math_score` compares (see the module docstring);
    raises `_NotNormalisable` (or AttributeError for a non-string)."""
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    for noise in ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$"):
        s = s.replace(noise, "")
    if "\\text{ " in s:  # a unit written after the value
        s, *units = s.split("\\text{ ")
        if len(units) != 1:
            raise _NotNormalisable("more than one \\text{ ")
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1:
        name, _, value = s.partition("=")
        if len(name) <= 2:
            s = value
    if "\\sqrt" in s:
        s = _brace_short_args(s, "\\sqrt", one_arg=True)
    s = s.replace(" ", "")
    s = _brace_short_args(s, "\\frac", one_arg=False)
    if s == "0.5":
        return "\\frac{1}{2}"
    return _slash_to_frac(s)


def _slash_to_frac(s: str) -> str:
    """``a/b`` of two integers written plainly (``3/4``, ``-3/4``) as ``\\frac{a}{b}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _same_answer(answer: str, truth: str) -> bool:
    if truth is None:
        return False
    try:
        return _normalise(answer) == _normalise(truth)
    except Exception:  # noqa: BLE001 (_NotNormalisable, or a truth that is not a string: as verl)
        return answer == truth


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer of `solution_str` equals `ground_truth` after
    normalisation (see the module docstring), else 0.0; 0.0 too for any input that
    raises (a non-string `solution_str`, a malformed box)."""
    try:
        answer = _boxed_answer(solution_str)
        return 1.0 if answer is not None and _same_answer(answer, ground_truth) else 0.0
    except Exception:  # noqa: BLE001 (verl scores any error 0.0)
        return 0.0


# ---------------------------------------------------------------------- by name


def _gsm8k_reward(prompt: str, response: str, ground_truth: str) -> float:
    return gsm8k_score(response, ground_truth)


def _gsm8k_flexible_reward(prompt: str, response: str, ground_truth: str) -> float:
    return gsm8k_score(response, ground_truth, flexible=True)


def _math_reward(prompt: str, response: str, ground_truth: str) -> float:
    return math_score(response, ground_truth)


SCORERS: dict[str, Callable[[str, str, str], float]] = {
    "gsm8k": _gsm8k_reward,
    "gsm8k_flexible": _gsm8k_flexible_reward,
    "math": _math_reward,
}
"""Scorer name -> ``(prompt, response, ground_truth) -> 0.0 or 1.0`` (prompt unused)."""

SOURCE_SCORERS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
}
"""verl's ``data_source`` names (exact, case-sensitive) -> the `SCORERS` name verl uses
for them (GSM8K is scored strictly)."""


class UnknownDataSource(DataError):
    """`data_source` names none of `SOURCE_SCORERS`; the one-line message lists them,
    nearest first, and says how to score such rows."""

    def __init__(self, data_source: object):
        self.data_source = data_source
        known = list(SOURCE_SCORERS)
        near = nearest(str(data_source), known, n=len(known))
        ordered = near + [k for k in known if k not in near]
        shown = " ".join(repr(data_source).split()) if not isinstance(data_source, str) else repr(data_source)
        super().__init__(f"no built-in scorer for data_source {shown} (known: {', '.join(ordered)}); set "
                         "rl.reward.function to your own module:function, or a builtin:gsm8k / builtin:math")


def score_by_source(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """The score (0.0 or 1.0) of `solution_str` against `ground_truth` by the scorer verl
    uses for `data_source`. `extra_info` is accepted for verl's signature and unused.
    Raises `UnknownDataSource` for a source not in `SOURCE_SCORERS`."""
    name = SOURCE_SCORERS.get(data_source) if isinstance(data_source, str) else None
    if name is None:
        raise UnknownDataSource(data_source)
    return SCORERS[name]("", solution_str, ground_truth)
