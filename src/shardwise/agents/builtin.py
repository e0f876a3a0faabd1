"""The built-in tool and environment: what the built-in tool tasks call.

- `calculator` (``shardwise.agents.builtin:calculator``, the tool of ``builtin:calc``):
  integer arithmetic with ``+ - * /`` and parentheses, evaluated by walking the parsed
  expression (`ast`), never by ``eval``: names, calls, attributes, powers and everything
  else are refused, and the size of the input and of every intermediate number is bounded.
- `GuessNumber` (``shardwise.agents.builtin:GuessNumber``, the environment of
  ``builtin:guess``): a stateful game; the model guesses a secret number with the tool
  `GuessNumber.guess` and is told ``higher``, ``lower`` or ``correct``.

Results and errors are short lowercase text, so they are made of the built-in character
tokenizer's vocabulary (`shardwise.data.tokenizer`).
"""

from __future__ import annotations

import ast
from fractions import Fraction
from typing import Any

from shardwise.data.tasks import GUESS_HIGH, GUESS_MAX_GUESSES, guess_observation

__all__ = ["MAX_DIGITS", "MAX_EXPRESSION_CHARS", "GuessNumber", "calculator"]

MAX_EXPRESSION_CHARS = 200
"""Longest expression `calculator` takes."""
MAX_DIGITS = 60
"""Most digits of any number `calculator` makes along the way (numerator or denominator)."""

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}
_MAX_BITS = int(MAX_DIGITS * 3.33) + 1


class _Refused(ValueError):
    """An expression `calculator` does not evaluate (the message says why)."""


def _bits(x: Fraction) -> int:
    return max(abs(x.numerator).bit_length(), x.denominator.bit_length())


def _value(node: ast.AST) -> Fraction:
    """The exact value of an expression made of integers, + - * /, unary signs and
    parentheses; `_Refused` for any other node or a number past MAX_DIGITS."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        out = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        inner = _value(node.operand)
        out = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and b == 0:
            raise _Refused("division by zero")
        if isinstance(node.op, (ast.Mult, ast.Div)) and _bits(a) + _bits(b) > 2 * _MAX_BITS:
            raise _Refused(f"a number would have more than {MAX_DIGITS} digits")
        out = _OPS[type(node.op)](a, b)
    elif isinstance(node, ast.Constant):
        raise _Refused(f"only integers are allowed, not {type(node.value).__name__}".lower())
    else:
        raise _Refused("only integers, + - * / and parentheses are allowed")
    if _bits(out) > _MAX_BITS:
        raise _Refused(f"a number would have more than {MAX_DIGITS} digits")
    return out


def _show(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    return format(float(x), ".10g")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: integers combined with + - * / and parentheses, e.g. "123*456" or "(7+5)/4".

    Returns:
        The value (an integer when exact, else a decimal), or a line starting "error:".
    """
    if not isinstance(expression, str):
        return f"error: the expression must be text, not {type(expression).__name__}".lower()
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    if not expression.strip():
        return "error: the expression is empty"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _show(_value(tree.body))
    except _Refused as e:
        return f"error: {e}"
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "error: not an expression of integers, + - * / and parentheses"


GUESS_LOW = 1
"""The built-in game's secret numbers lie in [GUESS_LOW, GUESS_HIGH] (unless a row says
otherwise); GUESS_MAX_GUESSES guesses are allowed (``builtin:guess``'s, `shardwise.data.tasks`)."""


class GuessNumber:
    """Guess a secret number: the built-in stateful environment (one per trajectory).

    `reset` takes the secret from the data row: its ``secret`` field, else
    ``extra_info["secret"]``, else its ``response`` / ``ground_truth`` (the built-in
    task's answer); ``low`` / ``high`` / ``max_guesses`` may come the same way.
    `guess` is its tool; `reward` is 1.0 when the number was found within `max_guesses`
    guesses, else 0.0.
    """

    def __init__(self):
        self.secret: int | None = None
        self.low, self.high, self.max_guesses = GUESS_LOW, GUESS_HIGH, GUESS_MAX_GUESSES
        self.guesses = 0
        self.solved = False

    def reset(self, **row: Any) -> str:
        """Start a game from a data row (see the class docstring); returns the first observation."""
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        fields = {**extra, **{k: v for k, v in row.items() if v is not None}}
        secret = next((fields[k] for k in ("secret", "response", "ground_truth") if fields.get(k) is not None), None)
        try:
            self.secret = int(str(secret).strip())
        except ValueError:
            raise ValueError(f"GuessNumber.reset: the row has no integer secret (got {secret!r}); give it a "
                             "'secret' field (or extra_info.secret)") from None
        self.low = int(fields.get("low", GUESS_LOW))
        self.high = int(fields.get("high", GUESS_HIGH))
        self.max_guesses = int(fields.get("max_guesses", GUESS_MAX_GUESSES))
        self.guesses, self.solved = 0, False
        return guess_observation(self.low, self.high, self.max_guesses)

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: the guess, an integer.

        Returns:
            "higher" (the secret is larger), "lower", "correct", or why the guess does not count.
        """
        if self.solved:
            return "correct"
        if self.guesses >= self.max_guesses:
            return "no guesses left"
        try:
            value = int(number)
        except (TypeError, ValueError):
            return "error: the guess must be an integer"
        self.guesses += 1
        if value == self.secret:
            self.solved = True
            return "correct"
        return "higher" if value < self.secret else "lower"

    def reward(self) -> float:
        """1.0 if the secret was guessed within the allowed guesses, else 0.0."""
        return 1.0 if self.solved else 0.0
