"""`shardwise data`: the first examples of a config's data exactly as its job feeds them.

Training examples (what `shardwise train` trains on: ids and loss mask, after the chat
template and truncation) or, with `prompts`, the prompts `shardwise rl` / `shardwise
infer` generate from. The records are read and checked by the jobs' own `check_data` and
encoded by the one road the jobs take (`shardwise.data.encode`), with the tokenizer the
job would use: each example shown is the `Encoded` that module returns, nothing
recomputed. No process group, no model weights, nothing written.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.config.schema import Config
from shardwise.data import encoder
from shardwise.data.encode import Encoded, encode_prompt, encode_record, encode_records
from shardwise.data.pairs import PAIR_OBJECTIVES, load_pairs, pair_records
from shardwise.errors import ConfigError
from shardwise.jobs.inputs import check_causal_task, check_data, check_tokenizer, job_tokenizer, vision_inputs

__all__ = ["Shown", "format_json", "format_text", "preview", "show"]

_TEXT_MODEL = {"model_type": "qwen3"}
"""Stands for a model that does not exist yet (only whether it is a VL model matters here)."""

OPEN, CLOSE = "\u27e6", "\u27e7"
"""Marks around trained tokens in the text view: ⟦ ... ⟧."""


@dataclass
class Shown:
    """One example as the job feeds it."""

    index: int
    encoded: Encoded
    """What `shardwise.data.encode` returned for it (ids, loss mask, what truncation cut)."""
    where: str
    """Where the record came from (file and row, or the task)."""

    @property
    def ids(self) -> list[int]:
        return self.encoded.ids

    @property
    def mask(self) -> list[int] | None:
        return self.encoded.loss_mask

    @property
    def length(self) -> int:
        return self.encoded.length

    @property
    def lost(self) -> int:
        return self.encoded.lost


def preview(cfg: Config, n: int, prompts: bool) -> tuple[list[Shown], Any, int]:
    """``(the first n examples or prompts, the tokenizer, records in the source)``. Raises
    the jobs' ShardwiseErrors for bad data, a bad template or a bad config."""
    if n < 1:
        raise ConfigError("--n", f"{n} is not a positive number of examples", "e.g. --n 5")
    if encoder.is_encoder_task(cfg.model.task):
        raise ConfigError("model.task", f"`shardwise data` shows causal LM examples, not {cfg.model.task}",
                          "set model.task=causal_lm")
    if prompts:
        check_causal_task(cfg, "`shardwise data --prompts`")
    check_tokenizer(cfg)
    if cfg.model.path is not None and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        # e.g. the SFT stage's output of an RL config, not trained yet: the data need no weights
        print(f"shardwise: note: model.path {cfg.model.path!r} holds no model yet; shown as a text model with "
              "the tokenizer the job would find now", file=sys.stderr)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": None, "config": _TEXT_MODEL})})
    d = cfg.data
    if cfg.train.objective in PAIR_OBJECTIVES and not prompts:  # a pair: its chosen and rejected examples
        tokenizer = job_tokenizer(cfg)
        pairs = load_pairs(cfg)
        shown = []
        for i, p in enumerate(pairs[:n]):
            for side, enc in zip(("chosen", "rejected"), encode_records(tokenizer, pair_records(p), d.max_length,
                                                                         "last_assistant")):
                shown.append(Shown(i, enc, f"{p['where']} ({side})"))
        return shown, tokenizer, len(pairs)
    records = check_data(cfg, None, scoring=False) if prompts else check_data(cfg, d.response_key, sft=True)
    tokenizer = job_tokenizer(cfg)
    vision = vision_inputs(cfg, tokenizer)
    prefix = vision.prompt_prefix if vision is not None else ()
    shown = []
    for i, r in enumerate(records[:n]):
        where = r.get("where", f"{d.source} row {i}")
        if prompts:
            shown.append(Shown(i, encode_prompt(tokenizer, r["prompt"], d.max_length, prefix, where=where), where))
        else:
            shown.append(Shown(i, encode_record(tokenizer, r, d.max_length, d.train_on, prefix), where))
    return shown, tokenizer, len(records)


def show(cfg: Config, n: int, prompts: bool, as_json: bool = False) -> None:
    """`shardwise data`: print the first `n` examples (or prompts) of `cfg`'s data, as text
    with the trained tokens marked, or one JSON object per example."""
    shown, tokenizer, total = preview(cfg, n, prompts)
    print(format_json(shown, tokenizer) if as_json else format_text(shown, tokenizer, cfg.data.max_length, total))


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """Consecutive tokens of equal mask value: [(value, ids), ...]."""
    out: list[tuple[int, list[int]]] = []
    for tok, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


def _decode(tokenizer, ids: list[int]) -> str:
    """`ids` as text, special tokens kept; ids past the tokenizer's vocabulary (a VL
    model's image tokens) as ``<id N xK>`` (K of them in a row) instead of nothing."""
    size = len(tokenizer)
    parts = []
    for known, group in itertools.groupby(ids, key=lambda t: t < size):
        if known:
            parts.append(tokenizer.decode(list(group)))
        else:
            parts += [f"<id {tok} x{len(list(same))}>" for tok, same in itertools.groupby(group)]
    return "".join(parts)


def format_text(shown: list[Shown], tokenizer, max_length: int, total: int) -> str:
    """The human view: per example a header line (tokens, trained tokens, truncation) and
    its decoded text (special tokens kept), trained tokens between ⟦ and ⟧."""
    blocks = []
    for s in shown:
        head = f"#{s.index} {s.where}: {len(s.ids)} tokens"
        if s.mask is not None:
            head += f", {sum(s.mask)} trained"
            text = "".join(OPEN + _decode(tokenizer, run) + CLOSE if m else _decode(tokenizer, run)
                           for m, run in _runs(s.ids, s.mask))
        else:
            text = _decode(tokenizer, s.ids)
        if s.length > len(s.ids):
            kept = "first" if s.mask is not None else "last"
            head += (f"; truncated from {s.length} to data.max_length={max_length} (the {kept} tokens kept"
                     + (f", {s.lost} trained tokens cut" if s.mask is not None else "") + ")")
        blocks.append(f"{head}\n{text}")
    cut = sum(s.length > len(s.ids) for s in shown)
    blocks.append(f"-- {len(shown)} of {total} {'prompts' if shown and shown[0].mask is None else 'examples'} "
                  f"shown, {cut} of them truncated")
    return "\n\n".join(blocks)


def format_json(shown: list[Shown], tokenizer) -> str:
    """One JSON object per line: ``{"input_ids", "loss_mask", "text"}`` for examples,
    ``{"prompt_ids", "prompt_text"}`` for prompts."""
    lines = []
    for s in shown:
        text = _decode(tokenizer, s.ids)
        if s.mask is None:
            lines.append(json.dumps({"prompt_ids": s.ids, "prompt_text": text}, ensure_ascii=False))
        else:
            lines.append(json.dumps({"input_ids": s.ids, "loss_mask": s.mask, "text": text}, ensure_ascii=False))
    return "\n".join(lines)
