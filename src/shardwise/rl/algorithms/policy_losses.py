"""Policy losses, each registered under verl's name (``rl.actor.policy_loss``).

Every registered loss has verl's signature::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, rollout_is_weights=None) -> (loss, metrics)

All tensors ``(batch, response_len)``; positions where `response_mask` is 0 are never
read. `config` is verl's ``ActorConfig`` or a plain mapping with its option names
(`option`): ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``,
``tau_pos``, ``tau_neg``, under ``policy_loss``: ``clip_cov_ratio``, ``clip_cov_lb``,
``clip_cov_ub``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``dro_beta``; and
``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``: `agg_loss`'s counts, so micro-batches add up to their global
batch). `rollout_is_weights` (no gradient) multiply each token's term before the
reduction. `loss` is 0-d and differentiable w.r.t. `log_prob`; `metrics` maps verl's
keys (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``) to floats.
`tests/test_rl_algorithms_verl.py` checks each against verl 0.9.1's function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.registry import POLICY_LOSSES
from shardwise.rl.algorithms._common import LOG_RATIO_CLAMP, bool_mask, masked_mean, option
from shardwise.rl.algorithms.aggregation import agg_loss, aggregate_loss

__all__ = ["get_policy_loss_fn", "policy_loss", "ppo_token_loss", "value_loss"]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
PG_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
"""The metric keys of verl's losses; a loss that does not measure one leaves it out."""


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
    m = bool_mask(mask, logp)
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
    ``old_logp - logp`` clamped to [-20, 20], the k1 estimate of KL(old || new) in nats/token) and
    "ratio_mean".
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 for the dual clip, got {clip_c}")
    m = bool_mask(mask, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.clamp(torch.where(m, logp - old_logp, zero), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = torch.where(m, advantages.to(logp.dtype), zero)
    ratio = torch.exp(log_ratio)
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



def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as `name` (verl's names; ConfigError with the nearest)."""
    return POLICY_LOSSES.get(name)


def _clean(mask: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`xs` with 0 where `mask` is 0 (those positions may hold anything, NaN included)."""
    zero = torch.zeros((), dtype=xs[0].dtype, device=xs[0].device)
    return tuple(torch.where(mask, x, zero) for x in xs)


def _clips(config: Any) -> tuple[float, float]:
    """(low, high): ``clip_ratio_low`` / ``clip_ratio_high``, each ``clip_ratio`` when unset."""
    both = option(config, "clip_ratio", 0.2)
    return option(config, "clip_ratio_low", both), option(config, "clip_ratio_high", both)


def _reduce(pg: torch.Tensor, m: torch.Tensor, mode: str, config: Any, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is not None:
        pg = pg * torch.where(m, weights.detach().to(pg.dtype), torch.zeros((), dtype=pg.dtype, device=pg.device))
    return agg_loss(pg, m, mode, **(option(config, "global_batch_info", None) or {}))


def _mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(masked_mean(x.detach().float(), m))


def _pg_metrics(clipfrac: float, ppo_kl: float, lower: float) -> dict[str, float]:
    return dict(zip(PG_METRICS, (clipfrac, ppo_kl, lower)))


@POLICY_LOSSES.register("vanilla")
@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    """PPO's clipped surrogate with clip-higher and dual clip (Schulman et al. 2017; Ye et
    al. 2019; DAPO 2025): `ppo_token_loss` with ``clip_ratio_low / high / c``."""
    low, high = _clips(config)
    m = bool_mask(response_mask, log_prob)
    per_token, met = ppo_token_loss(old_log_prob, log_prob, advantages, m, clip_low=low, clip_high=high,
                                    clip_c=option(config, "clip_ratio_c", 3.0))
    loss = _reduce(per_token, m, loss_agg_mode, config, rollout_is_weights)
    return loss, _pg_metrics(met["clipfrac"], met["approx_kl"], met["clipfrac_lower"])


def _dppo(mask_fn):
    """DPPO (arXiv 2602.04879): REINFORCE on ``log_prob`` weighted by the truncated ratio
    ``min(ratio, clip_ratio_c)`` (detached), each token dropped when its probability moved
    beyond the divergence threshold in the direction its advantage pushes (``clip_ratio_low``
    / ``clip_ratio_high`` are the thresholds). metrics: pg_clipfrac = dropped share,
    pg_clipfrac_lower = share of kept tokens whose ratio was truncated."""
    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        m = bool_mask(response_mask, log_prob)
        old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
        low, high = _clips(config)
        log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        cap = option(config, "clip_ratio_c", 20.0)
        keep = mask_fn(logp.detach(), old, adv, low, high).to(logp.dtype)
        pg = -adv * torch.clamp(ratio, max=cap).detach() * logp * keep
        loss = _reduce(pg, m, loss_agg_mode, config, rollout_is_weights)
        return loss, _pg_metrics(_mean(1.0 - keep, m), _mean(-log_ratio, m), _mean((ratio > cap) * keep, m))
    return loss_fn


def _tv_keep(logp, old, adv, low, high):
    moved = torch.exp(logp) - torch.exp(old)
    return torch.where(adv > 0, moved <= high, moved >= -low)


def _binary_kl_keep(logp, old, adv, low, high):
    p, q = torch.exp(logp), torch.exp(old)
    kl = q * (old - logp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    return torch.where(adv > 0, (kl <= high) | (p <= q), (kl <= low) | (p >= q))


POLICY_LOSSES.register("dppo_tv")(_dppo(_tv_keep))
POLICY_LOSSES.register("dppo_kl")(_dppo(_binary_kl_keep))


@POLICY_LOSSES.register("gspo")
def gspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None,
              rollout_is_weights=None):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence, the
    geometric mean of its token ratios, ``exp(mean_t log_ratio)`` (detached, at most
    exp(10)), carried to each token as ``s * p / sg(p)`` so each token's gradient is its
    own; clipped at ``1 -+ clip_ratio_low / high`` (GSPO's paper: 3e-4 / 4e-4)."""
    m = bool_mask(response_mask, log_prob)
    old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
    low, high = _clips(config)
    log_ratio = logp - old
    seq = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)
    ratio = torch.exp(torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=10.0))
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    loss = _reduce(torch.maximum(pg1, pg2), m, loss_agg_mode, config, rollout_is_weights)
    return loss, _pg_metrics(_mean(pg2 > pg1, m), _mean(-log_ratio, m), 0.0)


@POLICY_LOSSES.register("sapo")
def sapo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None,
              rollout_is_weights=None):
    """SAPO (arXiv 2511.20347): a soft gate instead of the clip, per token
    ``-A * (4 / tau) * sigmoid(tau * (ratio - 1))`` with ``tau_pos`` where A > 0, else
    ``tau_neg``; always reduced seq-mean-token-mean (as verl: `loss_agg_mode` unused)."""
    m = bool_mask(response_mask, log_prob)
    old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tau = torch.where(adv > 0, torch.as_tensor(option(config, "tau_pos", 1.0), dtype=adv.dtype),
                      torch.as_tensor(option(config, "tau_neg", 1.05), dtype=adv.dtype))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss = _reduce(-gate * adv, m, "seq-mean-token-mean", config, rollout_is_weights)
    return loss, _pg_metrics(0.0, _mean(-log_ratio, m), 0.0)


@POLICY_LOSSES.register("gpg")
def gpg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
    """GPG (Chu et al. 2025, arXiv 2504.02546): plain REINFORCE, ``-A * log_prob``; no ratio,
    no clip, no metrics."""
    m = bool_mask(response_mask, log_prob)
    logp, adv = _clean(m, log_prob, advantages.to(log_prob.dtype))
    return _reduce(-logp * adv, m, loss_agg_mode, config, rollout_is_weights), {}


@POLICY_LOSSES.register("cispo")
def cispo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
               rollout_is_weights=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the clipped importance
    ratio, ``-sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob``: no token's gradient is
    dropped, only its weight bounded. pg_clipfrac: share of tokens whose ratio was clipped."""
    m = bool_mask(response_mask, log_prob)
    old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
    low, high = _clips(config)
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    loss = _reduce(-clipped.detach() * adv * logp, m, loss_agg_mode, config, rollout_is_weights)
    return loss, _pg_metrics(_mean(ratio != clipped, m), _mean(-log_ratio, m), 0.0)


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO's clip (no dual clip), and the
    gradient of ``max(1, int(clip_cov_ratio x tokens))`` tokens, drawn at random (torch's
    global generator) among the unclipped ones whose covariance
    ``(A - mean A)(log_prob - mean log_prob)`` lies in (clip_cov_lb, clip_cov_ub), cut.
    pg_clipfrac: share of tokens cut."""
    m = bool_mask(response_mask, log_prob)
    old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
    low, high = _clips(config)
    ratio_k = option(config, "policy_loss.clip_cov_ratio", 0.0002)
    lb, ub = option(config, "policy_loss.clip_cov_lb", 1.0), option(config, "policy_loss.clip_cov_ub", 5.0)
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    with torch.no_grad():
        cov = (adv - masked_mean(adv, m)) * (logp - masked_mean(logp, m))
        candidates = torch.nonzero(m & ~(pg2 > pg1) & (cov > lb) & (cov < ub))
        n_cut = max(int(ratio_k * int(m.sum())), 1)
        if len(candidates):
            candidates = candidates[torch.randperm(len(candidates))[:n_cut]]
        keep = torch.ones_like(adv)
        keep[candidates[:, 0], candidates[:, 1]] = 0
    loss = _reduce(torch.maximum(pg1, pg2) * keep, m, loss_agg_mode, config, rollout_is_weights)
    return loss, {"actor/pg_clipfrac": _mean(keep == 0, m), "actor/ppo_kl": _mean(-log_ratio, m)}


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped surrogate ``-A * ratio``,
    plus ``ppo_kl_coef * |log_ratio|`` on the ``max(1, int(kl_cov_ratio x tokens))``
    tokens of largest covariance ``(A - mean A)(log_prob - mean log_prob)``. metrics:
    actor/ppo_kl is the mean |log_ratio| (as verl)."""
    m = bool_mask(response_mask, log_prob)
    old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
    coef = option(config, "policy_loss.ppo_kl_coef", 1.0)
    ratio_k = option(config, "policy_loss.kl_cov_ratio", 0.0002)
    log_ratio = logp - old
    pg = -adv * torch.exp(log_ratio)
    with torch.no_grad():
        penalised = torch.zeros_like(m)
        a, lp = adv[m], logp[m]
        if a.numel():
            cov = (a - a.mean()) * (lp - lp.mean())
            top = torch.topk(cov, max(1, int(a.numel() * ratio_k))).indices
            flat = penalised[m]
            flat[top] = True
            penalised[m] = flat
    pg = torch.where(penalised, pg + coef * log_ratio.abs(), pg)
    loss = _reduce(pg, m, loss_agg_mode, config, rollout_is_weights)
    return loss, {"actor/ppo_kl": _mean(log_ratio.abs(), m)}


@POLICY_LOSSES.register("geo_mean")
def geo_mean_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): per sequence ``-mean_t(A) * exp(mean_t
    clipped log_ratio)``, the log-ratio clipped to [-low, high] on the side its advantage's
    sign pushes; `rollout_is_weights` enter as their per-sequence geometric mean. The loss
    is the mean over the rows (`loss_agg_mode` unused, as verl), or with
    ``global_batch_info``'s ``global_batch_size`` the sum over rows / that x ``dp_size``
    (so micro-batches add up; verl 0.9.1 averages each micro-batch)."""
    m = bool_mask(response_mask, log_prob)
    old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
    low, high = _clips(config)
    log_ratio = logp - old
    bounded = torch.clamp(log_ratio, -low, high)
    sign = torch.sign(adv)
    clipped = sign * torch.minimum(sign * log_ratio, sign * bounded)
    n = m.sum(-1).to(logp.dtype) + 1e-8
    pg = -(adv.sum(-1) / n) * torch.exp(clipped.sum(-1) / n)
    if rollout_is_weights is not None:
        (w,) = _clean(m, torch.log(rollout_is_weights.detach().to(logp.dtype) + 1e-10))
        pg = pg * torch.exp(w.sum(-1) / n)
    info = option(config, "global_batch_info", None) or {}
    if info.get("global_batch_size") is None:
        loss = pg.mean()
    else:
        loss = pg.sum() / info["global_batch_size"] * info.get("dp_size", 1)
    moved = log_ratio != bounded
    return loss, _pg_metrics(_mean(moved & (adv > 0), m), _mean(-log_ratio, m), _mean(moved & (adv < 0), m))


@POLICY_LOSSES.register("dro")
def dro_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
    """DRO (Richemond et al. 2024, arXiv 2405.19107): ``-(A * log_prob - dro_beta / 2 *
    log_ratio^2)``, REINFORCE with a quadratic pull back to the old policy; ``dro_beta``
    (under ``policy_loss``) must be > 0."""
    beta = option(config, "policy_loss.dro_beta", None)
    if beta is None or beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 for the dro loss, got {beta}")
    m = bool_mask(response_mask, log_prob)
    old, logp, adv = _clean(m, old_log_prob, log_prob, advantages.to(log_prob.dtype))
    log_ratio = logp - old
    pg = -(logp * adv - 0.5 * beta * log_ratio.square())
    return _reduce(pg, m, loss_agg_mode, config, rollout_is_weights), {"actor/ppo_kl": _mean(-log_ratio, m)}




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
    m = bool_mask(mask, values)
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


