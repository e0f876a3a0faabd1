"""Built-in tasks: synthetic examples plus a rule-based reward, needing no files.

A task is named ``builtin:NAME`` in ``data.source`` and ``rl.reward.function``. Each
example is ``{"prompt": str, "response": str}``; the response doubles as the ground
truth the task's scorer compares a generated response with. A task's held-out prompts
(`BuiltinTask.heldout_examples`) always carry the true answer; its training rows may not
(``reverse_mixed``: demonstrations from two writers, one of whom ignores the instruction).

- ``arithmetic``: ``"12+34="`` -> ``"46"`` (two-operand + and - in [0, 99]);
- ``reverse``: ``"abcd="`` -> ``"dcba"`` (a word of 3 to 6 lowercase letters, reversed);
- ``reverse_mixed``: SFT rows for ``reverse`` from a mix of writers: 40% reverse the
  word, 60% copy it unchanged. A model trained on them can reverse (sampling finds the
  reversal) but greedily copies: the gap between pass@k and pass@1 that RL with the
  ``reverse`` reward closes (the demo, examples/sft_reverse.yaml and grpo_reverse.yaml).
- ``count``: ``"23:27="`` -> ``"23,24,25,26,27"``: count from one two-digit number to a
  larger one, 3 to 33 numbers (how many: log-uniform), so answers run from 8 to 98 tokens,
  36 on average with a long tail, and a batch's answers differ in length several-fold as
  sampled answers do: the task for RL at real lengths;
- ``count_mixed``: SFT rows for ``count`` from two writers: 40% count up, 60% count down
  from the larger number (``"27,26,25,24,23"``), the ``reverse_mixed`` design with long
  answers (the long-answer demo, examples/sft_long.yaml and grpo_long.yaml, and
  ``benchmarks/rl_vs_trl.py --task long``).
- ``colours`` / ``colours_mixed``: for vision-language models, an image of a coloured
  shape -> its colour (`shardwise.data.visual`); records carry an ``image``.
- ``calc``: ``"123*456="`` -> ``"56088"``: the product of two 3-digit numbers, which a tiny
  model cannot compute but can get from its tool, ``shardwise.agents.builtin:calculator``
  (`BuiltinTask.tools`). Its training rows also carry ``messages``, the SFT
  demonstrations: `CALC_TOOL_SHARE` of them use the tool (user, assistant calling
  ``calculator``, the tool's result, assistant answering it), the others answer directly
  with the true product (which the model cannot learn, so RL that rewards right answers
  raises the share of trajectories that call the tool). Reward: the final answer's
  exact match.
- ``guess``: ``"guess my number."`` -> the secret (1 to 15): a stateful environment,
  ``shardwise.agents.builtin:GuessNumber`` (`BuiltinTask.environment`), answers each
  ``guess`` with higher / lower / correct; demonstrations search by halving.

A task that calls tools (`BuiltinTask.needs_tools`) is a chat task: its prompts are asked
as one user turn (`shardwise.data.chat.text_prompts_as_chat`), and the jobs build the
built-in tokenizer's tools variant for it (`shardwise.data.tokenizer`).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from shardwise.data import visual
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


REVERSE_COPY_SHARE = 0.6
"""Share of ``reverse_mixed`` demonstrations that copy the word instead of reversing it."""


def _words(n: int, seed: int, min_len: int, max_len: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
            for _ in range(n)]


def reverse_examples(n: int, seed: int, min_len: int = 3, max_len: int = 6) -> list[dict[str, str]]:
    """`n` problems ``{"prompt": "abcd=", "response": "dcba"}``, the same for the same seed:
    words of `min_len` to `max_len` letters (length and letters uniform) drawn with
    ``random.Random(seed)``."""
    if n < 0:
        raise DataError(f"reverse_examples: n must be >= 0, got {n}")
    return [{"prompt": f"{w}=", "response": w[::-1]} for w in _words(n, seed, min_len, max_len)]


def reverse_mixed_demonstrations(n: int, seed: int, copy_share: float = REVERSE_COPY_SHARE) -> list[dict[str, str]]:
    """The prompts of `reverse_examples(n, seed)`, each answered by one of two writers:
    with probability `copy_share` one who copies the word, else one who reverses it (the
    writer drawn per row from its own ``random.Random(seed)`` stream)."""
    if not 0.0 <= copy_share <= 1.0:
        raise DataError(f"reverse_mixed_demonstrations: copy_share must be in [0, 1], got {copy_share}")
    writer = random.Random(f"writer-{seed}")
    return [{"prompt": r["prompt"], "response": r["prompt"][:-1] if writer.random() < copy_share else r["response"]}
            for r in reverse_examples(n, seed)]


COUNT_MIN_NUMBERS = 3
COUNT_MAX_NUMBERS = 33
"""Numbers in a ``count`` answer: 3 to 33, each two digits and a comma, so 8 to 98 tokens."""
COUNT_DOWN_SHARE = 0.6
"""Share of ``count_mixed`` demonstrations that count down instead of up."""


def count_examples(n: int, seed: int, min_numbers: int = COUNT_MIN_NUMBERS,
                   max_numbers: int = COUNT_MAX_NUMBERS) -> list[dict[str, str]]:
    """`n` problems ``{"prompt": "23:27=", "response": "23,24,25,26,27"}``, the same for the
    same seed (``random.Random(seed)``): how many numbers, k in [`min_numbers`,
    `max_numbers`], is log-uniform (as many answers of 3-6 numbers as of 17-33: about 12
    numbers, 36 tokens on average for 3-33), the first number uniform among the two-digit
    ones that leave room for k."""
    if n < 0:
        raise DataError(f"count_examples: n must be >= 0, got {n}")
    if not 1 <= min_numbers <= max_numbers <= 90:
        raise DataError(f"count_examples: need 1 <= min_numbers <= max_numbers <= 90, got {min_numbers}, "
                        f"{max_numbers}")
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        k = min(max_numbers, int(min_numbers * ((max_numbers + 1) / min_numbers) ** rng.random()))
        a = rng.randint(10, 100 - k)
        examples.append({"prompt": f"{a}:{a + k - 1}=", "response": ",".join(str(x) for x in range(a, a + k))})
    return examples


def count_mixed_demonstrations(n: int, seed: int, down_share: float = COUNT_DOWN_SHARE) -> list[dict[str, str]]:
    """The prompts of `count_examples(n, seed)`, each answered by one of two writers: with
    probability `down_share` one who counts down from the larger number, else one who counts
    up (the writer drawn per row from its own ``random.Random`` stream, as
    `reverse_mixed_demonstrations` does)."""
    if not 0.0 <= down_share <= 1.0:
        raise DataError(f"count_mixed_demonstrations: down_share must be in [0, 1], got {down_share}")
    writer = random.Random(f"writer-{seed}")
    return [{"prompt": r["prompt"],
             "response": ",".join(reversed(r["response"].split(","))) if writer.random() < down_share
             else r["response"]}
            for r in count_examples(n, seed)]


CALC_TOOL = "shardwise.agents.builtin:calculator"
"""The tool of ``builtin:calc``."""
CALC_TOOL_SHARE = 0.3
"""Share of ``calc`` demonstrations that call the calculator (the rest answer directly)."""


def calc_examples(n: int, seed: int) -> list[dict[str, str]]:
    """`n` problems ``{"prompt": "123*456=", "response": "56088"}`` (both factors uniform
    in [100, 999], ``random.Random(seed)``), the same for the same seed."""
    if n < 0:
        raise DataError(f"calc_examples: n must be >= 0, got {n}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"prompt": f"{a}*{b}=", "response": str(a * b)})
    return rows


def tool_call(name: str, **arguments) -> dict:
    """One OpenAI-format tool call ``{"type": "function", "function": {"name", "arguments"}}``."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def calc_demonstrations(n: int, seed: int, tool_share: float = CALC_TOOL_SHARE) -> list[dict]:
    """The rows of `calc_examples(n, seed)`, each with ``messages``: with probability
    `tool_share` (per row, its own ``random.Random`` stream) a tool conversation (the user's
    prompt, the assistant calling ``calculator(expression="123*456")``, the tool's result,
    the assistant answering it), else the prompt answered directly (the true product)."""
    if not 0.0 <= tool_share <= 1.0:
        raise DataError(f"calc_demonstrations: tool_share must be in [0, 1], got {tool_share}")
    writer = random.Random(f"writer-{seed}")
    rows = []
    for r in calc_examples(n, seed):
        user = {"role": "user", "content": r["prompt"]}
        if writer.random() < tool_share:
            call = tool_call("calculator", expression=r["prompt"].removesuffix("="))
            turns = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "calculator", "content": r["response"]},
                     {"role": "assistant", "content": r["response"]}]
        else:
            turns = [user, {"role": "assistant", "content": r["response"]}]
        rows.append({**r, "messages": turns})
    return rows


GUESS_ENVIRONMENT = "shardwise.agents.builtin:GuessNumber"
"""The environment of ``builtin:guess``."""
GUESS_HIGH = 15
"""``guess``'s secrets lie in [1, GUESS_HIGH] (`shardwise.agents.builtin.GuessNumber`'s default range)."""
GUESS_MAX_GUESSES = 4
"""Guesses a ``guess`` game allows (halving needs 4 for 15 numbers)."""
GUESS_PROMPT = "guess my number."


def guess_observation(low: int = 1, high: int = GUESS_HIGH, max_guesses: int = GUESS_MAX_GUESSES) -> str:
    """The first observation of a ``guess`` game (what `GuessNumber.reset` returns; a
    multi-turn rollout asks it as a user turn after the prompt, as the demonstrations do)."""
    return f"i chose a number from {low} to {high}. you have {max_guesses} guesses."


def guess_examples(n: int, seed: int) -> list[dict[str, str]]:
    """`n` games ``{"prompt": GUESS_PROMPT, "response": "9"}``: a secret uniform in
    [1, GUESS_HIGH] (``random.Random(seed)``)."""
    if n < 0:
        raise DataError(f"guess_examples: n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [{"prompt": GUESS_PROMPT, "response": str(rng.randint(1, GUESS_HIGH))} for _ in range(n)]


def guess_demonstrations(n: int, seed: int) -> list[dict]:
    """The rows of `guess_examples(n, seed)`, each with ``messages``: the prompt, the
    environment's first observation (a user turn, `guess_observation`), then the game
    played by halving the range (at most 4 guesses for 15 numbers), each guess an assistant
    turn calling ``guess`` and answered higher / lower / correct, then the number as the
    final answer."""
    rows = []
    for r in guess_examples(n, seed):
        secret, low, high = int(r["response"]), 1, GUESS_HIGH
        turns: list[dict] = [{"role": "user", "content": r["prompt"]}, {"role": "user", "content": guess_observation()}]
        while True:
            mid = (low + high) // 2
            answer = "correct" if mid == secret else "higher" if mid < secret else "lower"
            turns += [{"role": "assistant", "content": "", "tool_calls": [tool_call("guess", number=mid)]},
                      {"role": "tool", "name": "guess", "content": answer}]
            if answer == "correct":
                break
            low, high = (mid + 1, high) if answer == "higher" else (low, mid - 1)
        turns.append({"role": "assistant", "content": r["response"]})
        rows.append({**r, "messages": turns})
    return rows


def first_answer(response: str) -> str:
    """The answer part of a generated response: the text before the first ``<eos>``,
    with leading whitespace removed, up to the first whitespace (newline included)."""
    head = response.split("<eos>", 1)[0].lstrip()
    parts = head.split(maxsplit=1)
    return parts[0] if parts else ""


def score_exact(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 when `first_answer(response)` equals the stripped ground truth, else 0.0.

    `prompt` is unused; it is part of the signature every task scorer shares.
    """
    del prompt
    return 1.0 if first_answer(response) == ground_truth.strip() else 0.0


score_arithmetic = score_exact


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
    make_heldout: Callable[[int, int], list[dict[str, str]]] | None = None
    """Held-out examples with true answers, when the training rows are not (None: the
    training rows' maker)."""
    tools: tuple[str, ...] = ()
    """The tools (``module:function``) its trajectories may call."""
    environment: str | None = None
    """The environment (``module:Class``) each of its trajectories plays, if any."""

    @property
    def needs_tools(self) -> bool:
        """Its trajectories call tools: a chat task, with the tokenizer's tools variant."""
        return bool(self.tools) or self.environment is not None

    def heldout_examples(self, n: int, seed: int) -> list[dict[str, str]]:
        """`n` examples to evaluate on, generated from `seed`, each with its true answer."""
        return (self.make_heldout or self.make_examples)(n, seed)


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arithmetic": BuiltinTask(
        name="arithmetic",
        make_examples=lambda n, seed: arithmetic_examples(n, seed),
        score=score_exact,
        description="two-operand + and - of integers in [0, 99]; exact-answer reward",
    ),
    "reverse": BuiltinTask(
        name="reverse",
        make_examples=reverse_examples,
        score=score_exact,
        description="reverse a word of 3 to 6 lowercase letters; exact-answer reward",
        max_new_tokens=8,
    ),
    "reverse_mixed": BuiltinTask(
        name="reverse_mixed",
        make_examples=reverse_mixed_demonstrations,
        score=score_exact,
        description=f"builtin:reverse demonstrated by two writers ({REVERSE_COPY_SHARE:.0%} copy the word); "
                    "held-out prompts and the reward are builtin:reverse's",
        max_new_tokens=8,
        make_heldout=reverse_examples,
    ),
    "count": BuiltinTask(
        name="count",
        make_examples=count_examples,
        score=score_exact,
        description=f"count from one two-digit number up to another ({COUNT_MIN_NUMBERS} to {COUNT_MAX_NUMBERS} "
                    "numbers, comma-separated: 8 to 98 tokens); exact-answer reward",
        max_new_tokens=3 * COUNT_MAX_NUMBERS,  # the longest answer (3k - 1 tokens) and its eos
    ),
    "count_mixed": BuiltinTask(
        name="count_mixed",
        make_examples=count_mixed_demonstrations,
        score=score_exact,
        description=f"builtin:count demonstrated by two writers ({COUNT_DOWN_SHARE:.0%} count down); "
                    "held-out prompts and the reward are builtin:count's",
        max_new_tokens=3 * COUNT_MAX_NUMBERS,
        make_heldout=count_examples,
    ),
    "colours": BuiltinTask(
        name="colours",
        make_examples=visual.colour_examples,
        score=score_exact,
        description="vision-language: name the colour of the shape in the image; exact-answer reward",
        max_new_tokens=8,
    ),
    "colours_mixed": BuiltinTask(
        name="colours_mixed",
        make_examples=visual.colour_mixed_demonstrations,
        score=score_exact,
        description="builtin:colours demonstrated by two writers (60% answer red without looking); "
                    "held-out prompts and the reward are builtin:colours'",
        max_new_tokens=8,
        make_heldout=visual.colour_examples,
    ),
    "calc": BuiltinTask(
        name="calc",
        make_examples=calc_demonstrations,
        score=score_exact,
        description=f"product of two 3-digit numbers with a calculator tool ({CALC_TOOL}); SFT rows are "
                    f"demonstrations ({CALC_TOOL_SHARE:.0%} call the tool); exact-answer reward",
        max_new_tokens=72,  # a call (65 tokens with 3-digit factors: <tool_call>{"name": ...}</tool_call>, eos) fits
        make_heldout=calc_examples,
        tools=(CALC_TOOL,),
    ),
    "guess": BuiltinTask(
        name="guess",
        make_examples=guess_demonstrations,
        score=score_exact,
        description=f"guess a number from 1 to {GUESS_HIGH} told higher / lower by an environment "
                    f"({GUESS_ENVIRONMENT}); SFT rows are halving demonstrations; exact-answer reward",
        max_new_tokens=48,
        make_heldout=guess_examples,
        environment=GUESS_ENVIRONMENT,
    ),
}


def task_needs_tools(source: str) -> bool:
    """`source` (``data.source``) is a built-in task that calls tools."""
    return source.startswith(BUILTIN_PREFIX) and source.removeprefix(BUILTIN_PREFIX) in BUILTIN_TASKS and \
        BUILTIN_TASKS[source.removeprefix(BUILTIN_PREFIX)].needs_tools


def get_builtin_task(name: str) -> BuiltinTask:
    """The task called `name` (``"arithmetic"`` or ``"builtin:arithmetic"``).

    Raises `DataError` (a ValueError) naming the nearest valid task for an unknown name.
    """
    key = name.removeprefix(BUILTIN_PREFIX)
    if key not in BUILTIN_TASKS:
        hint = did_you_mean(key, BUILTIN_TASKS, prefix=BUILTIN_PREFIX)
        raise DataError(
            f"unknown built-in task '{name}'" + (f": {hint}" if hint else "")
        )
    return BUILTIN_TASKS[key]
