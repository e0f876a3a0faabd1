"""Batch encoded examples: padded or packed. Nothing here tokenizes: the examples come
from `shardwise.data.encode` (``{"input_ids", "loss_mask"}``, the loss mask 1 on trained
tokens).

Conventions, shared by every function here:

- ``labels`` follow the Hugging Face convention: aligned with ``input_ids`` (label[t] is
  token t itself), -100 where no loss is taken; the HF causal-LM loss shifts internally,
  so the logits at position t-1 are scored against labels[t]. Position 0 of each example
  is always -100 (no position predicts it), which keeps ``labels != -100`` equal to the
  positions that actually enter the loss, in padded and packed batches alike.
- Padding is on the right; padded positions have label -100.

Batches are dicts of tensors; the model inputs are ``input_ids``, ``attention_mask`` and
``position_ids`` (pass exactly these three, plus ``labels`` if HF should compute the loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.errors import DataError

IGNORE_INDEX = -100
"""Label value the cross-entropy ignores (HF and torch default)."""

Example = dict[str, list[int]]
"""``{"input_ids": [...], "loss_mask": [...]}``, equal lengths."""


def _example_labels(ex: Example) -> list[int]:
    ids, mask = ex["input_ids"], ex["loss_mask"]
    if len(ids) != len(mask):
        raise DataError(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    if not ids:
        raise DataError("an example has no tokens")
    labels = [tok if m else IGNORE_INDEX for tok, m in zip(ids, mask)]
    labels[0] = IGNORE_INDEX
    return labels


def pad_collate(
    examples: Sequence[Example],
    pad_id: int,
    pad_to: int | None = None,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Right-pad examples into one batch, one example per row.

    Sequence length is the longest example, or `pad_to` when given (an error if an
    example is longer), then rounded up to a multiple of `pad_to_multiple_of` (e.g. the
    sequence-parallel degree). Returns int64 tensors of shape ``(batch, seq)``:

    - ``input_ids``: tokens, `pad_id` after each example's end;
    - ``attention_mask``: 1 on real tokens, 0 on padding;
    - ``position_ids``: ``0 .. seq-1`` on every row (padding positions are masked);
    - ``labels``: the token where loss_mask is 1, else -100; position 0 and padding -100.
    """
    if not examples:
        raise DataError("pad_collate: no examples")
    labels = [_example_labels(ex) for ex in examples]
    longest = max(len(ex["input_ids"]) for ex in examples)
    seq = longest if pad_to is None else pad_to
    if seq < longest:
        raise DataError(f"pad_collate: an example has {longest} tokens, more than pad_to={pad_to}")
    if pad_to_multiple_of < 1:
        raise DataError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    seq = -(-seq // pad_to_multiple_of) * pad_to_multiple_of

    batch = len(examples)
    input_ids = torch.full((batch, seq), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, seq), dtype=torch.long)
    label_t = torch.full((batch, seq), IGNORE_INDEX, dtype=torch.long)
    for row, (ex, lab) in enumerate(zip(examples, labels)):
        n = len(ex["input_ids"])
        input_ids[row, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        label_t[row, :n] = torch.tensor(lab, dtype=torch.long)
    position_ids = torch.arange(seq, dtype=torch.long).expand(batch, seq).clone()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "labels": label_t,
    }


def pack_collate(
    examples: Sequence[Example], max_length: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Pack examples, in order, into rows of at most `max_length` tokens.

    A new row starts when the next example does not fit in the current one; rows are
    right-padded to the longest row. Returns:

    - ``input_ids`` ``(batch, seq)`` int64, `pad_id` on padding;
    - ``position_ids`` ``(batch, seq)`` int64, restarting at 0 at each example; padding
      tokens get 0 each (so each is a sequence of its own);
    - ``labels`` ``(batch, seq)`` int64, -100 at the first token of every example (no
      loss crosses a boundary), where loss_mask is 0, and on padding;
    - ``attention_mask`` ``(batch, 1, seq, seq)`` bool, True where query i may attend to
      key j: the same example and j <= i. Block-diagonal causal; a padding token attends
      only to itself, so no row is fully masked (which would give NaN in softmax).

    How to feed it to a transformers 5 model (both routes are tested on Qwen3 against
    the same examples padded one per row):

    - ``attn_implementation="sdpa"``: pass the bool 4-D ``attention_mask`` as it is;
      HF returns a 4-D mask unchanged (``masking_utils._preprocess_mask_arguments``)
      and SDPA reads bool as "may attend".
    - ``"eager"``: eager attention *adds* the mask to the scores, so convert it first
      with `additive_mask(mask, dtype)` (0 / dtype min), in the compute dtype.
    - any implementation, including flash-attention varlen: pass ``attention_mask=None``,
      ``position_ids`` and ``use_cache=False``; HF detects the packed sequences from the
      restarts in position_ids (``find_packed_sequence_indices``) and builds the same
      block-diagonal mask itself. This route needs no dtype and no (seq, seq) tensor.
      The detection is skipped whenever a KV cache exists, and Qwen3 creates one by
      default (``config.use_cache`` is True), so without ``use_cache=False`` the rows
      silently attend across examples.

    A packed row given only a 2-D padding mask also attends across examples; the test
    checks that this gives a different loss, so the routes above are not vacuous.
    """
    if not examples:
        raise DataError("pack_collate: no examples")
    rows: list[list[tuple[Example, list[int]]]] = [[]]
    used = 0
    for ex in examples:
        lab = _example_labels(ex)
        n = len(ex["input_ids"])
        if n > max_length:
            raise DataError(f"pack_collate: an example has {n} tokens, more than max_length={max_length}")
        if used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append((ex, lab))
        used += n
    seq = max(sum(len(ex["input_ids"]) for ex, _ in row) for row in rows)

    batch = len(rows)
    input_ids = torch.full((batch, seq), pad_id, dtype=torch.long)
    position_ids = torch.zeros((batch, seq), dtype=torch.long)
    labels = torch.full((batch, seq), IGNORE_INDEX, dtype=torch.long)
    # Segment id per token; padding gets a distinct negative id per position.
    segment = -1 - torch.arange(seq).expand(batch, seq).clone()
    for r, row in enumerate(rows):
        start = 0
        for k, (ex, lab) in enumerate(row):
            n = len(ex["input_ids"])
            input_ids[r, start : start + n] = torch.tensor(ex["input_ids"], dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(n)
            labels[r, start : start + n] = torch.tensor(lab, dtype=torch.long)
            segment[r, start : start + n] = k
            start += n
    same_segment = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    attention_mask = (same_segment & causal)[:, None, :, :]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "labels": labels,
    }


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool "may attend" mask as an additive one for eager attention: 0.0 where True,
    the smallest finite value of `dtype` where False. Same shape, dtype `dtype`."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def example_loss_tokens(ex: Example) -> int:
    """Loss tokens one tokenised example contributes (the positions `count_loss_tokens`
    counts once the example is collated), so a caller can count a whole global batch
    without collating it."""
    return sum(1 for label in _example_labels(ex) if label != IGNORE_INDEX)


def count_loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Number of label positions that enter the loss: ``(labels[:, 1:] != -100).sum()``.

    These are the targets left after the HF shift (labels[t] is scored with the logits
    at t-1, so column 0 never counts). With the collators here column 0 of each example
    is already -100, so this also equals ``(labels != -100).sum()``. The engine sums the
    per-token loss over a micro-batch and divides by this count summed over every
    micro-batch and rank of the global batch, so the loss is a mean over loss tokens
    whatever the split.
    """
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum().item())
