"""Updates on samples the policy being trained did not generate: the rollout engine's own
numbers of the policy (truncated importance sampling, ``rl.rollout.tis_cap``), or an older
policy under asynchronous RL (``rl.actor.off_policy``: tis, AReaL's decoupled PPO), and the
metrics that say how far the samples are from the policy."""

from __future__ import annotations

import torch

from shardwise.rl.algorithms._common import LOG_RATIO_CLAMP, bool_mask, unknown_name
from shardwise.rl.algorithms.aggregation import aggregate_loss
from shardwise.rl.algorithms.policy_losses import ppo_token_loss

__all__ = ["OFF_POLICY_CORRECTIONS", "mismatch_terms", "off_policy_token_loss", "off_policy_weights",
           "rollout_mismatch", "tis_weights"]


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(old_logp - rollout_logp), cap)`` per
    token (1 outside `mask`): the rollout engine sampled from its own numbers of the policy
    (another kernel, another precision); reweighting each token by the actor's probability
    over the engine's corrects the policy gradient for it, truncated at `cap` to bound its
    variance."""
    m = bool_mask(mask, old_logp)
    log_ratio = torch.where(m, old_logp - rollout_logp, torch.zeros((), dtype=old_logp.dtype, device=old_logp.device))
    return torch.clamp(torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), max=cap)


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
        raise unknown_name("off-policy correction", str(correction), OFF_POLICY_CORRECTIONS)
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
    m = bool_mask(mask, start_logp)
    diff = torch.where(m, (start_logp - behave_logp).float(), 0.0)
    weight = torch.exp(torch.clamp(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    over = (weight > cap).float()
    return {"off_policy/is_weight_mean": aggregate_loss(weight, m, "token-mean", global_tokens),
            "off_policy/truncated_share": aggregate_loss(over, m, "token-mean", global_tokens)}


def rollout_mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the actor's
    (``old_log_probs``, recomputed by FSDP) over the `mask`ed tokens: mean and max of the
    absolute difference, and mean and max of the importance ratio
    ``exp(old_logp - rollout_logp)``. All 0 / 1 for an engine that samples with the actor's
    own numbers, up to the rounding of a batched recomputation."""
    m = bool_mask(mask, old_logp)
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
    m = bool_mask(mask, old_logp)
    diff = torch.where(m, (old_logp - rollout_logp).float(), 0.0)
    ratio = torch.where(m, torch.exp(torch.clamp(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 0.0)
    return diff.abs(), ratio


