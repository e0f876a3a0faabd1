"""Moving the FSDP actor's weights into the rollout's generation engine.

`WeightSync.sync` hands the actor's full tensors, streamed under their HF names
(`shardwise.fsdp.gather.iter_full_tensors`, tied aliases once; gathered in buckets of
`bucket_bytes`, one all-gather each: a small model's push is one collective), to the engine before each generation when the engine keeps its own copy of
the weights; with `HFGenerator`, which generates with the actor's parameters, it does
nothing. A LoRA actor's weights go merged (base + adapters), unless the engine takes
adapters (`GenerationEngine.takes_adapters`: vLLM with ``lora_sync: adapter``): then the
base goes once, unmerged, and every later push is the adapters alone
(`GenerationEngine.sync_adapter`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch import nn

from shardwise.engine.generate import GenerationEngine
from shardwise.fsdp.gather import iter_adapter_tensors, iter_full_tensors

__all__ = ["WeightSync", "bucket_bytes"]


def bucket_bytes(sampling_cfg) -> int:
    """The push's gather bucket in bytes (``vllm.sync_bucket_mb``; 0 without that section)."""
    vllm = getattr(sampling_cfg, "vllm", None)
    return int(getattr(vllm, "sync_bucket_mb", 0) * 2**20)


class WeightSync:
    """Keeps a rollout engine's weights equal to the actor's."""

    def __init__(self, actor_model: nn.Module, engine: GenerationEngine, dtype: torch.dtype | None = None,
                 bucket_bytes: int = 0):
        self.actor_model = actor_model
        self.engine = engine
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.syncs = 0
        self.changed = True  # the engine starts without the actor's weights
        self.seconds = 0.0
        self.bytes = 0
        self.base_pushed = False
        """Adapter mode: the engine holds the actor's base weights."""

    def actor_changed(self) -> None:
        """The actor's weights moved (an update, a checkpoint load): push before the next
        generation."""
        self.changed = True

    def sync(self) -> bool:
        """Push the actor's current weights into the engine; False when the engine shares
        the actor's parameters and nothing had to move. Collective."""
        if self.engine.shares_model_parameters:
            return False
        start = time.perf_counter()
        self.bytes = 0
        if self.engine.takes_adapters:
            if not self.base_pushed:  # the frozen base, once
                self.engine.sync_weights(self._counted(iter_full_tensors(self.actor_model, self.dtype,
                                                                         merge_lora=False,
                                                                         bucket_bytes=self.bucket_bytes)))
                self.base_pushed = True
            self.engine.sync_adapter(self._counted(iter_adapter_tensors(self.actor_model)))
        else:
            self.engine.sync_weights(self._counted(iter_full_tensors(self.actor_model, self.dtype,
                                                                     bucket_bytes=self.bucket_bytes)))
        self.seconds = time.perf_counter() - start
        self.syncs += 1
        self.changed = False
        return True

    def _counted(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The same pairs, adding each tensor's bytes to `bytes` as the engine takes it."""
        for name, tensor in named_tensors:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def sync_if_changed(self) -> bool:
        """`sync` when the actor changed since the last push; True when it pushed."""
        return self.sync() if self.changed else False

    def last_metrics(self) -> dict[str, float]:
        """``time/weight_sync`` (seconds, gathering the full tensors included) and
        ``weight_sync/bytes`` (what this rank handed to its engine) of the last push."""
        return {"time/weight_sync": self.seconds, "weight_sync/bytes": float(self.bytes)}
