"""Test material for conversations: a byte-level BPE tokenizer with a Qwen-style chat
template (trained here with `tokenizers`, saved as a transformers folder), and data files in
the formats users bring (TRL / OpenAI messages, ShareGPT, verl's parquet)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN_STYLE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5's layout without tools: no generation markers, a newline after each end of turn."""

BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_VOCAB = 320
"""Size of the trained vocabulary (256 bytes, the specials, merges): a test model's vocab_size."""


def _corpus(n: int = 3000) -> list[str]:
    rng = random.Random(0)
    words = ["system", "user", "assistant", "You are a helpful assistant.", "what is", "reverse", "the word",
             "answer", "tool", "result", "thanks", "hello", "sure", "#### ", "\\boxed{", "}"]
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"{rng.choice(words)} {a}+{b}= {a + b}\n{rng.choice(words)} {rng.choice(words)}.\n")
    return lines


def build_bpe_chat_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (merges across spaces and digits, like Qwen's) with
    `QWEN_STYLE_TEMPLATE`, eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos; saved to
    `folder` and returned."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=list(BPE_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=QWEN_STYLE_TEMPLATE, clean_up_tokenization_spaces=False)
    Path(folder).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return tok


def arithmetic_conversations(n: int, seed: int) -> list[dict]:
    """Multi-turn TRL-style records: an optional system turn, then 1-3 user / assistant
    exchanges of arithmetic."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        turns = [{"role": "system", "content": "answer with the number"}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randint(0, 49), rng.randint(0, 49)
            turns += [{"role": "user", "content": f"what is {a}+{b}"}, {"role": "assistant", "content": str(a + b)}]
        rows.append({"messages": turns})
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
