"""What the algorithm modules share: masked statistics, the log-ratio clamp, the error for
an unknown name, and reading verl-style options from a config object or a plain mapping."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardwise.errors import nearest

__all__ = ["mask_counts", "masked_mean", "masked_sum", "masked_var", "masked_whiten", "option"]

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def unknown_name(what: str, value: str, valid: Sequence[str]) -> ValueError:
    near = nearest(value, valid, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}{hint}")


# ------------------------------------------------------------------- masked statistics


def bool_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
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
    m = bool_mask(mask, x)
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
    m = bool_mask(mask, x)
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
    m = bool_mask(mask, x)
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


def check_2d(name: str, x: torch.Tensor, shape: torch.Size | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be (batch, response_len), got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but the rewards have {tuple(shape)}")




def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over positions where `mask` is nonzero (others never read); dtype of `x`."""
    m = bool_mask(mask, x)
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return total.sum() if dim is None else total.sum(dim)


_MISSING = object()


def option(config: Any, name: str, default: Any = _MISSING) -> Any:
    """The option `name` of `config`: a mapping's key or an object's attribute (verl's
    ``ActorConfig``, a dataclass, a dict). A dotted name reads nested sections
    (``policy_loss.clip_cov_ratio``). A missing or None value is `default`; without one,
    ValueError naming the option."""
    value = config
    for part in name.split("."):
        if value is None:
            break
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"the config lacks the option {name!r}")
        return default
    return value
