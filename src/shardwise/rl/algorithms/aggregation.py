"""How a ``(batch, response_len)`` per-token loss becomes one number: ``loss_agg_mode``.

`aggregate_loss` is shardwise's form (global counts passed by the actor so that the
micro-batches of a mini-batch add up to its loss); `agg_loss` is verl's signature over it
(``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``)."""

from __future__ import annotations

import math
from typing import Literal

import torch

from shardwise.rl.algorithms._common import bool_mask, masked_mean, unknown_name

__all__ = ["AGG_MODES", "agg_loss", "aggregate_loss", "resolve_agg_mode"]

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                              "seq-mean-token-sum-norm")


def resolve_agg_mode(mode: str) -> AggMode:
    """`mode` checked against `AGG_MODES`; ValueError with the nearest valid mode otherwise."""
    if mode not in AGG_MODES:
        raise unknown_name("loss aggregation mode", str(mode), AGG_MODES)
    return mode  # type: ignore[return-value]


Count = int | float | torch.Tensor


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: Count | None = None,
                   global_seqs: Count | None = None, scale_factor: Count | None = None) -> torch.Tensor:
    """Reduce a ``(batch, response_len)`` per-token loss to a 0-d loss.

    - "token-mean": ``sum(loss * mask) / num_tokens``;
    - "token-sum": ``sum(loss * mask)`` (no normalisation);
    - "seq-mean-token-sum": ``sum over seqs of (sum over tokens) / num_seqs``;
    - "seq-mean-token-mean": ``sum over seqs of (token mean of the seq) / num_seqs``;
    - "seq-mean-token-sum-norm" (Dr. GRPO): seq-mean-token-sum divided by a constant,
      `scale_factor` (the most response tokens a sequence may have), by default the
      width of `loss_mat`; a constant keeps long and short answers weighted by length
      without the per-sequence length normalisation GRPO applies.

    ``num_tokens`` is the number of nonzero mask entries and ``num_seqs`` the number of
    rows with at least one (see `mask_counts`), counted locally unless `global_tokens`
    (token-mean) / `global_seqs` (seq modes) gives the count for the whole batch: then
    the results of micro-batches sum to the whole-batch result. A local count of 0 gives
    a loss of 0. The global count the mode does not use is ignored. dtype of `loss_mat`;
    differentiable.
    """
    mode = resolve_agg_mode(mode)
    m = bool_mask(mask, loss_mat)
    masked = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if mode == "token-sum":
        return masked.sum()
    if mode == "token-mean":
        return masked.sum() / _count(m.sum(), global_tokens, "global_tokens", loss_mat.dtype)
    per_seq = masked_mean(loss_mat, m, dim=-1) if mode == "seq-mean-token-mean" else masked.sum(-1)
    loss = per_seq.sum() / _count(m.any(-1).sum(), global_seqs, "global_seqs", loss_mat.dtype)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mat.shape[-1] if scale_factor is None else scale_factor)
    return loss


def _count(local: torch.Tensor, given: Count | None, name: str, dtype: torch.dtype) -> Count:
    if given is None:
        count = local.to(dtype)
        return torch.where(count > 0, count, torch.ones_like(count))
    # A tensor is not inspected: reading it would force a device sync.
    if not isinstance(given, torch.Tensor) and not (given > 0 and math.isfinite(given)):
        raise ValueError(f"{name} must be a positive count, got {given}")
    return given


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: Count | None = None, global_batch_size: Count | None = None,
             loss_scale_factor: Count | None = None) -> torch.Tensor:
    """verl's ``agg_loss``: `aggregate_loss` with verl's names, times `dp_size` (FSDP
    averages gradients over the data-parallel ranks; the loss of each rank is its share
    of the global batch's, so the average is undone). `batch_num_tokens` /
    `global_batch_size`: the global batch's token and sequence counts, needed when
    ``dp_size > 1``; `loss_scale_factor`: seq-mean-token-sum-norm's constant."""
    if dp_size > 1 and ((loss_agg_mode == "token-mean" and batch_num_tokens is None)
                        or (loss_agg_mode.startswith("seq-") and global_batch_size is None)):
        raise ValueError(f"agg_loss: {loss_agg_mode} with dp_size={dp_size} needs the global batch's count "
                         "(batch_num_tokens / global_batch_size)")
    loss = aggregate_loss(loss_mat, loss_mask, loss_agg_mode, batch_num_tokens, global_batch_size, loss_scale_factor)
    return loss * dp_size if dp_size != 1 else loss
