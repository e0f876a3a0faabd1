"""Preference pairs: ``prompt`` / ``chosen`` / ``rejected`` rows read, checked, encoded and
collated (``train.objective`` dpo and reward_model).

A row is as TRL and OpenRLHF write them: ``data.prompt_key``, ``data.chosen_key`` and
``data.rejected_key`` (and ``data.margin_key`` for a reward model), each answer a string
or a list of messages (conversational: the prompt's messages, then the answer's assistant
turn). Files are any format data.source reads (.jsonl, .json, .parquet).

Each pair becomes two training examples of `shardwise.data.encode` (one road from text to
ids): a plain text pair is ``[bos] + prompt + answer + eos`` with the answer trained; a
conversation (prompt or answer given as messages; a text prompt is one user turn, a text
answer one assistant turn) is rendered by the chat template and only its last assistant
turn is trained. The trained tokens are the ones whose log-probs are summed
(`shardwise.engine.preference.sequence_log_probs`).

Bad pairs (`check_pairs`): an answer missing or empty, chosen equal to rejected, a prompt
that leaves no answer token within data.max_length, or two answers equal after the cut
to data.max_length. Each is a DataError naming the row, unless ``data.drop_bad_pairs``,
which drops them and counts them in one note.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.config.schema import Config
from shardwise.data.chat import normalize_messages, text_prompts_as_chat
from shardwise.data.collate import example_loss_tokens, pad_collate
from shardwise.data.encode import UNLIMITED, encode_records
from shardwise.data.sources import load_records
from shardwise.errors import ConfigError, DataError

log = logging.getLogger(__name__)

__all__ = ["PAIR_OBJECTIVES", "answer_record", "check_pairs", "collate_pairs", "encode_pairs", "load_pairs", "pair_records"]

PAIR_OBJECTIVES: tuple[str, ...] = ("dpo", "reward_model")
"""The ``train.objective`` values trained on pairs."""

Pair = dict[str, Any]
"""``{"prompt", "chosen", "rejected", "margin", "where"}`` as read."""


def load_pairs(cfg: Config, source: str | None = None, source_key: str = "data.source") -> list[Pair]:
    """The pairs of ``data.source`` (or `source`, named by `source_key` in messages), every
    read and key problem, a missing or empty answer, raised here as one DataError naming
    the row."""
    d = cfg.data
    src = d.source if source is None else source
    if src.startswith("builtin:"):
        raise ConfigError(source_key, f"{src!r}: train.objective={cfg.train.objective} trains on preference pairs, "
                          "which the built-in tasks do not make", "give a .jsonl / .json / .parquet file with "
                          f"{d.prompt_key!r}, {d.chosen_key!r} and {d.rejected_key!r} columns")
    extra = {"chosen": (d.chosen_key, "data.chosen_key", True), "rejected": (d.rejected_key, "data.rejected_key", True)}
    if d.margin_key is not None:
        extra["margin"] = (d.margin_key, "data.margin_key", True)
    rows = load_records(src, d.prompt_key, None, seed=cfg.run.seed, fmt=d.format, as_chat=text_prompts_as_chat(d),
                        extra_keys=extra, source_key=source_key)
    pairs = []
    for i, r in enumerate(rows):
        where = f"{source_key} '{src}' row {i}"
        pair = {"prompt": r["prompt"], "where": where, "margin": None}
        for key in ("chosen", "rejected"):
            pair[key] = _answer(r[key], where, f"data.{key}_key", getattr(d, f"{key}_key"))
        if d.margin_key is not None:
            m = r["margin"]
            if isinstance(m, bool) or not isinstance(m, (int, float)):
                raise DataError(f"data.margin_key: {where}: {d.margin_key!r} must be a number, got {m!r}; "
                                "fix the row or unset data.margin_key")
            pair["margin"] = float(m)
        pairs.append(pair)
    if not pairs:
        raise DataError(f"{source_key}: '{src}' holds no pairs; add rows")
    return pairs


def _answer(value: Any, where: str, config_key: str, key: str) -> str | list[dict[str, Any]]:
    """An answer (column `key`, set by `config_key`) as text or normalized messages;
    DataError for a missing or empty one."""
    if value is None or (isinstance(value, (str, list, tuple)) and not value):
        raise DataError(f"{config_key}: {where}: {key!r} is missing or empty; every pair needs both answers "
                        "(remove the row)")
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{config_key}: {where}: {key!r} is blank; every pair needs both answers (remove the row)")
        return value
    if isinstance(value, (list, tuple)):
        turns = normalize_messages(value, f"{config_key}: {where}")
        if turns[-1]["role"] != "assistant" or not str(turns[-1].get("content") or "").strip():
            raise DataError(f"{config_key}: {where}: {key!r} must end with a non-empty assistant turn")
        return turns
    raise DataError(f"{config_key}: {where}: {key!r} must be text or a list of messages, got {type(value).__name__}")


def pair_records(pair: Pair) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two training records (`shardwise.data.encode.encode_record`'s form) of a pair:
    chosen, rejected. Text prompt and text answers: plain pairs; otherwise conversations
    (a text prompt as one user turn, a text answer as one assistant turn)."""
    return answer_record(pair["prompt"], pair["chosen"], pair["where"]), answer_record(
        pair["prompt"], pair["rejected"], pair["where"])


def answer_record(prompt: str | list[dict[str, Any]], answer: str | list[dict[str, Any]],
                  where: str) -> dict[str, Any]:
    """One prompt and its answer as a training record: text and text a plain pair
    (``[bos] + prompt + answer + eos``), otherwise a conversation (a text prompt one user
    turn, a text answer one assistant turn). Also how an RL row is rendered for a reward
    model of another tokenizer (`shardwise.rl.workers.reward.RewardModelInputs`), so it
    reads the row as it read its training pairs."""
    if isinstance(prompt, str) and isinstance(answer, str):
        return {"prompt": prompt, "response": answer}
    head = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    tail = answer if isinstance(answer, list) else [{"role": "assistant", "content": answer}]
    return {"messages": list(head) + list(tail), "where": where}


def encode_pairs(tokenizer, pairs: Sequence[Pair], max_length: int, progress: bool = False) -> list[dict[str, Any]]:
    """Each pair as ``{"chosen": example, "rejected": example, "margin": float | None,
    "prompt_tokens", "lengths": (chosen, rejected) untruncated}`` (examples in the
    collators' form; conversations trained on their last assistant turn only)."""
    records = [r for p in pairs for r in pair_records(p)]
    encoded = encode_records(tokenizer, records, max_length, "last_assistant", progress=progress)
    out = []
    for i, p in enumerate(pairs):
        c, r = encoded[2 * i], encoded[2 * i + 1]
        out.append({"chosen": c.example, "rejected": r.example, "margin": p["margin"],
                    "lengths": (c.length, r.length)})
    return out


REASONS = {
    "identical": "chosen and rejected are the same",
    "prompt_too_long": "the prompt leaves no answer token within data.max_length",
    "same_after_cut": "the two answers are the same after the cut to data.max_length",
}


def check_pairs(tokenizer, pairs: list[Pair], max_length: int, drop: bool,
                progress: bool = False) -> tuple[list[Pair], list[dict[str, Any]], str | None]:
    """(kept pairs, their encodings, the note counting the dropped ones or None). A bad
    pair (module docstring) is a DataError naming its row, unless `drop`."""
    encoded = encode_pairs(tokenizer, pairs, max_length, progress)
    kept, kept_enc, dropped = [], [], Counter()
    for p, e in zip(pairs, encoded):
        reason = _bad(p, e)
        if reason is None:
            kept.append(p)
            kept_enc.append(e)
            continue
        if not drop:
            detail = REASONS[reason]
            if reason == "prompt_too_long":
                detail = (f"the prompt takes {_prompt_tokens(tokenizer, p)} tokens, data.max_length is {max_length}; "
                          "raise data.max_length")
            elif reason == "same_after_cut":
                detail += f" ({max_length} tokens); raise data.max_length"
            raise DataError(f"{p['where']}: {detail}; fix or remove the row, or set data.drop_bad_pairs=true "
                            "to drop such rows")
        dropped[reason] += 1
    note = None
    if dropped:
        parts = ", ".join(f"{n} {REASONS[k].split(' (')[0]}" for k, n in sorted(dropped.items()))
        note = f"{sum(dropped.values())} of {len(pairs)} pairs dropped (data.drop_bad_pairs): {parts}"
    if not kept:
        raise DataError(f"no pair of {len(pairs)} is left to train on ({note}); check the data and data.max_length")
    return kept, kept_enc, note


def _bad(pair: Pair, enc: dict[str, Any]) -> str | None:
    if pair["chosen"] == pair["rejected"]:
        return "identical"
    c, r = enc["chosen"], enc["rejected"]
    if not example_loss_tokens(c) or not example_loss_tokens(r):
        return "prompt_too_long"
    if c["input_ids"] == r["input_ids"]:
        return "same_after_cut"
    return None


def _prompt_tokens(tokenizer, pair: Pair) -> int:
    """Tokens before the first trained one of the untruncated chosen example."""
    enc = encode_records(tokenizer, [pair_records(pair)[0]], UNLIMITED, "last_assistant")[0]
    return next((i for i, m in enumerate(enc.loss_mask) if m), len(enc.ids))


def collate_pairs(examples: Sequence[dict[str, Any]], pad_id: int, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """P pairs as one padded batch of 2P rows: the chosen answers (rows 0..P-1), then the
    rejected ones (rows P..2P-1), as `pad_collate` makes them; plus ``pair_index`` ``(P,)``
    int64 (the pairs' indices in the data) and ``margin`` ``(P,)`` fp32 when the pairs
    have margins."""
    batch = pad_collate([e["chosen"] for e in examples] + [e["rejected"] for e in examples], pad_id)
    batch["pair_index"] = torch.tensor(list(indices), dtype=torch.long)
    if examples and examples[0]["margin"] is not None:
        batch["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float32)
    return batch
