"""A user's own policy loss or advantage estimator, ``module:function`` with verl's
signature: imported (the working directory and PYTHONPATH on the import path, as reward
functions) where it runs, each worker at start-up, and once before launch by
`check_user_functions` so a missing module or name is one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.data.rewards import import_attribute
from shardwise.errors import ConfigError
from shardwise.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from shardwise.rl.algorithms.estimators import verl_form_adapter

__all__ = ["UserFunctionError", "check_user_functions", "checked_loss_output", "resolve_estimator",
           "resolve_policy_loss"]

_LOSS_SIGNATURE = "(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)"
_ESTIMATOR_SIGNATURE = "(token_level_rewards, response_mask, index, **kwargs) -> (advantages, returns)"


class UserFunctionError(ConfigError):
    """A user's loss or estimator raised or returned the wrong thing (exit status 2)."""


def _load(spec: str, key: str, signature: str) -> Callable[..., Any]:
    module, _, attr = spec.partition(":")
    fn = import_attribute(module, attr, key, signature)
    if not callable(fn):
        raise ConfigError(key, f"{spec} is a {type(fn).__name__}, not a function", f"point it at a function {signature}")
    return fn  # type: ignore[return-value]


def resolve_policy_loss(spec: str) -> Callable[..., Any]:
    """The loss `spec` names: a registered name or a user's ``module:function``."""
    return _load(spec, "rl.actor.policy_loss", _LOSS_SIGNATURE) if ":" in spec else POLICY_LOSSES.get(spec)


def resolve_estimator(spec: str) -> Callable[..., Any]:
    """The estimator `spec` names, in shardwise's form (a user's is adapted from verl's)."""
    if ":" in spec:
        return verl_form_adapter(_load(spec, "rl.advantage", _ESTIMATOR_SIGNATURE))
    return ADVANTAGE_ESTIMATORS.get(spec)


def check_user_functions(cfg: Any) -> None:
    """Import the user's loss and estimator, if any, before anything starts."""
    resolve_policy_loss(cfg.rl.actor.policy_loss)
    resolve_estimator(cfg.rl.advantage)


def checked_loss_output(spec: str, out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """`out` when it is ``(0-d tensor, dict)``; a UserFunctionError naming `spec` otherwise."""
    ok = (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and out[0].dim() == 0
          and isinstance(out[1], dict))
    if not ok:
        shape = tuple(out[0].shape) if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) else None
        raise UserFunctionError("rl.actor.policy_loss", f"{spec} returned {type(out).__name__}"
                                + (f" with a loss of shape {shape}" if shape is not None else "")
                                + ", not (0-d loss tensor, metrics dict)", "return (loss, metrics) as verl's losses do")
    return out
