"""Built-in tasks: synthetic examples plus a rule-based reward, needing no files.

A task is named ``builtin:NAME`` in ``data.source`` and ``rl.reward.function``. Each
example is ``{"prompt": str, "response": str}``; the response doubles as the ground
truth the task's scorer compares a generated response with.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from shardwise.errors import DataError, did_you_mean

BUILTIN_PREFIX = "builtin:"
HELDOUT_SEED_OFFSET = 10_000
"""Held-out prompts of a built-in task are generated from run.seed + this offset (the SFT
job's and the RL trainer's accuracy and `shardwise infer` all use them)."""
HELDOUT_PROMPTS = 200
"""How many held-out prompts the accuracy figures score."""

ARITHMETIC_OPS = "+-*"


def arithmetic_examples(
    n: int, seed: int, max_operand: int = 99, ops: str = "+-"
) -> list[dict[str, str]]:
    """`n` problems ``{"prompt": "12+34=", "response": "46"}``, the same for the same seed.

    Operands are drawn uniformly from ``[0, max_operand]`` and the operator uniformly
    from `ops` (any of ``+ - *``) with ``random.Random(seed)``. For ``-`` the larger
    operand comes first, so every result is a non-negative integer.
    """
    if n < 0:
        raise DataError(f"arithmetic_examples: n must be >= 0, got {n}")
    if max_operand < 0:
        raise DataError(f"arithmetic_examples: max_operand must be >= 0, got {max_operand}")
    bad = sorted(set(ops) - set(ARITHMETIC_OPS))
    if not ops or bad:
        raise DataError(
            f"arithmetic_examples: ops must be a non-empty string of {ARITHMETIC_OPS!r}, got {ops!r}"
            + (f" (unknown: {', '.join(repr(c) for c in bad)})" if bad else "")
        )
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand)
        op = rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        result = a + b if op == "+" else a - b if op == "-" else a * b
        examples.append({"prompt": f"{a}{op}{b}=", "response": str(result)})
    return examples


def first_answer(response: str) -> str:
    """The answer part of a generated response: the text before the first ``<eos>``,
    with leading whitespace removed, up to the first whitespace (newline included)."""
    head = response.split("<eos>", 1)[0].lstrip()
    parts = head.split(maxsplit=1)
    return parts[0] if parts else ""


def score_arithmetic(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 when `first_answer(response)` equals the stripped ground truth, else 0.0.

    `prompt` is unused; it is part of the signature every task scorer shares.
    """
    del prompt
    return 1.0 if first_answer(response) == ground_truth.strip() else 0.0


@dataclass(frozen=True)
class BuiltinTask:
    """One built-in task: how to make its examples and how to score a response."""

    name: str
    """The name after ``builtin:``."""
    make_examples: Callable[[int, int], list[dict[str, str]]]
    """``(n, seed) -> [{"prompt", "response"}, ...]``, deterministic in seed."""
    score: Callable[[str, str, str], float]
    """``(prompt, response, ground_truth) -> reward`` in [0, 1]."""
    description: str
    max_new_tokens: int = 6
    """Tokens the held-out evaluation lets a model generate (an answer and its eos fit)."""


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arithmetic": BuiltinTask(
        name="arithmetic",
        make_examples=lambda n, seed: arithmetic_examples(n, seed),
        score=score_arithmetic,
        description="two-operand + and - of integers in [0, 99]; exact-answer reward",
    ),
}


def get_builtin_task(name: str) -> BuiltinTask:
    """The task called `name` (``"arithmetic"`` or ``"builtin:arithmetic"``).

    Raises `DataError` (a ValueError) naming the nearest valid task for an unknown name.
    """
    key = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    if key not in BUILTIN_TASKS:
        hint = did_you_mean(key, BUILTIN_TASKS, prefix=BUILTIN_PREFIX)
        raise DataError(
            f"unknown built-in task '{name}'" + (f": {hint}" if hint else "")
        )
    return BUILTIN_TASKS[key]
