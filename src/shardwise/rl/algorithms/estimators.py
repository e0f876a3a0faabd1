"""Advantage estimators, each registered under verl's name (``rl.advantage``).

Two forms of each:

- verl's, what `get_adv_estimator_fn(name)` returns: keyword arguments as verl 0.9.1
  names them (``token_level_rewards``, ``response_mask``, ``index`` (group ids),
  ``values``, ``reward_baselines``, ``epsilon``, ``norm_adv_by_std_in_grpo``, ``gamma``,
  ``lam``, ``config``: a mapping or an object read like verl's ``AlgoConfig``), returning
  ``(advantages, returns)``, float32 ``(batch, response_len)``;
- shardwise's, what ``shardwise.registry.ADVANTAGE_ESTIMATORS`` holds and the trainer
  calls: ``fn(token_rewards, mask, *, values, group_ids, gamma, lam, **options)`` with
  options ``norm_adv_by_std``, ``reward_baselines``, ``epsilon``.

Registration traits the config checks read: ``needs_critic`` (reads ``values``),
``compares_samples`` (several samples per prompt: rl.rollout.n >= 2), ``needs_baseline``
(REMAX: the reward of a greedy answer per prompt). Positions where the mask is 0 are never
read and are 0 in the results (verl leaves numbers there that nothing reads).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from shardwise.registry import ADVANTAGE_ESTIMATORS
from shardwise.rl.algorithms._common import check_2d, masked_whiten, option

__all__ = ["VERL_ESTIMATORS", "call_estimator", "gae_advantages", "get_adv_estimator_fn", "grpo_advantages",
           "reinforce_plus_plus_advantages", "rloo_advantages", "zero_variance_groups"]

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
    check_2d("token_rewards", token_rewards)
    check_2d("values", values, token_rewards.shape)
    check_2d("mask", mask, token_rewards.shape)
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
    check_2d("token_rewards", token_rewards)
    check_2d("mask", mask, token_rewards.shape)
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
    check_2d("token_rewards", token_rewards)
    check_2d("mask", mask, token_rewards.shape)
    return masked_whiten(_discounted_returns(token_rewards, mask, gamma), mask.bool())


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reverse scan ``G_t = r_t + gamma * G_{t+1}`` over the masked tokens; masked positions
    carry ``G`` through unchanged (no reward, no discount) and are 0 in the result."""
    m = mask.bool()
    r = torch.where(m, token_rewards.float(), torch.zeros((), device=m.device))
    running = torch.zeros(r.shape[0], dtype=torch.float32, device=r.device)
    returns = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, 0.0)
    return returns


# ------------------------------------------------------------------- registration

VERL_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
"""Name -> the estimator in verl's form (built-in ones; `get_adv_estimator_fn` also
finds those a user registered in ADVANTAGE_ESTIMATORS)."""


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of `kwargs` that `fn` takes (all of them when it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def call_estimator(fn: Callable[..., Any], token_rewards: torch.Tensor, mask: torch.Tensor, *,
                   values: torch.Tensor | None, group_ids: Sequence[Hashable], gamma: float, lam: float,
                   **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn` (an ADVANTAGE_ESTIMATORS entry) called with the options it takes."""
    kwargs = {"values": values, "group_ids": group_ids, "gamma": gamma, "lam": lam, **options}
    return fn(token_rewards, mask, **_accepted(fn, kwargs))


def verl_form_adapter(fn: Callable[..., Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """shardwise's form of an estimator written in verl's (built-in or a user's)."""
    def estimate(token_rewards, mask, *, values, group_ids, gamma, lam, norm_adv_by_std=True, reward_baselines=None,
                 epsilon=1e-6):
        config = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std}
        kwargs = {"token_level_rewards": token_rewards, "response_mask": mask, "values": values,
                  "index": np.asarray(list(group_ids), dtype=object), "gamma": gamma, "lam": lam,
                  "epsilon": epsilon, "norm_adv_by_std_in_grpo": norm_adv_by_std,
                  "reward_baselines": reward_baselines, "config": config}
        return fn(**_accepted(fn, kwargs))
    estimate.verl_form = fn  # type: ignore[attr-defined]
    return estimate


def _estimator(*names: str, needs_critic: bool = False, compares_samples: bool = False,
               needs_baseline: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            VERL_ESTIMATORS[name] = fn
            ADVANTAGE_ESTIMATORS.register(name, needs_critic=needs_critic, compares_samples=compares_samples,
                                          needs_baseline=needs_baseline)(verl_form_adapter(fn))
        return fn
    return add


def get_adv_estimator_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The estimator `name` in verl's form (ConfigError with the nearest name otherwise)."""
    fn = ADVANTAGE_ESTIMATORS.get(name)
    return VERL_ESTIMATORS.get(name) or getattr(fn, "verl_form", fn)


def _index_of(index: Any, batch: int, device: torch.device) -> torch.Tensor:
    return _group_index(index if index is not None else range(batch), batch, device)


def _group_lists(group: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each group, in order of first appearance."""
    return [torch.nonzero(group == g).flatten() for g in range(int(group.max()) + 1 if group.numel() else 0)]


def _norm_option(config: Any, given: bool) -> bool:
    return bool(option(config, "norm_adv_by_std_in_grpo", given)) if config is not None else given


# ------------------------------------------------------------------- verl's estimators


@_estimator("gae", needs_critic=True)
def gae(token_level_rewards, values, response_mask, gamma=None, lam=None, config=None, **kwargs):
    """GAE (Schulman et al. 2016): `gae_advantages`; `gamma` / `lam` from the arguments or
    `config`."""
    gamma = option(config, "gamma", 1.0) if gamma is None else gamma
    lam = option(config, "lam", 1.0) if lam is None else lam
    return gae_advantages(token_level_rewards, values, response_mask, gamma, lam)


@_estimator("grpo", "grpo_vectorized", compares_samples=True)
def grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, config=None,
         **kwargs):
    """GRPO (Shao et al. 2024): `grpo_advantages`; ``norm_adv_by_std_in_grpo=False`` is
    Dr. GRPO's (Liu et al. 2025, arXiv 2503.20783) unscaled ``score - group mean``."""
    adv = grpo_advantages(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo)
    return adv, adv


@_estimator("grpo_passk", compares_samples=True)
def grpo_passk(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, config=None,
               **kwargs):
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595): in each group only the best
    sample gets an advantage, ``best - second best`` (over the group's std + epsilon when
    ``norm_adv_by_std_in_grpo``, read from `config` when given); a group of one is a
    ValueError (it has no second best)."""
    norm = _norm_option(config, norm_adv_by_std_in_grpo)
    score, m = _scores(token_level_rewards, response_mask)
    adv = torch.zeros_like(score)
    for rows in _group_lists(_index_of(index, score.shape[0], score.device)):
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; row {int(rows[0])} is alone")
        top = torch.topk(score[rows], 2)
        gap = top.values[0] - top.values[1]
        adv[rows[top.indices[0]]] = gap / (score[rows].std() + epsilon) if norm else gap
    return _broadcast(adv, m)


@_estimator("rloo", compares_samples=True)
def rloo(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): `rloo_advantages` (a group of one
    keeps its score)."""
    adv = rloo_advantages(token_level_rewards, response_mask, index)
    return adv, adv


@_estimator("rloo_vectorized", compares_samples=True)
def rloo_vectorized(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """RLOO as verl's vectorised form: the same, except that a group of one gets 0."""
    score, m = _scores(token_level_rewards, response_mask)
    count, _ = _group_stats(score, _index_of(index, score.shape[0], score.device))
    adv = rloo_advantages(token_level_rewards, response_mask, index)
    adv = torch.where((count > 1)[:, None], adv, torch.zeros((), device=adv.device))
    return adv, adv


def _group_mean_baseline(score: torch.Tensor, group: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the (weighted) mean score of its group; 0 for a group of one."""
    w = torch.ones_like(score) if weights is None else weights.float()
    count, _ = _group_stats(score, group)
    _, wsum = _group_stats(w, group)
    _, wscore = _group_stats(w * score, group)
    return torch.where(count > 1, wscore / torch.where(wsum != 0, wsum, torch.ones_like(wsum)), torch.zeros_like(score))


def _broadcast(per_row: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.where(m, per_row[:, None], torch.zeros((), device=m.device))
    return adv, adv


@_estimator("reinforce_plus_plus_baseline", compares_samples=True)
def reinforce_plus_plus_baseline(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """REINFORCE++ with a baseline (Hu 2025, arXiv 2501.03262): ``score - group mean``
    (0 for a group of one) on every token, whitened over the whole batch's mask."""
    score, m = _scores(token_level_rewards, response_mask)
    group = _index_of(index, score.shape[0], score.device)
    adv = masked_whiten(_broadcast(score - _group_mean_baseline(score, group), m)[0], m)
    return adv, adv


@_estimator("opo", compares_samples=True)
def opo(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """OPO (Hao et al. 2025, arXiv 2505.23585): the optimal baseline of on-policy RL,
    ``score - sum(len x score) / sum(len)`` over the group (len: response tokens); 0
    baseline for a group of one."""
    score, m = _scores(token_level_rewards, response_mask)
    group = _index_of(index, score.shape[0], score.device)
    return _broadcast(score - _group_mean_baseline(score, group, m.sum(-1)), m)


@_estimator("reinforce_plus_plus")
def reinforce_plus_plus(token_level_rewards, response_mask, config=None, gamma=None, **kwargs):
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): the discounted return-to-go (`gamma` from
    the argument or `config`), whitened over the mask; returns the raw returns."""
    gamma = option(config, "gamma", 1.0) if gamma is None else gamma
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask.bool()), returns


@_estimator("remax", needs_baseline=True)
def remax(token_level_rewards, reward_baselines, response_mask, config=None, **kwargs):
    """ReMax (Li et al. 2023, arXiv 2310.10505): the undiscounted return-to-go minus
    `reward_baselines` ``(batch,)``, the reward of the greedy answer to the same prompt
    (generated by the trainer); returns the return-to-go."""
    returns = _discounted_returns(token_level_rewards, response_mask, 1.0)
    m = response_mask.bool()
    adv = torch.where(m, returns - reward_baselines.float()[:, None], torch.zeros((), device=m.device))
    return adv, returns


@_estimator("gpg", compares_samples=True)
def gpg(token_level_rewards, response_mask, index, epsilon=1e-6, f_norm=1.0, alpha=1.0, config=None, **kwargs):
    """GPG (Chu et al. 2025, arXiv 2504.02546): ``alpha * (score - group mean) / f_norm``
    with ``alpha = batch / (rows with a nonzero score)``, which rescales the gradient for
    the groups whose advantages are all 0 (as verl, the `alpha` argument is unused)."""
    score, m = _scores(token_level_rewards, response_mask)
    group = _index_of(index, score.shape[0], score.device)
    scale = score.shape[0] / max(int(torch.count_nonzero(score)), 1)
    return _broadcast(scale * (score - _group_mean_baseline(score, group)) / f_norm, m)

