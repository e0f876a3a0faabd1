"""RL post-training maths as pure functions on tensors.

Conventions, unless a docstring says otherwise:

- per-token tensors are ``(batch, response_len)``, one row per sequence, aligned with the
  response tokens;
- ``mask`` is ``(batch, response_len)``, bool or 0/1 float; nonzero marks a response
  token that counts. Positions where it is 0 are never read as numbers: they may hold
  anything, even NaN or inf, without changing any result or gradient;
- ``group_ids`` is a sequence (list, numpy array, tensor) of ``batch`` hashable ids; rows
  with equal ids are samples for the same prompt;
- log-probabilities are natural-log, per token; rewards are in the reward model's units;
- advantage estimators run without autograd and return float32.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from shardwise.errors import nearest
from shardwise.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "OFF_POLICY_CORRECTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "aggregate_loss",
    "apply_kl_in_reward",
    "kl_controller",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "mask_counts",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "off_policy_token_loss",
    "off_policy_weights",
    "policy_loss",
    "ppo_token_loss",
    "reinforce_plus_plus_advantages",
    "resolve_agg_mode",
    "resolve_kl_kind",
    "rloo_advantages",
    "value_loss",
    "zero_variance_groups",
]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

KLKind = Literal["k1", "k2", "k3"]
# Every accepted spelling -> the estimator it names.
KL_KINDS: dict[str, KLKind] = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
}

_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def _unknown(what: str, value: str, valid: Sequence[str]) -> ValueError:
    near = nearest(value, valid, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}{hint}")


def resolve_kl_kind(kind: str) -> KLKind:
    """The estimator ("k1", "k2", "k3") named by `kind` or one of its aliases.

    "kl" is k1, "mse" is k2, "low_var_kl" is k3. ValueError listing the valid kinds and
    the nearest one otherwise.
    """
    try:
        return KL_KINDS[kind]
    except (KeyError, TypeError):
        raise _unknown("KL kind", str(kind), list(KL_KINDS)) from None


def resolve_agg_mode(mode: str) -> AggMode:
    """`mode` checked against `AGG_MODES`; ValueError with the nearest valid mode otherwise."""
    if mode not in AGG_MODES:
        raise _unknown("loss aggregation mode", str(mode), AGG_MODES)
    return mode  # type: ignore[return-value]


# ------------------------------------------------------------------- masked statistics


def _bool_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    m = mask.bool() if mask.dtype != torch.bool else mask
    if m.shape != like.shape:
        m = m.expand_as(like)
    return m


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is nonzero.

    `x`: any shape; `mask`: same shape (or broadcastable to it). `dim`: None for the mean
    over everything (0-d result) or a dimension to reduce. Where no position counts the
    result is 0 (not NaN), so empty micro-batches do not poison a sum. dtype of `x`.
    """
    m = _bool_mask(mask, x)
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        num, count = total.sum(), m.sum()
    else:
        num, count = total.sum(dim), m.sum(dim)
    count = count.to(x.dtype)
    return num / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all positions where `mask` is nonzero; 0-d, dtype of `x`.

    `unbiased` divides by ``n - 1`` (Bessel), else by ``n``. With fewer than 2 counted
    positions (``unbiased``) or none, the result is 0 rather than NaN.
    """
    m = _bool_mask(mask, x)
    mean = masked_mean(x, m)
    centered = torch.where(m, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    n = m.sum().to(x.dtype)
    denom = n - 1 if unbiased else n
    return centered.square().sum() / torch.where(denom > 0, denom, torch.ones_like(denom))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over the mask.

    `shift_mean=False` adds the mean back (scale only). Positions where `mask` is 0 are 0
    in the result. Same shape and dtype as `x`.
    """
    m = _bool_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def mask_counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_tokens, num_seqs)`` of a ``(batch, response_len)`` mask, as 0-d int64 tensors.

    ``num_seqs`` counts rows with at least one nonzero entry: the sequences that the seq-*
    modes of `aggregate_loss` average over. Sum these over micro-batches (and all-reduce
    over ranks) to get ``global_tokens`` / ``global_seqs``.
    """
    m = mask.bool()
    return m.sum(), m.any(dim=-1).sum()


# ------------------------------------------------------------------- advantages


def _check_2d(name: str, x: torch.Tensor, shape: torch.Size | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be (batch, response_len), got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but the rewards have {tuple(shape)}")


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    `token_rewards`, `values`, `mask`: ``(batch, response_len)``; `gamma` discount per
    token, `lam` the GAE lambda, both in [0, 1].

    Reverse scan over time with ``next_value`` and ``running_adv`` starting at 0::

        delta_t = r_t + gamma * next_value - v_t
        adv_t   = delta_t + gamma * lam * running_adv

    At a masked position (mask 0, e.g. tool output inside a multi-turn response) the
    scan carries ``next_value`` and ``running_adv`` through unchanged, so rewards and
    values there influence nothing. Returns ``(advantages, returns)``, float32
    ``(batch, response_len)``: ``returns = raw advantages + values`` and ``advantages``
    whitened over the mask (mean 0, unbiased variance, eps 1e-8); both are 0 where the
    mask is 0.
    """
    _check_2d("token_rewards", token_rewards)
    _check_2d("values", values, token_rewards.shape)
    _check_2d("mask", mask, token_rewards.shape)
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=token_rewards.device)
    r = torch.where(m, token_rewards.float(), zero)
    v = torch.where(m, values.float(), zero)
    batch, steps = r.shape
    next_value = torch.zeros(batch, dtype=torch.float32, device=r.device)
    running_adv = torch.zeros_like(next_value)
    raw = torch.zeros_like(r)
    for t in reversed(range(steps)):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * running_adv
        next_value = torch.where(mt, v[:, t], next_value)
        running_adv = torch.where(mt, adv_t, running_adv)
        raw[:, t] = running_adv
    returns = torch.where(m, raw + v, zero)
    return masked_whiten(raw, m), returns


def _group_index(group_ids: Sequence[Hashable] | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """Row -> dense group number (0, 1, ... in order of first appearance), int64 ``(batch,)``."""
    ids = group_ids.tolist() if hasattr(group_ids, "tolist") else list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch} rows")
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(g, len(numbers)) for g in ids], dtype=torch.int64, device=device)


def _scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d("token_rewards", token_rewards)
    _check_2d("mask", mask, token_rewards.shape)
    m = mask.bool()
    score = torch.where(m, token_rewards.float(), torch.zeros((), device=m.device)).sum(-1)
    return score, m


def _group_stats(score: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(group size, group sum of scores)``, both float32 ``(batch,)``."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    counts = torch.zeros(n_groups, dtype=torch.float32, device=score.device).index_add_(0, group, torch.ones_like(score))
    sums = torch.zeros(n_groups, dtype=torch.float32, device=score.device).index_add_(0, group, score)
    return counts[group], sums[group]


@torch.no_grad()
def zero_variance_groups(scores: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """Bool ``(batch,)``: True on the rows of a group whose `scores` (float ``(batch,)``,
    one per sequence) are all exactly equal. Such a group has advantage 0 on every row
    under grpo / rloo, so DAPO's dynamic sampling leaves it out of the update
    (``rl.filter_groups: zero_variance``). A group of one row is always True."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be (batch,), got shape {tuple(scores.shape)}")
    group = _group_index(group_ids, scores.shape[0], scores.device)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    s = scores.float()
    high = torch.full((n_groups,), -math.inf, device=s.device).scatter_reduce(0, group, s, "amax")
    low = torch.full((n_groups,), math.inf, device=s.device).scatter_reduce(0, group, s, "amin")
    return (high == low)[group]


@torch.no_grad()
def grpo_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """GRPO outcome advantages, float32 ``(batch, response_len)``, 0 where mask is 0.

    ``score`` = sum over tokens of ``token_rewards * mask``; within each group
    ``advantage = (score - group mean) / (group std + eps)`` with the unbiased std
    (``n - 1``). A group of one row has mean 0 and std 1, so its advantage is
    ``score / (1 + eps)``. `norm_by_std=False` gives ``score - group mean`` (Dr. GRPO).
    The row's advantage is repeated on each of its response tokens.
    """
    score, m = _scores(token_rewards, mask)
    group = _group_index(group_ids, score.shape[0], score.device)
    count, total = _group_stats(score, group)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(total), total / count)
    adv = score - mean
    if norm_by_std:
        n_groups = int(group.max()) + 1 if group.numel() else 0
        sq = torch.zeros(n_groups, dtype=torch.float32, device=score.device).index_add_(0, group, (score - total / count) ** 2)
        std = torch.sqrt(sq[group] / (count - 1).clamp(min=1))
        std = torch.where(single, torch.ones_like(std), std)
        adv = adv / (std + eps)
    return torch.where(m, adv[:, None], torch.zeros((), device=m.device))


@torch.no_grad()
def rloo_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
) -> torch.Tensor:
    """REINFORCE leave-one-out advantages, float32 ``(batch, response_len)``.

    ``advantage = score - mean of the scores of the other rows in the group``, with
    ``score`` the masked token sum. A group of one has no other rows: its baseline is 0
    and its advantage is its score. Broadcast over the mask, 0 where the mask is 0.
    """
    score, m = _scores(token_rewards, mask)
    group = _group_index(group_ids, score.shape[0], score.device)
    count, total = _group_stats(score, group)
    baseline = torch.where(count > 1, (total - score) / (count - 1).clamp(min=1), torch.zeros_like(score))
    return torch.where(m, (score - baseline)[:, None], torch.zeros((), device=m.device))


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++ advantages: whitened discounted return-to-go, float32 ``(batch, response_len)``.

    Reverse scan ``G_t = r_t + gamma * G_{t+1}`` over the masked tokens; masked positions
    carry ``G`` through unchanged (their rewards are ignored and they do not discount).
    The returns are then whitened over the mask (mean 0, unbiased variance, eps 1e-8);
    0 where the mask is 0.
    """
    _check_2d("token_rewards", token_rewards)
    _check_2d("mask", mask, token_rewards.shape)
    m = mask.bool()
    r = torch.where(m, token_rewards.float(), torch.zeros((), device=m.device))
    running = torch.zeros(r.shape[0], dtype=torch.float32, device=r.device)
    returns = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, m)


# ------------------------------------------------------------------- the registry of ``rl.advantage``
# Each takes (token_rewards, mask, *, values, group_ids, gamma, lam) and returns
# (advantages, returns), both (batch, response_len) float32. Traits: needs_critic (reads
# `values`), compares_samples (needs several samples per prompt: rl.rollout.n >= 2).


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True, compares_samples=False)
def _gae(token_rewards, mask, *, values, group_ids, gamma, lam):
    return gae_advantages(token_rewards, values, mask, gamma, lam)


@ADVANTAGE_ESTIMATORS.register("grpo", needs_critic=False, compares_samples=True)
def _grpo(token_rewards, mask, *, values, group_ids, gamma, lam):
    adv = grpo_advantages(token_rewards, mask, group_ids)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("rloo", needs_critic=False, compares_samples=True)
def _rloo(token_rewards, mask, *, values, group_ids, gamma, lam):
    adv = rloo_advantages(token_rewards, mask, group_ids)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus", needs_critic=False, compares_samples=False)
def _reinforce_plus_plus(token_rewards, mask, *, values, group_ids, gamma, lam):
    adv = reinforce_plus_plus_advantages(token_rewards, mask, gamma)
    return adv, adv


# ------------------------------------------------------------------- KL


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    `logp`, `ref_logp`: same shape, natural-log probabilities of the sampled tokens under
    the policy and the reference. `kind` (see `resolve_kl_kind`):

    - "k1" / "kl": ``logp - ref_logp`` (unbiased, high variance, can be negative);
    - "k2" / "mse": ``0.5 * (logp - ref_logp)^2``;
    - "k3" / "low_var_kl": ``exp(d) - d - 1`` with ``d = ref_logp - logp`` clamped to
      [-20, 20] and the result clamped to [-10, 10] (so extreme tokens cannot blow up).

    Same shape and dtype as the inputs; differentiable.
    """
    k = resolve_kl_kind(kind)
    if k == "k1":
        return logp - ref_logp
    if k == "k2":
        return 0.5 * (logp - ref_logp).square()
    d = torch.clamp(ref_logp - logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(d) - d - 1, -_K3_CLAMP, _K3_CLAMP)


class KLController(abc.ABC):
    """Coefficient of the KL term in the reward: read `value`, call `update` each step."""

    value: float

    @abc.abstractmethod
    def update(self, current_kl: float, n_steps: int) -> None:
        """Feed the KL measured this step (nats/token) and the number of samples it covers."""


class FixedKLController(KLController):
    """A constant coefficient; `update` does nothing."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController(KLController):
    """Proportional controller steering the measured KL towards `target` (Ziegler et al. 2019).

    On each `update`: ``error = clip(current_kl / target - 1, -0.2, 0.2)`` and
    ``value *= 1 + error * n_steps / horizon``. `target` in nats/token; `horizon` in
    samples (the number of samples over which a full error is corrected).
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(kind: str, coef: float, target: float, horizon: float) -> KLController:
    """The controller ``rl.kl_in_reward.controller`` names: "fixed" or "adaptive"."""
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    if kind == "fixed":
        return FixedKLController(coef)
    raise _unknown("KL controller", kind, ("fixed", "adaptive"))


@torch.no_grad()
def apply_kl_in_reward(
    token_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, float]:
    """Subtract the KL penalty from per-token rewards.

    `token_scores`, `logp`, `ref_logp`, `mask`: ``(batch, response_len)``. Returns
    ``(token_rewards, mean_kl)``: ``token_scores - coef * kl`` where the mask is nonzero
    and ``token_scores`` unchanged elsewhere (dtype of `token_scores`); ``mean_kl`` is a
    Python float in nats/token, the mean over sequences of each sequence's token-mean KL
    (sequences with no masked token excluded), the value to feed a `KLController`.
    """
    m = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl = torch.where(m, kl_penalty(torch.where(m, logp, zero), torch.where(m, ref_logp, zero), kind), zero)
    rewards = torch.where(m, token_scores - coef * kl.to(token_scores.dtype), token_scores)
    mean_kl = aggregate_loss(kl.float(), m, "seq-mean-token-mean")
    return rewards, float(mean_kl)


# ------------------------------------------------------------------- losses


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a ``(batch, response_len)`` per-token loss to a 0-d loss.

    - "token-mean": ``sum(loss * mask) / num_tokens``;
    - "seq-mean-token-sum": ``sum over seqs of (sum over tokens) / num_seqs``;
    - "seq-mean-token-mean": ``sum over seqs of (token mean of the seq) / num_seqs``.

    ``num_tokens`` is the number of nonzero mask entries and ``num_seqs`` the number of
    rows with at least one (see `mask_counts`), counted locally unless `global_tokens`
    (token-mean) / `global_seqs` (seq modes) gives the count for the whole batch: then
    the results of micro-batches sum to the whole-batch result. The global count the
    mode does not use is ignored. dtype of `loss_mat`; differentiable.
    """
    mode = resolve_agg_mode(mode)
    m = _bool_mask(mask, loss_mat)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    masked = torch.where(m, loss_mat, zero)
    if mode == "token-mean":
        if global_tokens is None:
            count = m.sum().to(loss_mat.dtype)
            return masked.sum() / torch.where(count > 0, count, torch.ones_like(count))
        _check_count("global_tokens", global_tokens)
        return masked.sum() / global_tokens
    if mode == "seq-mean-token-sum":
        per_seq = masked.sum(-1)
    else:
        per_seq = masked_mean(loss_mat, m, dim=-1)
    if global_seqs is None:
        count = m.any(-1).sum().to(loss_mat.dtype)
        return per_seq.sum() / torch.where(count > 0, count, torch.ones_like(count))
    _check_count("global_seqs", global_seqs)
    return per_seq.sum() / global_seqs


def _check_count(name: str, value: int | float | torch.Tensor) -> None:
    # A tensor is not inspected: reading it would force a device sync.
    if not isinstance(value, torch.Tensor) and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive count, got {value}")


def policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    mode: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip; all inputs ``(batch, response_len)``.

    `token_weights` (no gradient) multiply each token's term before the reduction: the
    truncated importance-sampling weights ``min(pi_old / pi_rollout, cap)`` of
    `tis_weights` (``rl.rollout.tis_cap``).

    The per-token terms are `ppo_token_loss`'s, reduced with
    `aggregate_loss(mode, global_tokens, global_seqs)`. Returns ``(loss, metrics)``: 0-d
    loss (differentiable w.r.t. `logp`) and `ppo_token_loss`'s metrics.
    """
    m = _bool_mask(mask, logp)
    per_token, metrics = ppo_token_loss(old_logp, logp, advantages, m, clip_low=clip_low, clip_high=clip_high,
                                        clip_c=clip_c, token_weights=token_weights)
    loss = aggregate_loss(per_token, m, mode, global_tokens=global_tokens, global_seqs=global_seqs)
    return loss, metrics


def ppo_token_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    token_weights: torch.Tensor | None = None,
    ratio_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token terms of the PPO clipped surrogate with dual clip, ``(batch,
    response_len)``, 0 where `mask` is 0 (`policy_loss` reduces them).

    ``ratio = exp(clamp(logp - old_logp, -20, 20))``, then ``min(ratio, ratio_cap)`` when
    `ratio_cap` is given (truncated importance sampling: above the cap the token's ratio,
    and so its gradient, stops); ``pg1 = -A * ratio``;
    ``pg2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)``; per token
    ``max(pg1, pg2)``, and where ``A < 0`` at most ``-A * clip_c`` (dual clip, which
    bounds the loss of a very off-policy token with negative advantage); times
    `token_weights` (detached) when given.

    Returns ``(per_token, metrics)``: the terms (differentiable w.r.t. `logp`) and Python
    floats over the masked tokens: "clipfrac" (share with ``pg2 > pg1``),
    "clipfrac_lower" (share where the dual clip bound is active), "approx_kl" (mean of
    ``old_logp - logp``, the k1 estimate of KL(old || new) in nats/token) and
    "ratio_mean".
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 for the dual clip, got {clip_c}")
    m = _bool_mask(mask, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(m, logp - old_logp, zero)
    adv = torch.where(m, advantages.to(logp.dtype), zero)
    ratio = torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    if ratio_cap is not None:
        ratio = torch.clamp(ratio, max=ratio_cap)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    bound = -adv * clip_c
    dual = torch.minimum(clipped, bound)
    per_token = torch.where(adv < 0, dual, clipped)
    if token_weights is not None:
        per_token = per_token * torch.where(m, token_weights.detach().to(per_token.dtype), zero)
    with torch.no_grad():
        metrics = {
            "clipfrac": float(masked_mean((pg2 > pg1).float(), m)),
            "clipfrac_lower": float(masked_mean(((adv < 0) & (bound < clipped)).float(), m)),
            "approx_kl": float(masked_mean(-log_ratio.float(), m)),
            "ratio_mean": float(masked_mean(ratio.float(), m)),
        }
    return per_token, metrics


POLICY_LOSSES.register("ppo_clip")(policy_loss)


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(old_logp - rollout_logp), cap)`` per
    token (1 outside `mask`): the rollout engine sampled from its own numbers of the policy
    (another kernel, another precision); reweighting each token by the actor's probability
    over the engine's corrects the policy gradient for it, truncated at `cap` to bound its
    variance."""
    m = _bool_mask(mask, old_logp)
    log_ratio = torch.where(m, old_logp - rollout_logp, torch.zeros((), dtype=old_logp.dtype, device=old_logp.device))
    return torch.clamp(torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)), max=cap)


OFF_POLICY_CORRECTIONS: tuple[str, ...] = ("none", "tis", "decoupled")


def off_policy_token_loss(
    correction: str,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    behave_logp: torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
    cap: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token policy loss of an update on samples that an older policy generated
    (``rl.actor.off_policy``), ``(batch, response_len)``, 0 where `mask` is 0; all inputs
    ``(batch, response_len)``. `logp`: the policy being trained (with gradient);
    `behave_logp`: the behaviour policy, the one that sampled the tokens
    (``rollout_log_probs``); `prox_logp`: the policy at the start of the update
    (``old_log_probs``, recomputed by the actor).

    - "none": PPO against `prox_logp` (`ppo_token_loss`), the samples taken as on-policy;
    - "tis": PPO against the behaviour policy, each token's ratio truncated at `cap`
      before the clip: ``r = min(exp(logp - behave_logp), cap)``; `prox_logp` unused;
    - "decoupled" (AReaL's decoupled PPO): PPO against the proximal policy, ratio
      ``exp(logp - prox_logp)`` clipped, times ``w = min(exp(prox_logp - behave_logp), cap)``
      (no gradient through w).

    The clip, the dual clip and the metrics are `ppo_token_loss`'s (for tis the ratio and
    "approx_kl" are against the behaviour policy). Reduce the result with `aggregate_loss`;
    `off_policy_weights` gives the importance-weight metrics.
    """
    if correction not in OFF_POLICY_CORRECTIONS:
        raise _unknown("off-policy correction", str(correction), OFF_POLICY_CORRECTIONS)
    if correction != "none" and behave_logp is None:
        raise ValueError(f"off-policy correction {correction!r} needs the behaviour log-probs (behave_logp)")
    if correction != "tis" and prox_logp is None:
        raise ValueError(f"off-policy correction {correction!r} needs the proximal log-probs (prox_logp)")
    ppo = {"clip_low": clip_low, "clip_high": clip_high, "clip_c": clip_c}
    if correction == "none":
        return ppo_token_loss(prox_logp, logp, advantages, mask, **ppo)
    if correction == "tis":
        return ppo_token_loss(behave_logp, logp, advantages, mask, ratio_cap=cap, **ppo)
    return ppo_token_loss(prox_logp, logp, advantages, mask, token_weights=tis_weights(prox_logp, behave_logp, mask, cap),
                          **ppo)


@torch.no_grad()
def off_policy_weights(
    start_logp: torch.Tensor,
    behave_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    global_tokens: int | float | torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """How far the samples are from the policy at the start of the update, over the
    `mask`ed tokens: ``off_policy/is_weight_mean``, the token mean of the untruncated
    importance weight ``exp(start_logp - behave_logp)`` (`start_logp`: tis, the policy's
    log-probs at the start of the update; decoupled, the proximal ones), and
    ``off_policy/truncated_share``, the share of tokens whose weight exceeds `cap`. 0-d
    float32 tensors; token means over `global_tokens` when given (then the values of
    micro-batches add up to the whole batch's, as `aggregate_loss`)."""
    m = _bool_mask(mask, start_logp)
    diff = torch.where(m, (start_logp - behave_logp).float(), 0.0)
    weight = torch.exp(torch.clamp(diff, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    over = (weight > cap).float()
    return {"off_policy/is_weight_mean": aggregate_loss(weight, m, "token-mean", global_tokens),
            "off_policy/truncated_share": aggregate_loss(over, m, "token-mean", global_tokens)}


def rollout_mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the actor's
    (``old_log_probs``, recomputed by FSDP) over the `mask`ed tokens: mean and max of the
    absolute difference, and mean and max of the importance ratio
    ``exp(old_logp - rollout_logp)``. All 0 / 1 for an engine that samples with the actor's
    own numbers, up to the rounding of a batched recomputation."""
    m = _bool_mask(mask, old_logp)
    if not bool(m.any()):
        return {}
    diff, ratio = (x[m] for x in mismatch_terms(old_logp, rollout_logp, m))
    return {"rollout/log_prob_diff_abs_mean": float(diff.mean()),
            "rollout/log_prob_diff_abs_max": float(diff.max()),
            "rollout/importance_ratio_mean": float(ratio.mean()),
            "rollout/importance_ratio_max": float(ratio.max())}


def mismatch_terms(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, fp32 and 0 outside `mask`: ``|old_logp - rollout_logp|`` and the importance
    ratio ``exp(old_logp - rollout_logp)`` (`rollout_mismatch` reduces them)."""
    m = _bool_mask(mask, old_logp)
    diff = torch.where(m, (old_logp - rollout_logp).float(), 0.0)
    ratio = torch.where(m, torch.exp(torch.clamp(diff, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)), 0.0)
    return diff.abs(), ratio


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.5,
    mode: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss; inputs ``(batch, response_len)`` in reward units.

    ``v_clip = clamp(values, old_values - clip, old_values + clip)``; per token
    ``max((values - returns)^2, (v_clip - returns)^2)``; loss = ``0.5 *`` its
    `aggregate_loss`. Returns ``(loss, {"vf_clipfrac": share of masked tokens where the
    value left ``old_values +- clip`` and the clipped term is the larger})``; the loss is differentiable w.r.t. `values`.
    """
    m = _bool_mask(mask, values)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)
    r = torch.where(m, returns.to(values.dtype), zero)
    old = torch.where(m, old_values.to(values.dtype), zero)
    v_clip = old + torch.clamp(v - old, -clip, clip)
    l1 = (v - r).square()
    l2 = (v_clip - r).square()
    loss = 0.5 * aggregate_loss(torch.maximum(l1, l2), m, mode, global_tokens=global_tokens, global_seqs=global_seqs)
    with torch.no_grad():
        # A token is clipped when its value left the trust region and the clipped term won;
        # comparing l2 > l1 alone would count unclipped tokens whose old + (v - old) rounds
        # differently from v.
        clipped = ((v - old).abs() > clip) & (l2 > l1)
        metrics = {"vf_clipfrac": float(masked_mean(clipped.float(), m))}
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the softmax over the last dimension.

    `logits`: ``(batch, seq, vocab)``, finite. Returns ``(batch, seq)``, computed as
    ``logsumexp(z) - sum(softmax(z) * z)`` (z shifted by its max) in at least float32 (bf16/fp16 logits are
    upcast, which holds one float32 copy of the logits). Differentiable.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # entropy is shift-invariant; centring on the max keeps both terms small, so their
    # difference does not lose the digits that float32 spends on a logit of 1000
    z = z - z.amax(dim=-1, keepdim=True).detach()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
