"""Helpers every trainable RL role shares: the global counts its losses are normalised
by, the mini-batch check, metric means over ranks and the engine config of a role.

All but `rl_engine_config` are collective: every rank calls them, each with its own rows.
The micro-batch loop itself is the engine's (`shardwise.engine.train.TrainEngine.accumulate`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.engine import packing
from shardwise.errors import ConfigError
from shardwise.models import families, vision


def global_counts(mask: torch.Tensor, device: torch.device, group=None, replicas: int = 1) -> tuple[float, float]:
    """(masked tokens, sequences with at least one masked token) summed over all ranks.

    Collective over `group` (default: the whole world). These are the denominators that
    make micro-batch losses add up to the loss of the whole (global) mini-batch.
    `replicas`: ranks holding each row (the sequence-parallel peers of a group hold the
    same rows), counted once.
    """
    m = mask.bool()
    counts = torch.tensor([float(m.sum()), float(m.any(-1).sum())], dtype=torch.float64, device=device)
    dist.all_reduce(counts, group=group)
    tokens, seqs = (float(c) / replicas for c in counts.tolist())
    return max(tokens, 1.0), max(seqs, 1.0)


def check_mini_batches(rows: int, n_mini: int, device: torch.device) -> None:
    """Collective: every rank's rows cut into `n_mini` equal mini-batches, or every rank
    raises the same ConfigError (a rank raising alone would leave its peers waiting in
    the next collective)."""
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([rows], dtype=torch.int64, device=device))
    rows_per_rank = [int(c) for c in counts]
    if any(r % n_mini for r in rows_per_rank):
        raise ConfigError("rl.actor.ppo_mini_batches",
                          f"the ranks hold {rows_per_rank} rows, which do not all divide into "
                          f"{n_mini} equal mini-batches",
                          "choose ppo_mini_batches dividing the rows each rank gets "
                          "(rollout rows / data-parallel ranks)")


def mean_over_ranks(values: dict[str, list[float]], device: torch.device) -> dict[str, float]:
    """The mean of each metric over all its entries on all ranks (collective; every rank
    must pass the same keys; a rank may have no entries for a key)."""
    keys = sorted(values)
    if not keys:
        return {}
    sums = torch.tensor([[sum(values[k]), len(values[k])] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    return {k: float(total / max(count, 1.0)) for k, (total, count) in zip(keys, sums.tolist())}


def rl_engine_config(cfg, lr: float | None = None):
    """The config a trainable RL role builds its TrainEngine from: the LR schedule spans
    every optimizer step of the run (``train.max_steps`` RL steps x ``ppo_epochs`` x
    ``ppo_mini_batches``), and `lr` (e.g. ``rl.critic.lr``) replaces the optimizer's."""
    a = cfg.rl.actor
    train = cfg.train.model_copy(update={"max_steps": cfg.train.max_steps * a.ppo_epochs * a.ppo_mini_batches})
    if lr is not None:
        train = train.model_copy(update={"optimizer": train.optimizer.model_copy(update={"lr": lr})})
    return cfg.model_copy(update={"train": train})


class PassShape:
    """How a role's passes lay out and group their rows (``rl.packing``, the token
    budgets): `layout` is the `shardwise.engine.packing` layout each forward uses, and
    `groups` the row indices of each micro-batch of a pass."""

    def __init__(self, cfg, model, budget: int | None, key: str, sp_group=None):
        is_vl = vision.vl_config(model) is not None
        # unset: packed, except a VL model's rows and a model whose layers would mix packed documents
        packed = cfg.rl.packing if cfg.rl.packing is not None else not is_vl and families.packs(model.config)
        if is_vl and (packed or budget is not None):  # (`shardwise rl` refuses both before launch)
            raise ConfigError("rl.packing" if packed else key, "a vision-language model's rows run padded, "
                              "by rows (3-D positions, one image per row)", "leave it unset")
        self.layout = "packed" if packed else ("compact" if budget is not None else "padded")
        # Ulysses: packed rows split over the sequence-parallel group (`compute_log_probs`)
        self.sp_group = sp_group
        if sp_group is not None and self.layout != "packed":
            raise ConfigError("rl.packing", "Ulysses sequence parallel in RL runs packed rows",
                              "leave rl.packing unset (or true), or set parallel.ulysses_size=1")
        self.budget = budget
        self.key = key
        self.micro_batch_size = cfg.train.micro_batch_size

    def groups(self, attention_mask: torch.Tensor) -> list[list[int]]:
        """Row indices of each micro-batch over rows with this `attention_mask` ``(B, T)``."""
        lengths = attention_mask.sum(-1).tolist()
        return packing.micro_batch_rows(lengths, self.micro_batch_size, self.budget, self.layout == "packed",
                                        self.key)

    def dummy_len(self, attention_mask: torch.Tensor) -> int:
        """Tokens of a throw-away pass's row: this rank's longest real row (the batch's
        width in the padded layout)."""
        if self.layout == "padded" or not attention_mask.shape[0]:
            return attention_mask.shape[1]
        return int(attention_mask.sum(-1).max())


def forward_shape(cfg, model, sp_group=None) -> PassShape:
    """The forward-only passes' shape: their token budget is
    ``rl.log_prob_max_tokens_per_micro_batch``, else the update's."""
    if cfg.rl.log_prob_max_tokens_per_micro_batch is not None:
        return PassShape(cfg, model, cfg.rl.log_prob_max_tokens_per_micro_batch,
                         "rl.log_prob_max_tokens_per_micro_batch", sp_group)
    return update_shape(cfg, model, sp_group)


def update_shape(cfg, model, sp_group=None) -> PassShape:
    """The update passes' shape (actor and critic): ``rl.actor.max_tokens_per_micro_batch``."""
    return PassShape(cfg, model, cfg.rl.actor.max_tokens_per_micro_batch, "rl.actor.max_tokens_per_micro_batch",
                     sp_group)
