"""A tiny model that calls a tool, built by hand (no training): for tests of the multi-turn
loop through whole jobs and engines.

The tokenizer is the built-in tools variant (`build_char_tokenizer(tools=True)`) plus one
added token, `CALL`: the whole JSON of one call of the built-in calculator, exactly as the
template renders it (so the retokenize check holds). The model is a random tiny Qwen3
whose greedy answer is a bigram chain: after ``<|assistant|>`` it writes
``<tool_call>``, `CALL`, ``</tool_call>``, ``<eos>``. Each of these four tokens gets an
embedding along a basis direction of its own (RMS 1, where the random embeddings are
~0.02) and the LM-head row of its successor a weight LOGIT along that direction, so the
successor wins by a margin of about LOGIT while the attention and MLP (random, small)
still make every log-prob depend on the context. Every assistant turn therefore calls
``calculator("2*3")`` (answer ``6``), until ``max_turns``: the trajectories are truncated
with ``max_turns`` turns and calls each.
"""

from __future__ import annotations

from pathlib import Path

import torch

CALL = '{"name": "calculator", "arguments": {"expression": "2*3"}}'
TOOL = "shardwise.agents.builtin:calculator"
HIDDEN = 64
LOGIT = 4.0
CONFIG = dict(model_type="qwen3", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
              max_position_embeddings=512, tie_word_embeddings=False)


def build_tool_model(folder: Path, seed: int = 0) -> Path:
    """The model and its tokenizer saved in `folder` (an HF folder: model.path)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(folder, tools=True)
    tok.add_tokens([CALL])
    tok.save_pretrained(folder)
    ids = tok.convert_tokens_to_ids(["<|assistant|>", "<tool_call>", CALL, "</tool_call>"]) + [tok.eos_token_id]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**CONFIG)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for k, (src, dst) in enumerate(zip(ids, ids[1:])):
            direction = torch.zeros(HIDDEN)
            direction[k] = 1.0
            emb[src] = direction * HIDDEN ** 0.5  # RMS 1
            head[dst] += direction * LOGIT / HIDDEN ** 0.5  # final norm gives the hidden RMS 1: logit LOGIT
    model.save_pretrained(folder)
    return folder
