"""Token losses as sums, so callers normalise by the token count of the whole global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.data.collate import IGNORE_INDEX


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over positions whose label is not -100.

    logits (batch, seq, vocab), labels (batch, seq) aligned with input_ids (HF convention:
    position t predicts labels[t + 1]). Computed in fp32. Returns a scalar. The positions it
    counts are those of `shardwise.data.collate.count_loss_tokens`.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
