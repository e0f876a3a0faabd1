"""Preference losses: DPO and its variants (``train.objective: dpo``) and the Bradley-Terry
loss of a reward model (``train.objective: reward_model``), on batches of
`shardwise.data.pairs.collate_pairs` (P pairs as 2P rows: chosen, then rejected).

Sequence log-probs are summed over each answer's trained tokens, as TRL does
(`sequence_log_probs`); ipo and simpo use them averaged per token, orpo its log-odds
of the averages (TRL's conventions). With ``pi`` the policy's and ``ref`` the reference's
summed log-probs, ``beta`` = train.dpo.beta, ``ls`` = label_smoothing and ``h`` the
log-ratio margin ``(pi_c - ref_c) - (pi_r - ref_r)``, the per-pair losses are (`dpo_losses`):

- sigmoid: ``-(1 - ls) logsigmoid(beta h) - ls logsigmoid(-beta h)``; ln 2 when the
  policy is the reference;
- ipo: ``(h' - 1 / (2 beta))^2`` with h' the margin of length-averaged log-probs;
- hinge: ``relu(1 - beta h)``;
- simpo (no reference): with a_c, a_r the averaged log-probs,
  ``-(1 - ls) logsigmoid(beta (a_c - a_r) - gamma) - ls logsigmoid(-(...))``;
- orpo (no reference): ``-a_c - beta logsigmoid(log_odds)``,
  ``log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))``: the chosen
  answer's mean token NLL plus the odds-ratio term (the NLL per pair, so the loss of a
  batch is the mean of its pairs' and a sharded batch gives the unsharded loss).

Implicit rewards: ``beta (pi - ref)`` (simpo, orpo: ``beta a``). The reward model's loss
(`reward_model_losses`): ``-logsigmoid(r_c - r_r - margin)`` + ``center_coef x (r_c + r_r)^2``
(TRL's ``center_rewards_coefficient``, its mean over pairs).

Every loss function returns the SUM of its pairs' losses (the engine divides by the pairs
of the global batch) and records metric sums (`PairMetrics`), all-reduced at the step's end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.config.schema import DPOConfig
from shardwise.data.collate import IGNORE_INDEX
from shardwise.engine.infer import compute_log_probs

__all__ = ["REFERENCE_FREE", "DPOLoss", "PairMetrics", "RewardModelLoss", "dpo_losses", "reward_model_losses",
           "sequence_log_probs", "sequence_scores"]

REFERENCE_FREE: tuple[str, ...] = ("simpo", "orpo")
"""Loss types that need no reference model."""

Batch = dict[str, torch.Tensor]


def sequence_log_probs(model: nn.Module, batch: Batch, chunk_tokens: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs of each row's trained tokens ``(rows,)`` fp32, differentiable;
    their counts ``(rows,)`` fp32): one forward of `model` on ``input_ids`` /
    ``attention_mask`` / ``position_ids``, the trained tokens those whose ``labels`` are
    not -100."""
    out = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch.get("position_ids"),
                            chunk_tokens=chunk_tokens)["log_probs"]
    mask = (batch["labels"] != IGNORE_INDEX).float()
    return (out * mask).sum(-1), mask.sum(-1)


def dpo_losses(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor | None, ref_r: torch.Tensor | None,
               n_c: torch.Tensor, n_r: torch.Tensor, cfg: DPOConfig
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards), each ``(P,)``, of the module
    docstring's formulas. `pi_*` / `ref_*`: summed log-probs ``(P,)``; `n_*`: token counts;
    ref None for the reference-free types."""
    beta, ls, kind = cfg.beta, cfg.label_smoothing, cfg.loss_type
    if kind in REFERENCE_FREE:
        a_c, a_r = pi_c / n_c, pi_r / n_r
        if kind == "simpo":
            z = beta * (a_c - a_r) - cfg.gamma
            losses = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
        else:
            log_odds = (a_c - a_r) - (torch.log1p(-torch.exp(a_c)) - torch.log1p(-torch.exp(a_r)))
            losses = -a_c - beta * F.logsigmoid(log_odds)
        return losses, beta * a_c.detach(), beta * a_r.detach()
    assert ref_c is not None and ref_r is not None, f"loss_type {kind} needs the reference's log-probs"
    if kind == "ipo":
        h = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        h = (pi_c - ref_c) - (pi_r - ref_r)
        if kind == "sigmoid":
            losses = -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)
        elif kind == "hinge":
            losses = torch.relu(1 - beta * h)
        else:
            raise ValueError(f"unknown loss_type {kind!r}")
    return losses, beta * (pi_c - ref_c).detach(), beta * (pi_r - ref_r).detach()


def reward_model_losses(r_c: torch.Tensor, r_r: torch.Tensor, margin: torch.Tensor | None = None,
                        center_coef: float | None = None) -> torch.Tensor:
    """Per-pair Bradley-Terry losses ``(P,)`` (module docstring)."""
    diff = r_c - r_r if margin is None else r_c - r_r - margin
    losses = -F.logsigmoid(diff)
    if center_coef:
        losses = losses + center_coef * (r_c + r_r) ** 2
    return losses


class PairMetrics:
    """Sums of per-pair metrics over this rank's micro-batches of a step; `take` sums them
    over all ranks and divides by the pairs (collective)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.pairs = 0.0

    def add(self, values: dict[str, torch.Tensor], weight: torch.Tensor | None = None) -> None:
        """`values`: per-pair ``(P,)`` tensors; `weight` ``(P,)`` (padding pairs 0) or None."""
        for k, v in values.items():
            v = v.detach().double()
            v = (v * weight.double()).sum() if weight is not None else v.sum()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        n = next(iter(values.values())).numel() if weight is None else weight.double().sum()
        self.pairs = self.pairs + n

    def take(self, device: torch.device, keys: list[str]) -> dict[str, float]:
        """The mean of each of `keys` over every rank's pairs since the last `take`
        (a rank with none adds zeros; every rank passes the same keys)."""
        vals = torch.stack([self.sums.get(k, torch.zeros((), dtype=torch.float64)).to(device) for k in keys]
                           + [torch.as_tensor(self.pairs, dtype=torch.float64).to(device)])
        if dist.is_initialized():
            dist.all_reduce(vals)
        self.sums, self.pairs = {}, 0.0
        n = max(float(vals[-1]), 1.0)
        return {k: float(v) / n for k, v in zip(keys, vals[:-1].tolist())}


class DPOLoss:
    """The DPO loss function of the engine (``loss_fn(model, batch) -> sum over pairs``),
    the reference's log-probs read from the batch's ``ref_logps`` ``(P, 2)`` (chosen,
    rejected); metrics recorded in `metrics`."""

    KEYS = ["dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "logps/chosen", "logps/rejected"]

    def __init__(self, cfg: DPOConfig, chunk_tokens: int | None = None):
        self.cfg, self.chunk_tokens = cfg, chunk_tokens
        self.metrics = PairMetrics()

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logps, counts = sequence_log_probs(model, batch, self.chunk_tokens)
        p = logps.shape[0] // 2
        ref = batch.get("ref_logps")
        ref_c, ref_r = (None, None) if ref is None else (ref[:, 0].to(logps), ref[:, 1].to(logps))
        losses, r_c, r_r = dpo_losses(logps[:p], logps[p:], ref_c, ref_r, counts[:p], counts[p:], self.cfg)
        self.metrics.add({"dpo/loss": losses, "rewards/chosen": r_c, "rewards/rejected": r_r,
                          "rewards/margins": r_c - r_r, "rewards/accuracies": (r_c > r_r).float(),
                          "logps/chosen": logps[:p], "logps/rejected": logps[p:]}, batch.get("pair_weight"))
        return _weighted_sum(losses, batch)


def _weighted_sum(losses: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The sum of the per-pair `losses`, padding pairs (``pair_weight`` 0) left out."""
    w = batch.get("pair_weight")
    return losses.sum() if w is None else (losses * w.to(losses)).sum()


def sequence_scores(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A one-label sequence classifier's score at each row's last real token ``(rows,)``
    fp32, differentiable: the per-token output of its ``score`` head read by a forward hook
    (HF's own pooling takes the rightmost non-pad id, wrong when pad == eos), as
    `shardwise.rl.workers.reward.RewardModelWorker` reads it."""
    head = getattr(model, "score", None)
    assert isinstance(head, nn.Module), f"{type(model).__name__} has no score head"
    seen: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              position_ids=batch.get("position_ids"), use_cache=False)
    finally:
        handle.remove()
    assert len(seen) == 1, f"the score head ran {len(seen)} times in one forward"
    mask = batch["attention_mask"]
    last = mask.shape[1] - 1 - mask.bool().flip(-1).int().argmax(-1)
    return seen[0][..., 0].float().gather(1, last[:, None])[:, 0]


class RewardModelLoss:
    """The Bradley-Terry loss function of the engine on a sequence classifier (one label);
    metrics ``rm/loss``, ``rm/accuracy`` (r_c > r_r), ``rm/margin`` (r_c - r_r),
    ``rm/chosen``, ``rm/rejected``."""

    KEYS = ["rm/loss", "rm/accuracy", "rm/margin", "rm/chosen", "rm/rejected"]

    def __init__(self, center_coef: float | None = None):
        self.center_coef = center_coef
        self.metrics = PairMetrics()

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        scores = sequence_scores(model, batch)
        p = scores.shape[0] // 2
        r_c, r_r = scores[:p], scores[p:]
        losses = reward_model_losses(r_c, r_r, batch.get("margin"), self.center_coef)
        self.metrics.add({"rm/loss": losses, "rm/accuracy": (r_c > r_r).float(), "rm/margin": r_c - r_r,
                          "rm/chosen": r_c, "rm/rejected": r_r}, batch.get("pair_weight"))
        return _weighted_sum(losses, batch)


@torch.no_grad()
def reference_log_probs(model: nn.Module, batch: Batch, chunk_tokens: int | None = None,
                        context: Callable[[], contextlib.AbstractContextManager] | None = None) -> torch.Tensor:
    """The reference's summed log-probs of a collated pair batch, ``(P, 2)`` fp32 (chosen,
    rejected): `model` in eval mode (restored after), under `context` (e.g. LoRA adapters
    off) when given."""
    was = model.training
    model.eval()
    try:
        with context() if context is not None else contextlib.nullcontext():
            logps, _ = sequence_log_probs(model, batch, chunk_tokens)
    finally:
        model.train(was)
    p = logps.shape[0] // 2
    return torch.stack([logps[:p], logps[p:]], dim=1).float()
