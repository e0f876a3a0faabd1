"""Write the chat-format example data (examples/data/) from the built-in reverse task:

- ``reverse_chat.jsonl``: SFT conversations in the OpenAI / TRL ``messages`` format, each
  1-3 user / assistant exchanges with a system turn in half of them, answered by the two
  writers of ``builtin:reverse_mixed`` (60% copy the word instead of reversing it);
- ``reverse_verl.parquet``: RL prompts in verl's format (``data_source``, ``prompt`` = a
  list of messages, ``ability``, ``reward_model = {style, ground_truth}``, ``extra_info =
  {split, index, word}``), for examples/grpo_chat.yaml and examples/verl_reward.py.

Deterministic: ``python examples/make_chat_data.py examples/data`` rewrites the same files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from shardwise.data.tasks import REVERSE_COPY_SHARE, reverse_examples

SYSTEM = "reverse the word before ="
DATA_SOURCE = "shardwise/reverse_chat"


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = iter(reverse_examples(3 * n, seed))
    rows = []
    for _ in range(n):
        turns = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            ex = next(words)
            answer = ex["prompt"][:-1] if rng.random() < REVERSE_COPY_SHARE else ex["response"]
            turns += [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": answer}]
        rows.append({"messages": turns})
    return rows


def verl_prompts(n: int, seed: int, split: str) -> pa.Table:
    rows = reverse_examples(n, seed)
    return pa.table({
        "data_source": [DATA_SOURCE] * n,
        "prompt": [[{"role": "user", "content": r["prompt"]}] for r in rows],
        "ability": ["reverse"] * n,
        "reward_model": [{"style": "rule", "ground_truth": r["response"]} for r in rows],
        "extra_info": [{"split": split, "index": i, "word": r["prompt"][:-1]} for i, r in enumerate(rows)],
    })


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "reverse_chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversations(6000, 0)))
    pq.write_table(verl_prompts(1024, 1, "train"), folder / "reverse_verl.parquet")
    print(f"wrote {folder / 'reverse_chat.jsonl'} and {folder / 'reverse_verl.parquet'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "data"))
