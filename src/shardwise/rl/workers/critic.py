"""CriticWorker: PPO's value model, a sharded HF backbone with a one-output token head.

The backbone comes from ``model.path`` / ``model.config`` like the actor's; the head is
``AutoModelForTokenClassification`` with ``num_labels=1`` and no dropout, initialised
from ``run.seed`` (a causal-LM folder has no head, so HF initialises it). Values follow
the batch layout of `shardwise.rl.workers`: ``values[:, t]`` is the estimate at the state
before token t, i.e. the head's output at position ``t - 1``, so a mask aligned with
``input_ids`` (``response_mask``) selects the values of the response tokens directly.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.config.schema import Config
from shardwise.data.batch import Batch
from shardwise.distributed import ulysses
from shardwise.distributed.runtime import Runtime
from shardwise.engine import packing
from shardwise.engine.infer import default_position_ids, forward_by_micro_batch
from shardwise.engine.train import TrainEngine
from shardwise.rl.algorithms import value_loss
from shardwise.rl.workers.common import (
    check_mini_batches,
    forward_shape,
    global_counts,
    rl_engine_config,
    update_shape,
)

__all__ = ["VALUE_HEAD", "CriticWorker", "clipped_tokens", "values_from_head"]

VALUE_HEAD: dict[str, object] = {"num_labels": 1, "classifier_dropout": 0.0}
"""HF config fields of the value head: one output per token, no dropout before it (a
dropout there would make the values of one state differ between calls)."""

_INPUT_KEYS = ("input_ids", "attention_mask", "response_mask")


def values_from_head(head: torch.Tensor) -> torch.Tensor:
    """Per-token head outputs ``(batch, seq, 1)`` -> values ``(batch, seq)`` fp32 aligned
    with ``input_ids``: ``values[:, t] = head[:, t - 1]``, ``values[:, 0] = 0``. Not masked."""
    return F.pad(head[..., 0].float()[:, :-1], (1, 0))


def clipped_tokens(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor,
                   clip: float) -> torch.Tensor:
    """How many masked tokens have their value loss set by the clipped term (0-d int64).

    A token counts when the value moved more than `clip` from `old_values` and the
    clipped term ``(v_clip - returns)^2`` is the larger. Comparing the two terms alone
    (as `value_loss`'s "vf_clipfrac" does) also counts unclipped tokens, whose terms
    differ only by the rounding of ``old + (v - old)``.
    """
    m = mask.bool()
    moved = values - old_values
    v_clip = old_values + moved.clamp(-clip, clip)
    larger = (v_clip - returns).square() > (values - returns).square()
    return (m & (moved.abs() > clip) & larger).sum()


def without_lora(cfg: Config) -> Config:
    """`cfg` with ``model.lora`` off: the critic trains in full (its value head is new, and
    the adapters are the policy's)."""
    if not cfg.model.lora.enabled:
        return cfg
    lora = cfg.model.lora.model_copy(update={"enabled": False})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})})


class CriticWorker:
    """The value model on a TrainEngine (optimizer over ``rl.critic.lr``, the LR schedule
    spanning every PPO step of the run, see `rl_engine_config`).

    Methods are collective: every rank calls them with its own rows (numbers may differ
    between ranks, zero included).
    """

    def __init__(self, cfg: Config, runtime: Runtime):
        self.cfg = cfg
        self.runtime = runtime
        # The head is new (not in a causal-LM folder): seed its init so that it does not
        # depend on whatever drew random numbers in this process before.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(cfg.run.seed)
            self.engine = TrainEngine(without_lora(rl_engine_config(cfg, lr=cfg.rl.critic.lr)), runtime,
                                      task="token_classification", **VALUE_HEAD)
        self.forward_shape = forward_shape(cfg, self.engine.model, self.engine.sp_group)
        self.update_shape = update_shape(cfg, self.engine.model, self.engine.sp_group)
        self.replicas = self.engine.spec.ulysses  # sp peers hold the same rows

    # ------------------------------------------------------------------ values

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """Values of this rank's rows: a batch with tensor ``values`` ``(B, T)`` fp32.

        `batch` holds ``input_ids``, ``attention_mask``, ``response_mask`` (and
        ``position_ids``, else `default_position_ids`), ``(B, T)``. ``values[:, t]`` is the
        head's output at position ``t - 1``; exactly 0 at ``t = 0`` and wherever
        ``response_mask`` is 0. Runs ``train.micro_batch_size`` rows per forward, in eval
        mode, on the device of ``input_ids`` on return.
        """
        data = self._inputs(batch)
        t = data.tensors
        self.engine.model.eval()

        shape = self.forward_shape

        def run(ids, mask, pos):
            return {"values": self._values(ids, mask, pos, shape.layout)}

        values = forward_by_micro_batch(run, t["input_ids"], t["attention_mask"], t.get("position_ids"),
                                        None, self.runtime.device, groups=shape.groups(t["attention_mask"]))["values"]
        values = values.masked_fill(~t["response_mask"].bool().to(values.device), 0.0)
        return Batch(tensors={"values": values})

    # ------------------------------------------------------------------ update

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """PPO value updates on this rank's rows; returns metrics of the whole update.

        `batch`: the layout tensors plus ``values`` (the values the advantages were
        computed with, ``(B, T)``) and ``returns`` ``(B, T)``. For each of
        ``rl.actor.ppo_epochs`` passes the rows are cut, in order, into
        ``rl.actor.ppo_mini_batches`` equal mini-batches; mini-batch k of every rank
        together makes one optimizer step, whose loss is `value_loss` (clip
        ``rl.critic.cliprange_value``, mode ``rl.actor.loss_agg_mode``) normalised by the
        token / sequence counts of that global mini-batch, so the step equals the
        unsharded one whatever the world size and the split of rows between ranks.

        Returns means over the optimizer steps of this call (each step's value already
        global): "critic/vf_loss", "critic/vf_clipfrac" (share of response tokens where
        the clipped term is larger), "critic/grad_norm" (before clipping), "critic/lr",
        "critic/values_mean" (the predicted values on response tokens).
        """
        data = self._inputs(batch, extra=("values", "returns"))
        n_mini = self.cfg.rl.actor.ppo_mini_batches
        check_mini_batches(len(data), n_mini, self.runtime.device)
        self.engine.model.train()
        steps: list[dict[str, float]] = []
        sums: list[torch.Tensor] = []
        for _ in range(self.cfg.rl.actor.ppo_epochs):
            for mini in data.chunk(n_mini):
                step, local = self._step(mini)
                steps.append(step)
                sums.append(local)
        # One collective for the token-weighted means of every step.
        totals = torch.stack(sums) / self.replicas
        dist.all_reduce(totals)
        for step, (clipped, value_sum) in zip(steps, totals.tolist(), strict=True):
            tokens = step.pop("tokens")
            step["critic/vf_clipfrac"] = clipped / tokens
            step["critic/values_mean"] = value_sum / tokens
        return {k: sum(s[k] for s in steps) / len(steps) for k in sorted(steps[0])}

    def _step(self, mini: Batch) -> tuple[dict[str, float], torch.Tensor]:
        """One optimizer step over this rank's share of a global mini-batch.

        Returns the step's global metrics and this rank's ``[clipped tokens, sum of
        values]`` (float64, summed over ranks by the caller).
        """
        device = self.runtime.device
        critic = self.cfg.rl.critic
        mode = self.cfg.rl.actor.loss_agg_mode
        tokens, seqs = global_counts(mini.tensors["response_mask"], device, replicas=self.replicas)
        local = torch.zeros(2, dtype=torch.float64, device=device)
        shape = self.update_shape

        def loss_fn(model: nn.Module, mb: Batch) -> torch.Tensor:
            # `model` is self.engine.model, which `_forward` runs (quietly, see there).
            t = {k: v.to(device) for k, v in mb.tensors.items()}
            values = self._values(t["input_ids"], t["attention_mask"], t.get("position_ids"), shape.layout)
            mask = t["response_mask"].bool()
            loss, _ = value_loss(values, t["returns"], t["values"], mask, clip=critic.cliprange_value,
                                 mode=mode, global_tokens=tokens, global_seqs=seqs)
            value_sum = torch.where(mask, values.detach().double(), 0.0).sum()
            clipped = clipped_tokens(values.detach(), t["returns"], t["values"], mask, critic.cliprange_value)
            local.add_(torch.stack([clipped.double(), value_sum]))
            return loss

        # FSDP averages gradients over all ranks; the loss is already over the global
        # mini-batch, so undo that average (Ulysses: each rank's gradient is its slice's).
        mask = mini.tensors["attention_mask"]
        loss_sum = self.engine.accumulate([mini[g] for g in shape.groups(mask)], loss_fn,
                                          self.engine.grad_average_size, dummy_seq_len=shape.dummy_len(mask))
        result = self.engine.finish_step(loss_sum / self.replicas, 1)  # the sum over ranks is the loss
        step = {"critic/vf_loss": result.loss, "critic/grad_norm": result.grad_norm, "critic/lr": result.lr,
                "tokens": tokens}
        return step, local

    # ------------------------------------------------------------------ internals

    def _inputs(self, batch: Batch, extra: tuple[str, ...] = ()) -> Batch:
        keys = [*_INPUT_KEYS, *extra]
        if "position_ids" in batch.tensors:
            keys.append("position_ids")
        data = batch.select(tensor_keys=keys, array_keys=[], meta_keys=[])
        shape = data.tensors["input_ids"].shape
        if len(shape) != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(shape)}")
        for k, v in data.tensors.items():
            if v.shape != shape:
                raise ValueError(f"{k} has shape {tuple(v.shape)} but input_ids has {tuple(shape)}; "
                                 "every per-token tensor is (B, T) aligned with input_ids")
        return data

    def _values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
                layout: str) -> torch.Tensor:
        """`values_from_head` of the rows ``(b, T)``, run in `layout` (`shardwise.engine.packing`)
        and given back in the rows' layout."""
        if layout == "padded":
            return values_from_head(self._forward(input_ids, attention_mask, position_ids))
        lay = packing.compact(input_ids, attention_mask, position_ids, packed=layout == "packed")
        group = self.engine.sp_group
        if group is not None:  # Ulysses: each rank runs its slice of the packed rows
            head = ulysses.packed_forward(self.engine.model, lay.input_ids, lay.position_ids, group,
                                          lambda model, ids, pos, _: {"head": self._forward(ids, None, pos)})
            return lay.unpack(values_from_head(head["head"]))
        return lay.unpack(values_from_head(self._forward(lay.input_ids, lay.attention_mask, lay.position_ids)))

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The head's per-token output ``(b, T, 1)`` (model dtype), under the caller's grad mode."""
        if position_ids is None:
            position_ids = default_position_ids(attention_mask)
        with warnings.catch_warnings():
            # HF's token-classification output is a view; FSDP2 warns that an in-place op on
            # it would skip the pre-backward all-gather. Only out-of-place ops touch it here
            # (values_from_head), and the 2-rank vs unsharded parity test holds.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            out = self.engine.model(input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, use_cache=False)
        return out.logits
