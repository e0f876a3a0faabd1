"""Helpers every trainable role shares: global counts for loss aggregation and
micro-batching of a rank's rows."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.rl.batch import Batch


def global_counts(mask: torch.Tensor, device: torch.device, group=None) -> tuple[float, float]:
    """(masked tokens, sequences with at least one masked token) summed over all ranks.

    Collective over `group` (default: the whole world). These are the denominators that
    make micro-batch losses add up to the loss of the whole (global) mini-batch.
    """
    m = mask.bool()
    counts = torch.tensor([float(m.sum()), float(m.any(-1).sum())], dtype=torch.float64, device=device)
    dist.all_reduce(counts, group=group)
    tokens, seqs = (float(c) for c in counts.tolist())
    return max(tokens, 1.0), max(seqs, 1.0)


def check_equal_rows(rows: int, n_mini: int, device: torch.device, what: str) -> None:
    """Collective: every rank holds `rows` rows that split into `n_mini` equal mini-batches,
    or every rank raises the same ValueError (a rank raising alone would leave its peers
    waiting in the next collective)."""
    counts = torch.tensor([rows], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)
    per_rank = [int(c) for c in gathered]
    if len(set(per_rank)) > 1:
        raise ValueError(f"{what}: ranks hold different numbers of rows {per_rank}; an update needs "
                         "the same rows on every rank (dispatch with DP_COMPUTE, pad=False)")
    if rows % n_mini:
        raise ValueError(f"{what}: {rows} rows per rank do not split into rl.actor.ppo_mini_batches={n_mini} "
                         "equal mini-batches")


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """`batch` in pieces of `size` rows (the last may be smaller); [] for an empty batch."""
    return batch.split(size) if len(batch) else []


def mean_over_ranks(values: dict[str, list[float]], device: torch.device) -> dict[str, float]:
    """Average each metric over its local entries, then over ranks (collective; every
    rank must pass the same keys)."""
    keys = sorted(values)
    if not keys:
        return {}
    local = torch.tensor([sum(values[k]) / max(len(values[k]), 1) for k in keys], dtype=torch.float64,
                         device=device)
    dist.all_reduce(local)
    local /= dist.get_world_size()
    return {k: float(v) for k, v in zip(keys, local.tolist())}


def rl_engine_config(cfg, lr: float | None = None):
    """The config a trainable RL role builds its TrainEngine from: the LR schedule spans
    every optimizer step of the run (``train.max_steps`` RL steps x ``ppo_epochs`` x
    ``ppo_mini_batches``), and `lr` (e.g. ``rl.critic.lr``) replaces the optimizer's."""
    a = cfg.rl.actor
    train = cfg.train.model_copy(update={"max_steps": cfg.train.max_steps * a.ppo_epochs * a.ppo_mini_batches})
    if lr is not None:
        train = train.model_copy(update={"optimizer": train.optimizer.model_copy(update={"lr": lr})})
    return cfg.model_copy(update={"train": train})
