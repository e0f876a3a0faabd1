"""Preference pairs for builtin:reverse, labelled by the task's rule: the chosen answer is
the word reversed; the rejected one is the word copied (what the SFT demo model mostly does)
or, for a third of the pairs, the reversal with one letter changed (so the reward model
must read the whole answer, not only its first letter). Palindromes are skipped (their copy
is the reversal). The words of the RL job's held-out prompts (`shardwise rl`'s evaluation
of builtin:reverse, seed run.seed + HELDOUT_SEED_OFFSET) are left out of both files.

    python examples/rlhf/make_pairs.py runs/rlhf        # writes pairs_train.jsonl, pairs_val.jsonl
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

from shardwise.data.tasks import HELDOUT_PROMPTS, HELDOUT_SEED_OFFSET, reverse_examples

TRAIN_PAIRS, VAL_PAIRS = 4096, 512
RUN_SEED = 0  # examples/rlhf/grpo.yaml's run.seed: its held-out prompts are kept out


def near_miss(word: str, rng: random.Random) -> str:
    """The reversal of `word` with one letter replaced by another."""
    rev = list(word[::-1])
    i = rng.randrange(len(rev))
    rev[i] = rng.choice([c for c in string.ascii_lowercase if c != rev[i]])
    return "".join(rev)


def pairs(n: int, seed: int, exclude: set[str]) -> list[dict[str, str]]:
    rng = random.Random(f"pairs-{seed}")
    out = []
    for r in reverse_examples(4 * n, seed):
        word = r["prompt"][:-1]
        if word == word[::-1] or word in exclude:
            continue
        rejected = near_miss(word, rng) if rng.random() < 1 / 3 else word
        out.append({"prompt": r["prompt"], "chosen": r["response"], "rejected": rejected})
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} of {n} pairs from seed {seed}")


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    heldout = {r["prompt"][:-1] for r in reverse_examples(HELDOUT_PROMPTS, RUN_SEED + HELDOUT_SEED_OFFSET)}
    train = pairs(TRAIN_PAIRS, 1, heldout)
    val = pairs(VAL_PAIRS, 2, heldout | {p["prompt"][:-1] for p in train})
    for name, rows in (("pairs_train.jsonl", train), ("pairs_val.jsonl", val)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}: {len(rows)} pairs")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/rlhf")
