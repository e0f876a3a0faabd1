"""Accuracy of an exported HF model on a built-in task (greedy decoding, plain transformers)."""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def task_accuracy(hf_dir: str | Path, task_name: str = "arithmetic", n: int = 200, seed: int = 10_000,
                  max_new_tokens: int = 6, batch_size: int = 50) -> float:
    """Fraction of `n` held-out prompts (generated from `seed`) answered exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.data.collate import tokenize_prompt
    from shardwise.data.tasks import get_builtin_task

    task = get_builtin_task(task_name)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    examples = task.make_examples(n, seed)
    correct = 0.0
    for i in range(0, n, batch_size):
        chunk = examples[i:i + batch_size]
        ids = [tokenize_prompt(tok, ex["prompt"], 64) for ex in chunk]
        width = max(len(x) for x in ids)
        pad = tok.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # left padding
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id)
        for ex, row in zip(chunk, out[:, width:]):
            text = tok.decode(row, skip_special_tokens=False)
            correct += task.score(ex["prompt"], text, ex["response"])
    return correct / n
