"""Data and losses of the encoder tasks (``model.task`` masked_lm / sequence_classification).

One example is a text framed by the tokenizer's special tokens (``[CLS] text [SEP]`` for a
BERT tokenizer, ``<bos> text <eos>`` for the built-in character tokenizer's encoder
variant), cut to ``data.max_length`` with the closing token kept. Batches are padded on the
right: ``input_ids`` and ``attention_mask`` ``(batch, seq)`` int64, and

- masked_lm: ``labels`` ``(batch, seq)``, the original token at the masked positions and
  -100 elsewhere (no shift: position t predicts token t). BERT's masking: 15% of the
  positions that are not special tokens are chosen (at least one per example); of these
  80% become the mask token, 10% a random ordinary token, 10% stay as they are. The choice
  is a function of ``(run.seed, the example's index in the data)`` only, made once, so
  every run of a config (sharded, unsharded, resumed) sees the same masks. Loss tokens:
  the masked positions.
- sequence_classification: ``labels`` ``(batch,)``, the class of each row (an integer in
  0 .. num_labels - 1, or a name of the model config's ``label2id``). Loss tokens: rows.

Losses are sums (fp32, 0-d) over a micro-batch, as `shardwise.engine.train.TrainEngine`
expects: it scales them by world size / global loss tokens, so the gradient is the mean
over the global batch whatever the sharding.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.config.schema import Config
from shardwise.config.validate import MeshSpec
from shardwise.data.collate import IGNORE_INDEX
from shardwise.data.sampler import GlobalBatchSampler, micro_batches, rank_share
from shardwise.data.sources import load_records
from shardwise.data.tokenizer import load_tokenizer, locate_tokenizer, pad_token_id
from shardwise.errors import ConfigError, DataError

log = logging.getLogger(__name__)

__all__ = [
    "ENCODER_TASKS",
    "EncoderData",
    "check_tokenizer",
    "classification_loss_sum",
    "collate",
    "encode_text",
    "is_encoder_task",
    "load_encoder_records",
    "mask_tokens",
    "masked_lm_loss_sum",
    "prepare_inputs",
]

ENCODER_TASKS: tuple[str, ...] = ("masked_lm", "sequence_classification")
"""The ``model.task`` values this module serves (causal_lm is `shardwise.jobs.sft`'s own)."""

MASK_PROB = 0.15
"""Share of the maskable positions of an example that are chosen for the MLM loss."""
MASK_AS_MASK = 0.8
"""Of the chosen positions: this share becomes the mask token ..."""
MASK_AS_RANDOM = 0.1
"""... this share a random ordinary token; the rest keep their token."""

Batch = dict[str, torch.Tensor]
Example = dict[str, Any]
"""``{"input_ids": list[int], "labels": list[int] | int}``."""


def is_encoder_task(task: str) -> bool:
    """Whether ``model.task`` `task` is trained by this module."""
    return task in ENCODER_TASKS


def check_config(cfg: Config, spec: MeshSpec) -> None:
    """Settings the encoder tasks cannot honour: ConfigError naming the key."""
    task = cfg.model.task
    if cfg.data.packing:
        raise ConfigError("data.packing", f"model.task={task} trains one text per row", "set data.packing=false")
    if spec.ulysses > 1:
        raise ConfigError("parallel.ulysses_size", f"Ulysses sequence parallel runs causal-LM attention only, "
                          f"not model.task={task}", "set parallel.ulysses_size=1")
    if cfg.train.chunked_loss.enabled:
        raise ConfigError("train.chunked_loss.enabled", f"the chunked loss is the causal-LM head's; "
                          f"model.task={task} computes its own", "set train.chunked_loss.enabled=false")


def load_encoder_records(cfg: Config, hf_config) -> list[dict[str, Any]]:
    """The records of ``data.source`` as ``{"text": str, "label": int | None}`` (label for
    sequence_classification only), every row checked: DataError naming ``data.text_key`` /
    ``data.label_key`` and the row."""
    d = cfg.data
    classify = cfg.model.task == "sequence_classification"
    rows = load_records(d.source, d.text_key, d.label_key if classify else None, seed=cfg.run.seed,
                        num_builtin=d.num_examples, key_names=("data.text_key", "data.label_key"))
    if not classify:
        return [{"text": r["prompt"], "label": None} for r in rows]
    num_labels = int(hf_config.num_labels)
    names = {str(k): int(v) for k, v in (getattr(hf_config, "label2id", None) or {}).items()}
    out = []
    for i, r in enumerate(rows):
        raw = str(r["response"]).strip()
        label = int(raw) if raw.lstrip("-").isdigit() else names.get(raw)
        if label is None or not 0 <= label < num_labels:
            raise DataError(f"data.label_key: '{d.source}' row {i}: label {raw!r} is not a class of the model "
                            f"(0 .. {num_labels - 1}{', or a name of its label2id' if names else ''}); "
                            "fix the row or set model.config num_labels")
        out.append({"text": r["prompt"], "label": label})
    return out


def check_tokenizer(tokenizer, task: str, key: str = "model.tokenizer") -> None:
    """masked_lm needs a mask token: ConfigError on `key` otherwise."""
    if task == "masked_lm" and tokenizer.mask_token_id is None:
        raise ConfigError(key, "the tokenizer has no mask token, which masked_lm needs",
                          "use an encoder's tokenizer (BERT's [MASK]), or leave model.tokenizer unset to build one")


def prepare_inputs(cfg: Config, spec: MeshSpec, hf_config) -> list[dict[str, Any]]:
    """Every check of an encoder run that needs no process group (settings, data, an
    existing tokenizer folder; the model's fit to the task is `shardwise.jobs.inputs.check_model`'s);
    returns the records (`load_encoder_records`)."""
    check_config(cfg, spec)
    records = load_encoder_records(cfg, hf_config)
    found = locate_tokenizer(cfg.model.tokenizer, cfg.model.path, cfg.run.dir)
    if found is not None:
        check_tokenizer(load_tokenizer(found, require_eos=False), cfg.model.task)
    return records


def encode_text(tokenizer, text: str, max_length: int) -> tuple[list[int], bool]:
    """(token ids of `text` framed by the tokenizer's special tokens, cut to `max_length`
    keeping the closing token; whether it was cut)."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ids) <= max_length:
        return ids, False
    return tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"], True


def example_rng(seed: int, index: int) -> np.random.Generator:
    """The random generator of example `index` under run seed `seed`: numpy's PCG64 seeded
    with the pair through a SeedSequence, so every pair has its own stream (torch's CPU
    generator keeps only 32 bits of its seed, too few to hold both)."""
    return np.random.default_rng([seed % 2**64, index])


def mask_tokens(ids: Sequence[int], special_ids: set[int], mask_id: int, random_ids: torch.Tensor,
                seed: int, index: int, prob: float = MASK_PROB) -> tuple[list[int], list[int]]:
    """BERT's masking of one example: (input ids, labels), each ``len(ids)`` long.

    Positions whose token is in `special_ids` are never chosen. Each other position is
    chosen with probability `prob` (at least one is, when any can be); a chosen position's
    label is its token (-100 elsewhere) and its input is `mask_id` (80%), a token drawn
    from `random_ids` (10%, a 1-D int64 tensor of ordinary ids) or itself (10%). All draws
    come from ``example_rng(seed, index)``.
    """
    rng = example_rng(seed, index)
    n = len(ids)
    u = rng.random(n)
    kind = rng.random(n)
    pick = rng.integers(len(random_ids), size=n)
    can = np.array([t not in special_ids for t in ids], dtype=bool)
    chosen = (u < prob) & can
    if not chosen.any() and can.any():
        chosen[int(np.where(can, u, np.inf).argmin())] = True
    inputs, labels = list(ids), [IGNORE_INDEX] * n
    for t in np.flatnonzero(chosen).tolist():
        labels[t] = ids[t]
        if kind[t] < MASK_AS_MASK:
            inputs[t] = mask_id
        elif kind[t] < MASK_AS_MASK + MASK_AS_RANDOM:
            inputs[t] = int(random_ids[pick[t]])
    return inputs, labels


def ordinary_ids(tokenizer) -> torch.Tensor:
    """The ids of the tokenizer that are not special tokens, int64 ``(n,)``: what a random
    replacement draws from."""
    special = set(tokenizer.all_special_ids)
    return torch.tensor([i for i in range(len(tokenizer)) if i not in special], dtype=torch.long)


def collate(examples: Sequence[Example], pad_id: int) -> Batch:
    """Pad examples on the right: ``input_ids``, ``attention_mask`` ``(batch, seq)`` int64,
    ``labels`` ``(batch, seq)`` (-100 at padding) for per-token labels or ``(batch,)``."""
    seq = max(len(ex["input_ids"]) for ex in examples)
    ids = torch.full((len(examples), seq), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), seq), dtype=torch.long)
    per_token = isinstance(examples[0]["labels"], list)
    labels = (torch.full((len(examples), seq), IGNORE_INDEX, dtype=torch.long) if per_token
              else torch.tensor([ex["labels"] for ex in examples], dtype=torch.long))
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        ids[i, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
        mask[i, :n] = 1
        if per_token:
            labels[i, :n] = torch.tensor(ex["labels"], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_tokens(example: Example) -> int:
    """What one example adds to the loss's denominator: its masked positions, or 1 (a row)."""
    labels = example["labels"]
    return sum(1 for t in labels if t != IGNORE_INDEX) if isinstance(labels, list) else 1


def _forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def masked_lm_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed cross-entropy (fp32, 0-d) of the masked positions (``labels != -100``)."""
    logits = _forward(model, batch)
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def classification_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed cross-entropy (fp32, 0-d) of the rows' classes; logits ``(batch, num_labels)``."""
    logits = _forward(model, batch)
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")


LOSSES = {"masked_lm": masked_lm_loss_sum, "sequence_classification": classification_loss_sum}
"""The loss of each encoder task, `TrainEngine.train_step`'s ``loss_fn``."""


def encode_examples(records: Sequence[dict[str, Any]], tokenizer, task: str, max_length: int,
                    seed: int) -> tuple[list[Example], int]:
    """(the tokenised, masked or labelled examples of `records`, how many were cut)."""
    special = set(tokenizer.all_special_ids)
    random_ids = ordinary_ids(tokenizer) if task == "masked_lm" else None
    examples, cut = [], 0
    for i, r in enumerate(records):
        ids, was_cut = encode_text(tokenizer, r["text"], max_length)
        cut += was_cut
        if task == "masked_lm":
            inputs, labels = mask_tokens(ids, special, tokenizer.mask_token_id, random_ids, seed, i)
            examples.append({"input_ids": inputs, "labels": labels})
        else:
            examples.append({"input_ids": ids, "labels": int(r["label"])})
    return examples, cut


class EncoderData:
    """Tokenised encoder examples and this rank's per-step micro-batches; the interface of
    `shardwise.jobs.sft.SFTData` (``next_step``, ``state_dict``, ``load_state_dict``,
    ``loss_fn``)."""

    def __init__(self, cfg: Config, records: list[dict[str, Any]], tokenizer, dp_rank: int, dp_size: int):
        task = cfg.model.task
        assert is_encoder_task(task), task
        check_tokenizer(tokenizer, task)
        self.pad_id = pad_token_id(tokenizer)
        self.examples, cut = encode_examples(records, tokenizer, task, cfg.data.max_length, cfg.run.seed)
        if cut and (not dist.is_initialized() or dist.get_rank() == 0):
            log.warning("data: %d of %d texts are longer than data.max_length=%d tokens and are cut (their "
                        "beginning is kept); raise data.max_length to keep them whole",
                        cut, len(records), cfg.data.max_length)
        self.loss_fn = LOSSES[task]
        self.micro_batch_size = cfg.train.micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = GlobalBatchSampler(len(self.examples), cfg.train.global_batch_size, cfg.run.seed)
        self._it = iter(self.sampler)

    def next_step(self) -> tuple[list[Batch], int, int]:
        """(this rank's micro-batches, loss tokens in the whole global batch, tokens in it)."""
        indices = next(self._it)
        global_examples = [self.examples[i] for i in indices]
        n_loss = sum(loss_tokens(ex) for ex in global_examples)
        if n_loss == 0:
            raise DataError("data.text_key: every text of a global batch is empty (no token to mask); "
                            "remove empty texts from data.source")
        tokens = sum(len(ex["input_ids"]) for ex in global_examples)
        mine = rank_share(indices, self.dp_rank, self.dp_size)
        mbs = [collate([self.examples[i] for i in mb], self.pad_id) for mb in micro_batches(mine, self.micro_batch_size)]
        return mbs, n_loss, tokens

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = iter(self.sampler)
