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
    return _bpe(folder, BPE_VOCAB, BPE_SPECIALS, _corpus(), QWEN_STYLE_TEMPLATE)


def _bpe(folder: str | Path, vocab: int, specials, corpus, template: str, **extra) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `corpus` with eos ``<|im_end|>``, pad ``<|endoftext|>``,
    no bos and `template`, saved to `folder`."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=template, clean_up_tokenization_spaces=False, **extra)
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


QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's chat template with tools, in its shape: the schemas in the system turn inside
<tools></tools>, an assistant's calls as Hermes blocks (``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``), consecutive ``tool`` turns in one user turn as
<tool_response> blocks; plus ``{% generation %}`` around the assistant's text, calls and
``<|im_end|>``."""

TOOL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
TOOL_BPE_VOCAB = 400
"""Size of the tool tokenizer's trained vocabulary: a test model's vocab_size."""


def _tool_corpus(n: int = 400) -> list[str]:
    rng = random.Random(1)
    lines = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
        lines += [f"<|im_start|>user\n{a}*{b}=<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call>"
                  f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n",
                  json.dumps({"type": "function", "function": {"name": rng.choice(["calculator", "guess"]),
                              "description": "Evaluate an arithmetic expression.", "parameters": {
                                  "type": "object", "properties": {"expression": {"type": "string"}},
                                  "required": ["expression"]}}}),
                  f"You are a helpful assistant. The answer is {a * b}.\n"]
    return lines


def build_bpe_tool_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on tool conversations and JSON schemas, with
    `QWEN_TOOLS_TEMPLATE`, `TOOL_SPECIALS` as special tokens, eos ``<|im_end|>``, pad
    ``<|endoftext|>``, no bos; saved to `folder` and returned."""
    return _bpe(folder, TOOL_BPE_VOCAB, TOOL_SPECIALS, _tool_corpus(), QWEN_TOOLS_TEMPLATE,
                extra_special_tokens=["<|im_start|>", "<tool_call>", "</tool_call>"])
