"""TrainEngine (fsdp2_train): forward / backward / optimizer step on the planned model.

Every trainer (SFT's `TrainEngine.train_step`, the RL actor and critic) runs one loop,
`TrainEngine.accumulate`: forward and backward over this rank's micro-batches with the
caller's loss function, the gradient reduce-scatter on the last backward only, then
`TrainEngine.finish_step`. The engine is the lower layer: `shardwise.rl` imports from it,
never the reverse.

Loss scaling: every micro-batch returns the SUM of its token losses; the engine multiplies
by world_size / global_loss_tokens before backward. FSDP averages gradients over all
world_size ranks, so the final gradient is sum(all token losses in the global batch) /
global_loss_tokens: the unsharded run's gradient whatever the micro-batching and world size.
(Without sequence parallelism every rank is its own data-parallel rank; with Ulysses the
sp ranks of a group hold slices of the same rows, and each slice's token losses are summed
on the rank holding it.)

Ranks with fewer micro-batches: every forward all-gathers parameters and the last backward
reduce-scatters gradients, so a rank with fewer micro-batches than the busiest one runs
throw-away forwards and backwards (one `dummy_inputs` row, loss x 0) up to that count:
the training twin of `shardwise.engine.infer.forward_by_micro_batch`.

Validation loss (`TrainEngine.eval_loss_sum`): the same loss function over this rank's
share of the validation micro-batches, forward only (no_grad, eval mode), the ranks agreeing
on the count and padding with throw-away forwards as above; the sums are added over all
ranks, so the caller divides by the validation set's loss tokens: the unsharded mean.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise.config.schema import Config
from shardwise.config.validate import mesh_spec
from shardwise.distributed import ulysses
from shardwise.distributed.mesh import build_mesh
from shardwise.distributed.runtime import Runtime
from shardwise.engine.infer import agreed_count, default_position_ids
from shardwise.engine.losses import (
    causal_lm_loss_sum,
    chunked_causal_lm_loss_sum,
    loss_chunk_tokens,
)
from shardwise.engine.optim import build_optimizer, build_scheduler
from shardwise.fsdp.build import build_sharded_model
from shardwise.fsdp.plan import ShardingPlan
from shardwise.models import chunked_head, vision
from shardwise.models.chunked_head import per_token_log_probs
from shardwise.telemetry import Progress

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
T = TypeVar("T")


def lm_loss_sum(model: nn.Module, batch: Batch, chunk_tokens: int | None = None) -> torch.Tensor:
    """Default loss: summed next-token cross-entropy over labelled positions (fp32 scalar).

    `chunk_tokens` None: from the full logits (`causal_lm_loss_sum`); a number: the LM head
    and the cross-entropy over chunks of that many tokens, recomputed in backward
    (`chunked_causal_lm_loss_sum`, ``train.chunked_loss``), the same sum without the
    ``(batch, seq, vocab)`` logits. `TrainEngine.lm_loss` is this with the config's choice.
    """
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    # a VL batch's image (no position_ids: the model's own)
    kwargs.update(vision.with_token_types(model, batch["input_ids"], vision.forward_kwargs(batch)))
    if chunk_tokens is not None:
        return chunked_causal_lm_loss_sum(model, batch["labels"], chunk_tokens, input_ids=batch["input_ids"],
                                          **kwargs)
    out = model(input_ids=batch["input_ids"], use_cache=False, **kwargs)
    return causal_lm_loss_sum(out.logits, batch["labels"])


def dummy_inputs(seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One row of `seq` tokens (at least 1) for a throw-away forward: ``input_ids``,
    ``attention_mask``, ``position_ids`` ``(1, seq)`` int64 on `device`."""
    ids = torch.zeros((1, max(seq, 1)), dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": default_position_ids(mask)}


def agreed_micro_batches(n_local: int, device: torch.device) -> int:
    """The most micro-batches any rank has, given this rank's `n_local`; collective over
    the whole world (one all-reduce)."""
    return agreed_count(n_local, device)


@dataclass
class StepResult:
    loss: float
    """Mean token loss over the global batch."""
    grad_norm: float
    lr: float
    skipped: bool
    loss_tokens: int


class TrainEngine:
    """Owns the sharded model, its optimizer and LR schedule."""

    def __init__(self, cfg: Config, runtime: Runtime, task: str = "causal_lm",
                 planned: tuple[nn.Module, ShardingPlan] | None = None, **config_extra):
        """`planned`: the meta model and plan a job's prepare step built for this config
        (see `shardwise.fsdp.build.build_sharded_model`)."""
        self.cfg = cfg
        self.runtime = runtime
        self.spec = mesh_spec(cfg.parallel, runtime.world_size)
        self.mesh = build_mesh(self.spec, runtime.device.type)
        self.model, self.plan = build_sharded_model(cfg, runtime, self.spec, self.mesh, task, planned=planned,
                                                    **config_extra)
        self.sp_group = None
        if self.spec.ulysses > 1:
            self.sp_group = ulysses.sp_group(self.spec.ulysses, runtime.device.type)
            ulysses.enable(self.model, self.sp_group)
        # Tokens per chunk of the LM head and loss (train.chunked_loss); None: full logits.
        # Other tasks (a value or reward head) have no LM head to chunk.
        self.chunk_tokens = loss_chunk_tokens(cfg.train.chunked_loss) if task == "causal_lm" else None
        if self.chunk_tokens is not None:
            chunked_head.check_model(self.model)
        # The causal-LM loss the config selects (train_step's default): lm_loss_sum, chunked or not.
        self.lm_loss: LossFn = (lm_loss_sum if self.chunk_tokens is None
                                else functools.partial(lm_loss_sum, chunk_tokens=self.chunk_tokens))
        self.optimizer = build_optimizer(self.model, cfg.train.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.scheduler, cfg.train.max_steps)
        self.step = 0
        self.skipped_steps = 0
        self._ignored = [p for p in self.model.parameters() if not isinstance(p, DTensor)]
        self._vl_config = vision.vl_config(self.model)

    @property
    def dp_size(self) -> int:
        """Ranks that see different rows (sequence-parallel peers share theirs)."""
        return self.spec.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: sp groups are blocks of consecutive ranks."""
        return self.runtime.rank // self.spec.ulysses

    @property
    def grad_average_size(self) -> int:
        """Ranks whose gradients FSDP averages: all of them."""
        return self.runtime.world_size

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip the reduce-scatter for non-final micro-batches; always restored."""
        assert isinstance(self.model, FSDPModule)
        self.model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def accumulate(self, micro_batches: Sequence[T], loss_fn: Callable[[nn.Module, T], torch.Tensor],
                   scale: float, *, agree: bool = True, dummy_seq_len: int = 1) -> torch.Tensor:
        """Forward and backward of ``loss_fn(model, mb) * scale`` for each of this rank's
        micro-batches, gradients accumulated (not stepped: `finish_step` does that).

        `loss_fn` returns a 0-d loss of one micro-batch (a sum of token losses, or a share of
        a global loss); it moves its micro-batch to the device and may record metrics.
        `scale` multiplies each loss before backward. With `agree` the ranks first agree on
        the most micro-batches any rank has (one all-reduce) and a rank with fewer runs
        throw-away passes (see the module docstring) on one row of `dummy_seq_len` tokens
        through the model's plain forward; without it every rank must hold the same number
        of micro-batches. The gradient reduce-scatter runs in the last of the passes only.

        Returns this rank's sum of the unscaled losses, 0-d float64 on the device.
        """
        device = self.runtime.device
        n_local = len(micro_batches)
        n_all = agreed_micro_batches(n_local, device) if agree else n_local
        local_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(n_all):
            with self.gradient_sync(i == n_all - 1):
                if i >= n_local:
                    self._throw_away_pass(dummy_seq_len)
                    continue
                loss = loss_fn(self.model, micro_batches[i])
                (loss * scale).backward()
            local_sum += loss.detach().double()
        return local_sum

    def _throw_away_pass(self, seq: int) -> None:
        """A forward and backward with zero gradients: its all-gathers and reduce-scatter
        pair with those of the ranks that still have micro-batches (a VL model's row
        carries an image, so its vision units gather too)."""
        self._throw_away_forward(seq).mul(0.0).backward()

    def _throw_away_forward(self, seq: int) -> torch.Tensor:
        """The forward of `_throw_away_pass` on one dummy row of `seq` tokens; returns the sum
        of its outputs (0-d), for a backward to follow or not."""
        inputs = dummy_inputs(seq, self.runtime.device)
        if self._vl_config is not None:
            inputs = vision.dummy_image(self._vl_config, seq, self.runtime.device)
        if self.chunk_tokens is not None:
            # Chunked like the real passes: a long dummy row must not form (seq x vocab) logits.
            return per_token_log_probs(self.model, torch.zeros_like(inputs["input_ids"]), self.chunk_tokens,
                                       **inputs)["log_probs"].sum()
        with warnings.catch_warnings():
            # A token-classification head returns a view; FSDP2 warns that an in-place op on
            # it would skip the pre-backward all-gather. Only out-of-place ops touch it here.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            out = self.model(**inputs, use_cache=False)
        return out.logits.sum()

    def eval_loss_sum(self, micro_batches: Sequence[Batch], loss_fn: LossFn | None = None,
                      progress: bool = False) -> float:
        """The sum of `loss_fn` (default `lm_loss`, the training loss: summed token losses;
        Ulysses: each sp rank's slice, as in `train_step`) over this rank's micro-batches,
        added over ALL ranks: forward only, under no_grad with the model in eval mode (its
        train mode restored). Collective: every rank calls it; the ranks agree on the most
        micro-batches any holds (one all-reduce) and a rank with fewer runs throw-away
        forwards, so the all-gathers of every forward pair up (a rank may hold none).
        `progress`: a bar ``eval`` over the forwards (rank 0). Divide by the loss tokens of
        all ranks' micro-batches for the mean token loss."""
        if self.sp_group is not None:
            loss_fn = self._ulysses_loss_fn(loss_fn)
        elif loss_fn is None:
            loss_fn = self.lm_loss
        device = self.runtime.device
        n_local = len(micro_batches)
        n_all = agreed_micro_batches(n_local, device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        was_training = self.model.training
        bar = Progress(total=n_all, enabled=progress, desc="eval")
        self.model.eval()
        try:
            with torch.no_grad():
                for i in range(n_all):
                    if i < n_local:
                        total += loss_fn(self.model, self._to_device(micro_batches[i])).double()
                    else:
                        self._throw_away_forward(1)
                    bar.update(1)
        finally:
            self.model.train(was_training)
            bar.close()
        dist.all_reduce(total)  # every rank summed distinct tokens (or distinct slices of them)
        return float(total.item())

    def train_step(self, micro_batches: Sequence[Batch], global_loss_tokens: int,
                   loss_fn: LossFn | None = None, agree: bool = False) -> StepResult:
        """One optimizer step over this rank's micro-batches of the global batch.

        `global_loss_tokens` is the number of loss tokens in the WHOLE global batch (all
        ranks, all micro-batches). With fixed micro-batches every data-parallel rank holds
        the same number of them (its equal share of the global batch), so no agreement is
        needed; `agree` (micro-batches made by a token budget) lets the counts differ: the
        ranks agree on the most and the others run throw-away passes (`accumulate`).
        `loss_fn` defaults to `lm_loss` (the causal-LM loss, chunked per
        ``train.chunked_loss``); `lm_loss_sum` itself is the plain full-logits loss.
        """
        assert global_loss_tokens > 0, "a global batch with no loss tokens"
        self.model.train()
        scale = self.grad_average_size / global_loss_tokens
        if self.sp_group is not None:
            loss_fn = self._ulysses_loss_fn(loss_fn)
        elif loss_fn is None:
            loss_fn = self.lm_loss

        if self._vl_config is not None and any("pixel_values" not in mb for mb in micro_batches):
            raise ValueError("train_step: a vision-language model trains on rows with images (pixel_values, "
                             "image_grid_thw): a forward without them skips the vision units, which FSDP then "
                             "cannot finish in backward")

        def on_device(model: nn.Module, mb: Batch) -> torch.Tensor:
            return loss_fn(model, self._to_device(mb))

        local_sum = self.accumulate(micro_batches, on_device, scale, agree=agree)
        return self.finish_step(local_sum, global_loss_tokens)

    def _ulysses_loss_fn(self, loss_fn: LossFn | None) -> LossFn:
        """The causal-LM loss on this rank's slice of each row (`shardwise.distributed.ulysses`):
        chunked per ``train.chunked_loss`` for the default (`lm_loss`), plain for `lm_loss_sum`."""
        if loss_fn is not None and loss_fn is not self.lm_loss and loss_fn is not lm_loss_sum:
            raise ValueError("Ulysses sequence parallel trains the causal-LM loss only (lm_loss_sum)")
        sp, sp_rank = self.spec.ulysses, dist.get_rank(self.sp_group)
        chunk = None if loss_fn is lm_loss_sum else self.chunk_tokens
        if chunk is None:
            return lambda model, mb: ulysses.loss_sum(model, ulysses.slice_batch(mb, sp_rank, sp))
        return lambda model, mb: ulysses.loss_sum(model, ulysses.slice_batch(mb, sp_rank, sp), chunk_tokens=chunk)

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.runtime.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def finish_step(self, local_loss_sum: torch.Tensor, global_loss_tokens: int) -> StepResult:
        """All-reduce the loss, sync ignored grads, clip, step (or skip if non-finite).

        The loss, the norm and the clipping stay on the device; the one host
        synchronisation of the step reads loss and norm together, to decide whether to step.
        """
        dist.all_reduce(local_loss_sum)  # every rank summed distinct tokens: the sum is global
        self._sync_ignored_grads()
        norm = self.clip_grad_norm(self.cfg.train.grad_clip)
        loss_sum, grad_norm = torch.stack([local_loss_sum.double(), norm.double()]).tolist()
        loss = loss_sum / global_loss_tokens
        lr = self.optimizer.param_groups[0]["lr"]  # what this step's update uses (also right after a resume)
        skipped = not (math.isfinite(grad_norm) and math.isfinite(loss))
        if skipped:
            self.skipped_steps += 1
            if self.runtime.is_main:
                log.warning("step %d skipped: non-finite %s (loss=%s, grad_norm=%s)", self.step + 1,
                            "loss" if not math.isfinite(loss) else "grad norm", loss, grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, skipped=skipped,
                          loss_tokens=global_loss_tokens)

    def _sync_ignored_grads(self) -> None:
        """Parameters left out of FSDP: average their gradients like FSDP would."""
        for p in self._ignored:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.grad_average_size)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The true global L2 norm of the gradients (0-d fp32 tensor on the device), over all
        shards; with `max_norm` every gradient is scaled by min(1, max_norm / (norm + 1e-6)).

        Each rank takes the norm of its local shards with torch's foreach kernels; squares
        are summed over the shard group only (replicas of HSDP hold copies), then the
        parameters FSDP does not manage (the same on every rank) are added. No host
        synchronisation: a non-finite norm scales the gradients to NaN, and the caller skips
        the step."""
        device = self.runtime.device
        local = [p.grad.to_local() for p in self.model.parameters()
                 if p.grad is not None and isinstance(p.grad, DTensor)]
        sq = (torch.nn.utils.get_total_norm(local, 2.0, foreach=True).float().square().to(device)
              if local else torch.zeros((), dtype=torch.float32, device=device))
        group = self.mesh["shard"].get_group() if "shard" in self.mesh.mesh_dim_names else None
        dist.all_reduce(sq, group=group)
        ignored = [p.grad for p in self._ignored if p.grad is not None]
        if ignored:
            sq = sq + torch.nn.utils.get_total_norm(ignored, 2.0, foreach=True).float().square().to(device)
        norm = sq.sqrt()
        if max_norm is not None:
            # Sharded and FSDP-ignored gradients in separate calls: a foreach kernel takes
            # DTensors or plain tensors, not both.
            sharded = [p for p in self.model.parameters() if isinstance(p.grad, DTensor)]
            plain = [p for p in self.model.parameters() if p.grad is not None and not isinstance(p.grad, DTensor)]
            for group_params in (sharded, plain):
                if group_params:
                    torch.nn.utils.clip_grads_with_norm_(group_params, max_norm, norm, foreach=True)
        return norm
