"""A character-level tokenizer built locally, for tiny models and the built-in tasks.

No model hub is needed: `build_char_tokenizer` writes an HF tokenizer folder that
`transformers.AutoTokenizer.from_pretrained` loads back. Every character in the vocabulary
is one token and decoding joins tokens with nothing in between, so
``decode(encode(text)) == text`` for any text made of vocabulary characters. Characters
outside the vocabulary become ``<unk>``.

Encoding adds no special tokens (there is no post-processor); callers that want ``<bos>``
or ``<eos>`` add them (see `shardwise.data.encode`). The encoder variant
(``encoder=True``, for ``model.task`` masked_lm / sequence_classification) is the same
vocabulary plus ``<mask>``, with ``<bos>`` as the cls token and ``<eos>`` as the sep token,
and it frames every text as ``<bos> text <eos>`` (as a BERT tokenizer frames
``[CLS] text [SEP]``), so plain transformers (a fill-mask pipeline) uses it as it was trained.

The causal variant has a chat template (`CHAT_TEMPLATE`) with the role markers
``<|system|>``, ``<|user|>``, ``<|assistant|>`` as special tokens (ids 57, 58, 59, after the
characters; `ROLE_TOKENS`): ``<bos><|user|>12+34=\n<|assistant|>46<eos>``, the assistant's
text and its ``<eos>`` inside ``{% generation %}`` markers; a tool turn is written as a user
turn starting ``tool:``. Conversations therefore run offline on the tiny models.

The tools variant (``tools=True``, for the built-in tool tasks such as ``builtin:calc``) is
the causal variant plus what a tool call needs: the characters ``{ } _ [ ]`` (ids 60-64,
`TOOL_CHARACTERS`) and the special tokens ``<tool_call>``, ``</tool_call>`` (ids 65, 66,
`TOOL_TOKENS`): `BUILTIN_TOOLS_VOCAB_SIZE` tokens. Every id of the causal variant is the
same. Its template (`TOOLS_CHAT_TEMPLATE`) writes an assistant turn's ``tool_calls``
(OpenAI format) after its content, one Hermes block each,
``<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>``
(JSON as ``tojson`` writes it: ``", "`` and ``": "`` separators), inside the
``{% generation %}`` block with the eos, so the calls are trained; a ``tool`` turn is a
user turn starting ``tool:`` (``<|user|>tool: 3\n``), as in the causal variant. The
``tools`` schemas a caller passes render nothing: a tiny model learns its one tool from
the demonstrations, and a schema would be hundreds of tokens of prompt.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch.distributed as dist
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from shardwise.errors import ConfigError

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Ids 0, 1, 2, 3 in this order."""

CHARACTERS: tuple[str, ...] = tuple(
    string.digits + "+-*= " + string.ascii_lowercase + ".,!?:;()'\"/\n"
)
"""The ordinary characters, ids 4 onwards in this order."""

CHAR_VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
CHAR_VOCAB_SIZE: int = len(CHAR_VOCAB)
"""Total vocabulary size (special tokens included): a tiny model's `vocab_size`."""

MASK_TOKEN = "<mask>"
"""The encoder variant's mask token, id CHAR_VOCAB_SIZE (after every other token)."""

ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")
"""The causal variant's role markers, ids CHAR_VOCAB_SIZE onwards in this order."""
BUILTIN_VOCAB_SIZE: int = CHAR_VOCAB_SIZE + len(ROLE_TOKENS)
"""Tokens of the causal built-in tokenizer (characters, specials and role markers): the
smallest `vocab_size` of a model trained with it."""

TOOL_CHARACTERS: tuple[str, ...] = ("{", "}", "_", "[", "]")
"""The tools variant's extra characters (JSON objects, lists, tool names), ids
BUILTIN_VOCAB_SIZE onwards in this order."""
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>")
"""The tools variant's special tokens around a call, after `TOOL_CHARACTERS`."""
BUILTIN_TOOLS_VOCAB_SIZE: int = BUILTIN_VOCAB_SIZE + len(TOOL_CHARACTERS) + len(TOOL_TOKENS)
"""Tokens of the tools variant: the smallest `vocab_size` of a model trained with it."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% elif m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}<|user|>tool: {{ m['content'] }}\n"
    "{% else %}<|user|>{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The causal built-in tokenizer's chat template (jinja, as transformers renders it)."""

TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}{% set f = call['function'] or call %}"
    "<tool_call>{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}"
    "{{ eos_token }}{% endgeneration %}"
    "{% elif m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}<|user|>tool: {{ m['content'] }}\n"
    "{% else %}<|user|>{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The tools variant's chat template: `CHAT_TEMPLATE` plus Hermes tool calls in assistant
turns (module docstring); ``tools`` is accepted and renders nothing."""


def build_char_tokenizer(out_dir: str | Path, encoder: bool = False, tools: bool = False) -> PreTrainedTokenizerFast:
    """Build the character tokenizer, save it to `out_dir` and return it.

    `encoder`: the encoder variant (module docstring): CHAR_VOCAB_SIZE + 1 tokens, mask
    ``<mask>`` = CHAR_VOCAB_SIZE, cls ``<bos>``, sep ``<eos>``, and encoding adds them.
    `tools`: the tools variant: BUILTIN_TOOLS_VOCAB_SIZE tokens, the causal variant's plus
    `TOOL_CHARACTERS` and `TOOL_TOKENS`, and `TOOLS_CHAT_TEMPLATE`. Otherwise the causal
    variant: BUILTIN_VOCAB_SIZE tokens, the role markers and `CHAT_TEMPLATE`.

    `out_dir` receives ``tokenizer.json`` and ``tokenizer_config.json`` (created if
    missing). The returned tokenizer has pad ``<pad>`` = 0, bos ``<bos>`` = 1,
    eos ``<eos>`` = 2 and unk ``<unk>`` = 3, pads on the right, and does not clean up
    spaces when decoding (that would break the exact round trip).
    """
    if encoder and tools:
        raise ConfigError("model.task", "the built-in tokenizer's tools variant is for causal LMs",
                          "set model.task=causal_lm for tool tasks")
    extra_tokens = (MASK_TOKEN,) if encoder else ROLE_TOKENS + (TOOL_CHARACTERS + TOOL_TOKENS if tools else ())
    vocab = dict(CHAR_VOCAB) | {tok: CHAR_VOCAB_SIZE + i for i, tok in enumerate(extra_tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # `[\s\S]` rather than `.` so that a newline is a character like any other.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the token strings with nothing in between (WordLevel's default is a space).
    backend.decoder = decoders.Fuse()
    extra = {"extra_special_tokens": list(ROLE_TOKENS), "chat_template": CHAT_TEMPLATE}
    if tools:
        extra = {"extra_special_tokens": list(ROLE_TOKENS + TOOL_TOKENS), "chat_template": TOOLS_CHAT_TEMPLATE}
    if encoder:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A {EOS_TOKEN}", pair=f"{BOS_TOKEN} $A {EOS_TOKEN} $B {EOS_TOKEN}",
            special_tokens=[(BOS_TOKEN, CHAR_VOCAB[BOS_TOKEN]), (EOS_TOKEN, CHAR_VOCAB[EOS_TOKEN])])
        extra = {"cls_token": BOS_TOKEN, "sep_token": EOS_TOKEN, "mask_token": MASK_TOKEN}

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        **extra,
    )
    assert len(tokenizer) == len(vocab), (len(tokenizer), len(vocab))
    assert tokenizer.pad_token_id == 0 and tokenizer.unk_token_id == 3
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return tokenizer


TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                      "merges.txt", "spiece.model", "*.tiktoken", "chat_template.*")
"""Files that make up a tokenizer folder (never config.json or weights)."""


def has_tokenizer_files(folder: str | Path) -> bool:
    folder = Path(folder)
    return folder.is_dir() and any(any(folder.glob(p)) for p in TOKENIZER_PATTERNS)


def tokenizer_dir(tokenizer: str | None, model_path: str | None, run_dir: str | Path, build: bool,
                  encoder: bool = False, tools: bool = False) -> Path:
    """The folder of a run's tokenizer: ``model.tokenizer`` (which must hold tokenizer
    files); else ``model.path`` if it holds them; else ``<run.dir>/tokenizer``, where the
    built-in character tokenizer (its `encoder` variant, or with `tools` its tools variant:
    the job's task or config calls tools) is built when none is there yet and `build` is
    set (only one process of a job may build it). Raises ConfigError on
    ``model.tokenizer``."""
    if tokenizer is not None and not has_tokenizer_files(tokenizer):
        raise ConfigError("model.tokenizer", f"{tokenizer!r} holds no tokenizer files",
                          "point it at a folder with tokenizer.json (or vocab files), or leave it unset")
    found = locate_tokenizer(tokenizer, model_path, run_dir)
    if found is None:
        found = Path(run_dir) / "tokenizer"
        if build:
            build_char_tokenizer(found, encoder=encoder, tools=tools)
    return found


def load_tokenizer(folder: str | Path, require_eos: bool = True):
    """The tokenizer saved in `folder`; with `require_eos` it must define an eos token (SFT
    appends it to every response and generation stops at it; encoders need none). Raises
    ConfigError otherwise."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    if require_eos and tok.eos_token_id is None:
        raise ConfigError("model.tokenizer", f"the tokenizer in {str(folder)!r} has no eos token",
                          "responses end with eos and generation stops at it; use a tokenizer that defines one")
    return tok


def shared_tokenizer(tokenizer: str | None, model_path: str | None, run_dir: str | Path, encoder: bool = False,
                     tools: bool = False):
    """(tokenizer, its folder) for every rank of a job: rank 0 finds or builds the folder
    and broadcasts where it is, the others load it from there. Collective when a process
    group exists (a rank that looked for itself could miss a folder rank 0 is writing).
    `encoder`: build the encoder variant when building, and need no eos token; `tools`:
    build the tools variant when building."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    where: list[str | None] = [None]
    if rank == 0:
        where[0] = str(tokenizer_dir(tokenizer, model_path, run_dir, build=True, encoder=encoder,
                                     tools=tools))
    if distributed:
        dist.broadcast_object_list(where, src=0)  # a path string, from our own rank 0
    return load_tokenizer(where[0], require_eos=not encoder), where[0]


def locate_tokenizer(tokenizer: str | None, model_path: str | None, run_dir: str | Path) -> Path | None:
    """Where a run's tokenizer lives: `model.tokenizer`; else `model.path` if it holds
    tokenizer files; else `<run.dir>/tokenizer` (where the built-in task's tokenizer is
    built); else None."""
    for candidate in (tokenizer, model_path, Path(run_dir) / "tokenizer"):
        if candidate is not None and has_tokenizer_files(candidate):
            return Path(candidate)
    return None


def pad_token_id(tokenizer) -> int:
    """The id that pads rows: the tokenizer's pad token, else its eos (what HF generation
    uses when there is no pad), else 0. Padding is masked out everywhere it is used."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def check_vocab(tokenizer, vocab_size: int, key: str = "model.config.vocab_size") -> None:
    """The model's embedding must hold every token id the tokenizer produces."""
    if len(tokenizer) > vocab_size:
        raise ConfigError(key, f"{vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens",
                          f"set vocab_size >= {len(tokenizer)}")
