"""Write examples/real/data/: single-digit sums for SmolLM2-135M-Instruct (make real-model).

    python examples/real/make_data.py

- sums_train.jsonl / sums_heldout.jsonl (GRPO, grpo_sums.yaml): ``{"prompt": [one user turn],
  "answer": "7"}``, the question "What is 3 plus 4? Answer with a number." for the 100 pairs
  a, b in 0..9, split by a seeded shuffle into 70 training and 30 held-out pairs, so the
  held-out accuracy is measured on sums the run never trained on.
- chat_train.jsonl / chat_heldout.jsonl (SFT, sft_chat.yaml): conversations of two to four
  user / assistant exchanges over the same pairs (training pairs / held-out pairs), the
  assistant answering each in one line, "3 + 4 = 7.".

The same files every time (random.Random(0)); committed, so the examples need no step of
their own.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data"
QUESTION = "What is {a} plus {b}? Answer with a number."
FOLLOW_UPS = ("And {a} plus {b}?", "What about {a} plus {b}?", "Now {a} plus {b}?")
HELDOUT_PAIRS = 30


def pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    everything = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(everything)
    return everything[HELDOUT_PAIRS:], everything[:HELDOUT_PAIRS]


def sums(chosen: list[tuple[int, int]]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b)}
            for a, b in chosen]


def conversations(chosen: list[tuple[int, int]], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        turns = []
        for i in range(rng.randint(2, 4)):
            a, b = rng.choice(chosen)
            ask = QUESTION if i == 0 else rng.choice(FOLLOW_UPS)
            turns += [{"role": "user", "content": ask.format(a=a, b=b)},
                      {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        rows.append({"messages": turns})
    return rows


def write(name: str, rows: list[dict]) -> None:
    with open(OUT / name, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    train, heldout = pairs()
    write("sums_train.jsonl", sums(train))
    write("sums_heldout.jsonl", sums(heldout))
    write("chat_train.jsonl", conversations(train, 256, seed=1))
    write("chat_heldout.jsonl", conversations(heldout, 32, seed=2))


if __name__ == "__main__":
    main()
