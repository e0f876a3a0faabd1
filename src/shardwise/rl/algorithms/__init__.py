"""RL post-training maths as pure functions on tensors, by concern:

- `estimators`: advantage estimators (``rl.advantage``), verl's names and forms;
- `policy_losses`: policy losses (``rl.actor.policy_loss``) and the critic's value loss;
- `aggregation`: ``loss_agg_mode``, `agg_loss`;
- `kl`: KL estimators and controllers, entropy;
- `off_policy`: corrections for samples another policy (or engine) generated.

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

verl's API: `get_policy_loss_fn(name)`, `get_adv_estimator_fn(name)`, `agg_loss(...)`.
"""

from shardwise.rl.algorithms._common import mask_counts, masked_mean, masked_var, masked_whiten
from shardwise.rl.algorithms.aggregation import AGG_MODES, agg_loss, aggregate_loss, resolve_agg_mode
from shardwise.rl.algorithms.estimators import (
    VERL_ESTIMATORS,
    call_estimator,
    gae_advantages,
    get_adv_estimator_fn,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    zero_variance_groups,
)
from shardwise.rl.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_in_reward,
    entropy_from_logits,
    kl_controller,
    kl_penalty,
    resolve_kl_kind,
)
from shardwise.rl.algorithms.off_policy import (
    OFF_POLICY_CORRECTIONS,
    mismatch_terms,
    off_policy_token_loss,
    off_policy_weights,
    rollout_mismatch,
    tis_weights,
)
from shardwise.rl.algorithms.policy_losses import (
    PG_METRICS,
    get_policy_loss_fn,
    policy_loss,
    ppo_token_loss,
    value_loss,
)

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "OFF_POLICY_CORRECTIONS",
    "PG_METRICS",
    "VERL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "aggregate_loss",
    "apply_kl_in_reward",
    "call_estimator",
    "entropy_from_logits",
    "gae_advantages",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "grpo_advantages",
    "kl_controller",
    "kl_penalty",
    "mask_counts",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "mismatch_terms",
    "off_policy_token_loss",
    "off_policy_weights",
    "policy_loss",
    "ppo_token_loss",
    "reinforce_plus_plus_advantages",
    "resolve_agg_mode",
    "resolve_kl_kind",
    "rloo_advantages",
    "rollout_mismatch",
    "tis_weights",
    "value_loss",
    "zero_variance_groups",
]
