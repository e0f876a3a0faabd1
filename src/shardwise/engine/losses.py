"""Token losses as sums, so callers normalise by the token count of the whole global batch.

Two ways to the same sum: `causal_lm_loss_sum` from the model's logits, and
`chunked_causal_lm_loss_sum`, which calls the model itself with its output head run over
chunks of tokens (`shardwise.models.chunked_head`), so the ``(batch, seq, vocab)`` fp32
logits never exist. ``train.chunked_loss`` picks one (`loss_chunk_tokens`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config.schema import ChunkedLossConfig
from shardwise.data.collate import IGNORE_INDEX
from shardwise.models.chunked_head import per_token_log_probs

__all__ = ["causal_lm_loss_sum", "chunked_causal_lm_loss_sum", "loss_chunk_tokens", "shift_labels"]


def loss_chunk_tokens(chunked: ChunkedLossConfig) -> int | None:
    """Tokens per chunk of the LM head and loss (``train.chunked_loss``), or None for the
    plain full-logits path."""
    return chunked.chunk_tokens if chunked.enabled else None


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


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF labels ``(batch, seq)`` (aligned with input_ids) -> the label each position
    predicts, ``labels[:, t + 1]``, -100 at the last position: ``(batch, seq)``."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def chunked_causal_lm_loss_sum(model: nn.Module, labels: torch.Tensor, chunk_tokens: int,
                               **inputs: torch.Tensor) -> torch.Tensor:
    """`causal_lm_loss_sum` of ``model(**inputs)``'s logits, computed without them: the LM
    head and the cross-entropy run over chunks of `chunk_tokens` tokens (of all rows
    together), each recomputed in backward.

    labels ``(batch, seq)`` in the HF convention, as for `causal_lm_loss_sum`; `inputs` are
    the model's (``input_ids``, ``attention_mask``, ``position_ids``). Returns the fp32
    scalar sum over labelled positions. Equal to the plain sum up to the order of fp32
    sums (the per-token terms are added in another order).
    """
    log_probs = per_token_log_probs(model, shift_labels(labels), chunk_tokens, **inputs)["log_probs"]
    return -log_probs.sum()
