"""KL between the policy and the reference (per-token estimators, the controllers of
``rl.kl_in_reward``, the penalty folded into the rewards) and the entropy of the policy."""

from __future__ import annotations

import abc
from typing import Literal

import torch

from shardwise.rl.algorithms._common import K3_CLAMP, LOG_RATIO_CLAMP, unknown_name
from shardwise.rl.algorithms.aggregation import aggregate_loss

__all__ = ["KL_KINDS", "AdaptiveKLController", "FixedKLController", "KLController", "apply_kl_in_reward",
           "entropy_from_logits", "kl_controller", "kl_penalty", "resolve_kl_kind"]

KLKind = Literal["k1", "k2", "k3"]
KL_KINDS: dict[str, KLKind] = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
}

def resolve_kl_kind(kind: str) -> KLKind:
    """The estimator ("k1", "k2", "k3") named by `kind` or one of its aliases.

    "kl" is k1, "mse" is k2, "low_var_kl" is k3. ValueError listing the valid kinds and
    the nearest one otherwise.
    """
    try:
        return KL_KINDS[kind]
    except (KeyError, TypeError):
        raise unknown_name("KL kind", str(kind), list(KL_KINDS)) from None




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
    d = torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(d) - d - 1, -K3_CLAMP, K3_CLAMP)


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
    raise unknown_name("KL controller", kind, ("fixed", "adaptive"))


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
