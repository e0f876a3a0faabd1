"""Token losses as sums, so callers normalise by the token count of the whole global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over positions whose label is not -100.

    logits (batch, seq, vocab), labels (batch, seq) aligned with input_ids (HF convention:
    position t predicts labels[t + 1]). Computed in fp32. Returns a scalar.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Positions that `causal_lm_loss_sum` counts: labels[:, 1:] != -100."""
    return int((labels[:, 1:] != IGNORE).sum())


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) per position: logits (batch, seq, vocab), targets (batch, seq) -> (batch, seq) fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
