"""The HF engine's key/value cache written in place (`PreallocatedLayer`,
`preallocated_cache`): what `shardwise.engine.generate.HFGenerator` decodes with instead of
HF's concatenating `DynamicCache` layers, when every layer of the model is a plain one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["PreallocatedLayer", "preallocated_cache"]


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in a buffer written in place: ``keys`` /
    ``values`` are views of the filled part and hold what the concatenating layer would.
    The buffer doubles when full, up to `capacity` positions (the call's most), so it holds
    at most twice what the concatenating layer would (never more than `capacity`) and is
    copied about log2(capacity / prompt) times instead of at every step; past `capacity` it
    grows to fit."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def start(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Begin with `keys` / `values` ``(B, heads, n, dim)`` in the cache (kept rows)."""
        self.lazy_initialization(keys, values)
        self._k = self._v = None
        self.update(keys, values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = 0 if self._k is None else self.keys.shape[-2]
        end = n + key_states.shape[-2]
        if self._k is None or self._v is None or end > self._k.shape[-2]:
            size = max(end, min(self.capacity, 2 * end))
            k = key_states.new_empty((*key_states.shape[:-2], size, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:-2], size, value_states.shape[-1]))
            if n:
                k[..., :n, :] = self.keys
                v[..., :n, :] = self.values
            self._k, self._v = k, v
        self._k[..., n:end, :] = key_states
        self._v[..., n:end, :] = value_states
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is None or self._v is None:
            return
        end = self.keys.shape[-2]
        k = self._k.new_empty((len(indices), *self._k.shape[1:]))  # the same room left
        v = self._v.new_empty((len(indices), *self._v.shape[1:]))
        k[..., :end, :] = self.keys[indices]  # the filled part only
        v[..., :end, :] = self.values[indices]
        self._k, self._v = k, v
        self.keys, self.values = k[..., :end, :], v[..., :end, :]

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()


def preallocated_cache(model: nn.Module, capacity: int) -> DynamicCache | None:
    """The model's `DynamicCache` (layer types from its config) with every layer a
    `PreallocatedLayer` of `capacity` positions; None when a layer is of another kind
    (sliding window, linear attention, ...) or the model has no config to build one from:
    the model then makes its own cache."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    try:
        cache = DynamicCache(config=config)
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache
