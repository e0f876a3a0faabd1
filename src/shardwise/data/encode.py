"""The one road from a record to token ids: ids, loss mask and what truncation cut.

Every job, `shardwise data` and the benchmarks turn text into ids here and nowhere else.
For a record and a tokenizer:

- `encode_record` (training): an `Encoded` with ``ids``, ``loss_mask`` (1: trained),
  the untruncated ``length`` and the trained tokens truncation ``lost``, for
- a **plain pair** (``"prompt"`` / ``"response"``): ``[bos] + prompt + response + eos``,
  loss on the response and eos (`tokenize_pair`);
- a **conversation** (``"messages"``): rendered by the chat template
  (`shardwise.data.chat.render`, bounded) and tokenized once; loss on the assistant turns
  (`conversation_example`, ``data.train_on``);
- a **tool conversation** (``"messages"`` with assistant turns carrying ``tool_calls`` and
  ``tool`` turns, OpenAI / TRL format, and optionally the record's ``"tools"``: the function
  schemas passed to the template as ``tools``): loss on the assistant turns, their calls
  included (the template writes them inside the turn), none on the tool results, the
  schemas or the glue between turns;

- `encode_prompt` (generation): an `Encoded` of the ids a model is asked (``[bos] +
  prompt``, or chat messages with the template's generation prompt and the `tools`
  schemas), the last ``max_length`` kept, no loss mask.

Conventions: one training example is ``prompt tokens + response tokens + eos``, ``bos``
first when the tokenizer has one; truncation keeps an example's beginning (a long example
loses its eos and then its response tail first) and a prompt's end (the text just before
the answer). The collators (`shardwise.data.collate`) only batch what this module returns.

Which conversation tokens are trained is found on the rendered text, never by searching for
a turn's content, in one pass (linear in the conversation's length):

- a template with ``{% generation %}`` markers marks the assistant text itself;
- any other template: assistant turn ``i`` spans from where the template took turn ``i``
  plus its generation prompt, to where it took turn ``i+1``, whitespace the template writes
  after the turn's end-of-turn token (Qwen's newline after ``<|im_end|>``) left out. This
  is the same span as rendering growing prefixes (from the end of ``messages[:i]`` rendered
  with ``add_generation_prompt`` to the end of ``messages[:i+1]``); it is checked against
  those prefix renders on up to `SPOT_CHECKS` turns (every turn of a short conversation),
  and a conversation whose check fails is found the slow way, by prefixes, when it is short
  (`PREFIX_LIMIT` assistant turns). A template that rewrites earlier turns (Qwen3 drops the
  reasoning of earlier turns) is an error that says to give one with markers.

The whole text is tokenized once (a fast tokenizer's character offsets place each token in
or out of a span), so the ids are those a model sees at inference, merges across turn
boundaries included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.data import chat
from shardwise.data.collate import Example
from shardwise.data.template import Rendered
from shardwise.errors import ConfigError, DataError, did_you_mean
from shardwise.telemetry.progress import Heartbeat

__all__ = ["Encoded", "Example", "conversation_example", "cut_long_prompts", "encode_prompt", "encode_record",
           "encode_records", "prompt_chars_bound", "prompt_ids", "prompt_text", "summarize_truncation", "tokenize_pair", "tokenize_prompt",
           "truncation_note"]

UNLIMITED = 2**62
"""A max_length that cuts nothing."""

SPOT_CHECKS = 9
"""Assistant turns of a conversation (first, last and evenly between) whose one-pass span is
checked against prefix renders, for templates without generation markers."""
PREFIX_LIMIT = 64
"""Most assistant turns a conversation may have to be found by prefix renders (quadratic)
when its one-pass spans do not pass the check."""


@dataclass(frozen=True)
class Encoded:
    """One record as ids: what training or generation gets, and what truncation did."""

    ids: list[int]
    """Token ids after truncation."""
    loss_mask: list[int] | None
    """1 on the trained tokens, same length as `ids`; None for a prompt."""
    length: int
    """Tokens before truncation."""
    lost: int
    """Trained tokens truncation cut off (0 for a prompt)."""

    @property
    def truncated(self) -> bool:
        return self.length > len(self.ids)

    @property
    def example(self) -> Example:
        """The collators' form (a training example)."""
        assert self.loss_mask is not None, "a prompt has no loss mask"
        return {"input_ids": self.ids, "loss_mask": self.loss_mask}


# ---------------------------------------------------------------- the entry points


def encode_record(tokenizer: Any, record: dict[str, Any], max_length: int, train_on: str = "assistant",
                  image_tokens: Sequence[int] = (), known: dict[str, list[int]] | None = None) -> Encoded:
    """One training record (a plain pair or a conversation, with its ``"tools"`` schemas
    when it has them) as ids, loss mask and what truncation cut; the first `max_length`
    tokens are kept. `train_on` (``data.train_on``) applies to conversations (a tool
    conversation's ``tool`` turns are never assistant turns); `image_tokens` (a VL example's image, see
    `shardwise.models.vision`) follow bos, part of the prompt, and must fit. `known`: texts
    already tokenized (`_encode_texts`), looked up before the tokenizer is called."""
    where = record.get("where", "a record")
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    if "messages" in record:
        if image_tokens:
            raise DataError(f"{where}: chat messages with an image are not supported yet; use text records")
        # A tool conversation: the calls are part of their assistant turns (trained), the
        # "tool" turns are not assistant turns (untrained), the schemas go to the template.
        tools = chat.check_tools(record.get("tools"), where)
        ids, mask = _conversation(tokenizer, record["messages"], train_on, where, tools)
    else:
        ids, mask = _pair(tokenizer, record["prompt"], record["response"], image_tokens, known)
        _check_image_fits(tokenizer, image_tokens, max_length)
    return Encoded(ids[:max_length], mask[:max_length], len(ids), sum(mask[max_length:]))


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], max_length: int,
                  image_tokens: Sequence[int] = (), where: str = "prompt",
                  tools: list[dict] | None = None, known: dict[str, list[int]] | None = None) -> Encoded:
    """A prompt as the ids a model is asked: ``[bos] + prompt`` (no eos), or chat messages
    rendered with the template's generation prompt (and the function schemas `tools`, as
    ``apply_chat_template(tools=...)`` gets them); the last `max_length` tokens kept so
    the text just before the answer survives. `image_tokens` (a VL prompt's image) follow
    bos and are always kept; the text is cut instead. `known`: as `encode_record`'s."""
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    if isinstance(prompt, list):
        if image_tokens:
            raise DataError(f"{where}: chat messages with an image are not supported yet; use text prompts")
        ids = prompt_ids(tokenizer, prompt, where, tools)
        return Encoded(ids[-max_length:], None, len(ids), 0)
    text = _encode(tokenizer, prompt, known)
    if image_tokens:
        _check_image_fits(tokenizer, image_tokens, max_length)
        head = _prefix(tokenizer) + list(image_tokens)
        return Encoded(head + text[max(0, len(text) - (max_length - len(head))):], None, len(head) + len(text), 0)
    ids = _prefix(tokenizer) + text
    return Encoded(ids[-max_length:], None, len(ids), 0)


def encode_records(tokenizer: Any, records: Sequence[dict[str, Any]], max_length: int, train_on: str = "assistant",
                   image_tokens: Sequence[int] = (), prompts: bool = False, progress: bool = False) -> list[Encoded]:
    """`encode_record` (or with `prompts`, `encode_prompt` of each record's ``"prompt"``)
    for every record, in order. The plain texts (pairs' prompts and responses, text
    prompts) of `BATCH` records at a time are tokenized in one call (`_encode_texts`).
    `progress` (rank 0 / the launcher): lines on stderr while it takes more than a few
    seconds (`shardwise.telemetry.progress.Heartbeat`)."""
    out = []
    with Heartbeat("data", len(records), enabled=progress) as beat:
        for start in range(0, len(records), BATCH):
            chunk = records[start:start + BATCH]
            known = _encode_texts(tokenizer, [t for r in chunk for t in _plain_texts(r, prompts)])
            for r in chunk:
                if prompts:
                    out.append(encode_prompt(tokenizer, r["prompt"], max_length, image_tokens,
                                             where=r.get("where", "prompt"),
                                             tools=chat.check_tools(r.get("tools"), r.get("where", "prompt")),
                                             known=known))
                else:
                    out.append(encode_record(tokenizer, r, max_length, train_on, image_tokens, known))
                beat.done += 1
    return out


BATCH = 1024
"""Records whose plain texts `encode_records` tokenizes in one call."""


def _encode_texts(tokenizer: Any, texts: Sequence[str]) -> dict[str, list[int]]:
    """Each distinct text of `texts` -> its ids as `_encode` gives them (no special tokens
    added), in one tokenizer call: a list goes through the tokenizer's own batch path,
    which encodes each text alone (a fast tokenizer's backend `encode_batch`, the one a
    single text goes through too), so the ids are the same without a call's Python
    overhead per text (about 3x faster on short texts)."""
    distinct = list(dict.fromkeys(texts))
    if not distinct:
        return {}
    return dict(zip(distinct, tokenizer(distinct, add_special_tokens=False)["input_ids"], strict=True))


def _plain_texts(record: dict[str, Any], prompts: bool) -> list[str]:
    """The texts of `record` that `_encode` tokenizes as they are (a conversation or chat
    prompt is rendered first: none)."""
    if prompts:
        return [record["prompt"]] if isinstance(record.get("prompt"), str) else []
    if "messages" in record:
        return []
    return [t for t in (record.get("prompt"), record.get("response")) if isinstance(t, str)]


def prompt_text(tokenizer: Any, prompt: str | list[dict[str, Any]], where: str = "prompt",
                tools: list[dict] | None = None) -> str:
    """The text of a prompt as the model is asked it: text as it is, chat messages as the
    template renders them (with the generation prompt and the schemas `tools`)."""
    return chat.render_text(tokenizer, prompt, True, where, tools) if isinstance(prompt, list) else prompt


def tokenize_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], max_length: int,
                    image_tokens: Sequence[int] = (), where: str = "prompt") -> list[int]:
    """`encode_prompt`'s ids."""
    return encode_prompt(tokenizer, prompt, max_length, image_tokens, where).ids


def prompt_ids(tokenizer: Any, messages: Sequence[dict], where: str = "prompt",
               tools: list[dict] | None = None) -> list[int]:
    """Token ids of chat `messages` with the template's generation prompt and the schemas
    `tools` (untruncated)."""
    return _tokenize(tokenizer, chat.render_text(tokenizer, messages, True, where, tools), where)[0]


# ---------------------------------------------------------------- truncation notes


def truncation_note(tokenizer: Any, records: Sequence[dict[str, Any]], max_length: int,
                    with_response: bool, train_on: str = "assistant", progress: bool = False) -> str | None:
    """One sentence about the records longer than `max_length` tokens once encoded (as
    training examples when `with_response`, else as prompts), or None when none is. Jobs
    print it once at start: truncation changes what is trained on or asked."""
    done = encode_records(tokenizer, records, max_length, train_on, prompts=not with_response, progress=progress)
    return summarize_truncation([e.length for e in done], [e.lost for e in done], max_length, with_response)


def summarize_truncation(lengths: Sequence[int], lost: Sequence[int], max_length: int,
                         with_response: bool) -> str | None:
    """`truncation_note`'s sentence from each example's untruncated token count and its
    trained tokens cut off (`Encoded.length`, `Encoded.lost`)."""
    long = [n for n in lengths if n > max_length]
    if not long:
        return None
    what = "examples (prompt + response)" if with_response else "prompts"
    kept = "their beginning is kept" if with_response else "their last tokens are kept"
    cut = f", {sum(lost)} trained (response / assistant) tokens are cut off" if with_response else ""
    return (f"{len(long)} of {len(lengths)} {what} are longer than data.max_length={max_length} tokens "
            f"(longest {max(long)}) and are truncated ({kept}{cut}); raise data.max_length to keep them whole")


PROMPT_CHARS_FLOOR = 1 << 16
"""A prompt text (or a chat turn's content) of at most this many characters is never cut
by `cut_long_prompts`, whatever the tokenizer."""


def prompt_chars_bound(tokenizer: Any, max_length: int) -> int:
    """The characters of a prompt's end that hold its last `max_length` tokens with room to
    spare: a token covers at most as many characters as its vocabulary string is long (a
    byte-level BPE's strings have one character per byte), so ``max_length`` tokens cover
    at most ``max_length x`` the longest; twice that (a merge across the cut changes
    only tokens far before the kept ones), and never under `PROMPT_CHARS_FLOOR`."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(PROMPT_CHARS_FLOOR, 2 * max_length * max(1, longest))


def cut_long_prompts(records: list[dict[str, Any]], max_length: int, tokenizer_fn: Any,
                     source: str) -> tuple[list[dict[str, Any]], str | None]:
    """`records` whose prompt texts (text prompts, or each chat turn's content) longer than
    `prompt_chars_bound` keep only their last that many characters, and one sentence
    saying so (None when nothing was cut). `encode_prompt` keeps a prompt's last
    `max_length` tokens, so the tokens asked are the same; what is cut is never
    tokenized, held in a batch or written to a samples file (issue 50: one 50 MB prompt
    with data.max_length 16 grew the RL controller to 17.8 GB). `tokenizer_fn()` gives the
    job's tokenizer, called only when some text is longer than `PROMPT_CHARS_FLOOR`;
    `source`: the config key and file, for the sentence."""
    def texts(r: dict[str, Any]) -> list[str]:
        p = r.get("prompt")
        if isinstance(p, str):
            return [p]
        return [t["content"] for t in p if isinstance(t.get("content"), str)] if isinstance(p, list) else []

    if not any(len(t) > PROMPT_CHARS_FLOOR for r in records for t in texts(r)):
        return records, None
    bound = prompt_chars_bound(tokenizer_fn(), max_length)
    out, cut, longest = [], 0, 0
    for r in records:
        long = [len(t) for t in texts(r) if len(t) > bound]
        if not long:
            out.append(r)
            continue
        cut, longest = cut + 1, max(longest, *long)
        p = r["prompt"]
        p = p[-bound:] if isinstance(p, str) else \
            [{**t, "content": t["content"][-bound:]} if isinstance(t.get("content"), str) else t for t in p]
        out.append({**r, "prompt": p})
    if not cut:
        return records, None
    return out, (f"{source}: {cut} of {len(records)} prompts hold texts longer than {bound:,} characters (longest "
                 f"{longest:,}) and are cut to their last {bound:,} when read: data.max_length={max_length} keeps "
                 "only a prompt's last tokens, which that holds")


# ---------------------------------------------------------------- plain pairs


def tokenize_pair(tokenizer: Any, prompt: str, response: str, max_length: int,
                  image_tokens: Sequence[int] = ()) -> Example:
    """One plain pair as an example: ``[bos] + prompt + response + [eos]``, cut to
    `max_length`; loss_mask is 1 on the response tokens and the eos. Prompt and response
    are tokenized separately (no special tokens added by the tokenizer), so the boundary
    between them is exact. An example whose prompt alone fills `max_length` has no loss
    tokens."""
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    ids, mask = _pair(tokenizer, prompt, response, image_tokens)
    _check_image_fits(tokenizer, image_tokens, max_length)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def _pair(tokenizer: Any, prompt: str, response: str, image_tokens: Sequence[int],
          known: dict[str, list[int]] | None = None) -> tuple[list[int], list[int]]:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; set one so responses can end")
    prompt_part = _prefix(tokenizer) + list(image_tokens) + _encode(tokenizer, prompt, known)
    response_part = _encode(tokenizer, response, known) + [tokenizer.eos_token_id]
    return prompt_part + response_part, [0] * len(prompt_part) + [1] * len(response_part)


def _check_image_fits(tokenizer: Any, image_tokens: Sequence[int], max_length: int) -> None:
    need = len(_prefix(tokenizer)) + len(image_tokens) + 1
    if image_tokens and max_length < need:
        raise DataError(f"data.max_length: {max_length} tokens leave no room for text after the image's "
                        f"{len(image_tokens)} tokens; raise it to at least {need} (or lower data.image_size)")


def _prefix(tokenizer: Any) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _encode(tokenizer: Any, text: str, known: dict[str, list[int]] | None = None) -> list[int]:
    if known is not None and (ids := known.get(text)) is not None:
        return list(ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------- conversations


def conversation_example(tokenizer: Any, messages: Sequence[dict], max_length: int, train_on: str,
                         where: str) -> tuple[Example, int, int]:
    """One conversation as ``(example, untruncated length, trained tokens cut)``: loss on
    the tokens of every assistant turn (their content and the end-of-turn marker), of the
    last one only, or on every token (`train_on`, `chat.TRAIN_ON`); the first `max_length`
    tokens kept."""
    enc = encode_record(tokenizer, {"messages": messages, "where": where}, max_length, train_on)
    return enc.example, enc.length, enc.lost


def _conversation(tokenizer: Any, messages: Sequence[dict], train_on: str, where: str,
                  tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    if train_on not in chat.TRAIN_ON:
        raise ConfigError("data.train_on", f"{train_on!r} is not one of {', '.join(chat.TRAIN_ON)}",
                          did_you_mean(train_on, chat.TRAIN_ON))
    text, spans = assistant_spans(tokenizer, messages, where, tools)
    if train_on == "last_assistant":
        spans = spans[-1:]
    ids, offsets = _tokenize(tokenizer, text, where)
    mask = [1] * len(ids) if train_on == "all" else _mask(offsets, spans)
    return ids, mask


def _mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in a span (an empty token: 0), in one
    walk over tokens and spans together (both in text order)."""
    merged: list[list[int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    mask, k = [], 0
    for s, e in offsets:
        while k < len(merged) and merged[k][1] <= s:
            k += 1
        mask.append(int(e > s and k < len(merged) and merged[k][0] <= s))
    return mask


def _tokenize(tokenizer: Any, text: str, where: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of `text` (no special tokens added: the template wrote them) and each token's
    character span."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: conversations need a fast tokenizer (a tokenizer.json) to place tokens in "
                        "the assistant turns; convert the tokenizer with transformers (use_fast=True)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str,
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation (with the schemas `tools`) and the character span
    ``[start, end)`` of each assistant turn in it, in order (see the module docstring for
    how they are found)."""
    rendered = chat.render(tokenizer, messages, False, where, tools)
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    if chat.has_generation_markers(tokenizer):
        spans = [(a, b) for a, b in rendered.generation if b > a]
        if len(spans) != n_assistant:
            raise DataError(f"{where}: the chat template marks {len(spans)} assistant spans for {n_assistant} "
                            "assistant turns; check its {% generation %} blocks (one around each assistant turn)")
        return rendered.text, spans
    return rendered.text, _unmarked_spans(tokenizer, messages, rendered, where, tools)


def _special_tokens(tokenizer: Any) -> set[str]:
    return {t for t in set(getattr(tokenizer, "all_special_tokens", [])) | {
        str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()} if t}


def _trim(text: str, start: int, end: int, special: set[str]) -> int:
    """`end` moved back over the layout the template writes after the end-of-turn token
    (that layout is not the answer)."""
    stripped = text[:end].rstrip()
    if len(stripped) > start and any(stripped.endswith(tok) for tok in special):
        return len(stripped)
    return end


def prefix_span(tokenizer: Any, messages: Sequence[dict], i: int, full: str, where: str,
                special: set[str], tools: list[dict] | None = None) -> tuple[int, int]:
    """Assistant turn `i`'s span found by rendering prefixes (two renders of up to ``i+1``
    turns): from the end of ``messages[:i]`` with the generation prompt to the end of
    ``messages[:i+1]``. The reference the one-pass spans are checked against."""
    before = chat.render_text(tokenizer, messages[:i], True, where, tools) if i else ""
    upto = chat.render_text(tokenizer, messages[: i + 1], False, where, tools)
    if not (upto.startswith(before) and full.startswith(upto)):
        raise DataError(
            f"{where}: the chat template does not render turn {i} as a prefix of the whole conversation "
            "(it rewrites earlier turns), so the assistant tokens cannot be found from prefixes; set "
            "data.chat_template to a template whose assistant text is in {% generation %} ... "
            "{% endgeneration %} blocks")
    return len(before), _trim(upto, len(before), len(upto), special)


def _unmarked_spans(tokenizer: Any, messages: Sequence[dict], rendered: Rendered,
                    where: str, tools: list[dict] | None = None) -> list[tuple[int, int]]:
    """Spans for a template without markers: one pass (where the template took each turn),
    checked against prefix renders on `SPOT_CHECKS` turns; prefixes for every turn of a
    short conversation whose check fails."""
    full, special = rendered.text, _special_tokens(tokenizer)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return []
    picks = sorted({turns[round(j * (len(turns) - 1) / (SPOT_CHECKS - 1))] for j in range(SPOT_CHECKS)})
    exact = {i: prefix_span(tokenizer, messages, i, full, where, special, tools) for i in picks}
    one_pass = _one_pass_spans(messages, rendered, turns, exact, special)
    if one_pass is not None and all(one_pass[turns.index(i)] == exact[i] for i in picks):
        return one_pass
    if len(turns) > PREFIX_LIMIT:
        raise DataError(f"{where}: the chat template's assistant turns cannot be found in one pass, and this "
                        f"conversation has {len(turns)} of them (more than {PREFIX_LIMIT} to find by rendering "
                        "every prefix); set data.chat_template to a template whose assistant text is in "
                        "{% generation %} ... {% endgeneration %} blocks")
    return [exact[i] if i in exact else prefix_span(tokenizer, messages, i, full, where, special, tools)
            for i in turns]


def _one_pass_spans(messages: Sequence[dict], rendered: Rendered, turns: list[int],
                    exact: dict[int, tuple[int, int]], special: set[str]) -> list[tuple[int, int]] | None:
    """Each assistant turn from where the template took it (plus the generation prompt's
    length, learnt from the first turn checked) to where it took the next; None when the
    template did not go through the turns once in order."""
    n = len(messages)
    passes = [p for p in rendered.boundaries if len(p) == n + 1]
    if not passes:
        return None
    marks = max(passes, key=lambda p: p[-1] - p[0])  # the pass that wrote the turns
    # The generation prompt's length (what add_generation_prompt writes before an answer),
    # learnt from a checked turn that has turns before it.
    learn = next((j for j in sorted(exact) if j), None)
    header = exact[learn][0] - marks[learn] if learn is not None else 0
    spans = []
    for i in turns:
        start = marks[i] + header if i else 0
        end = len(rendered.text) if i == n - 1 else marks[i + 1]
        spans.append((start, _trim(rendered.text, start, end, special)))
    return spans
