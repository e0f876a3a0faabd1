"""The actor (policy) and the reference policy.

ActorWorker owns a TrainEngine (fsdp2_train) over the policy; `compute_log_prob` scores
sequences with it, `update_actor` runs PPO on a rollout batch. ReferenceWorker owns an
InferEngine (fsdp2_infer, no optimizer) over the initial policy.

Loss scaling in `update_actor`: every term is aggregated with the token / sequence counts
of the whole mini-batch over all ranks (`global_counts`), so the micro-batch losses of all
ranks add up to the loss of the unsharded mini-batch; multiplied by the dp size before
backward because FSDP averages gradients over the data-parallel ranks. An update under N
processes therefore equals the 1-process update on the same rows.
The micro-batch loop itself (throw-away passes on a rank with fewer rows, one gradient
reduce-scatter per step) is `TrainEngine.accumulate`; this module supplies the PPO loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config.schema import Config
from shardwise.data.batch import Batch
from shardwise.distributed.runtime import Runtime
from shardwise.engine.infer import (
    InferEngine,
    compute_log_probs,
    forward_by_micro_batch,
)
from shardwise.engine.train import TrainEngine
from shardwise.models import lora, vision
from shardwise.rl import algorithms as alg
from shardwise.rl.algorithms.user import UserFunctionError, checked_loss_output, resolve_policy_loss
from shardwise.rl.workers.common import (
    PassShape,
    check_mini_batches,
    forward_shape,
    global_counts,
    mean_over_ranks,
    rl_engine_config,
    update_shape,
)

log = logging.getLogger(__name__)

__all__ = ["ActorWorker", "ReferenceWorker", "sequence_log_probs"]

_SEQ_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask")


def loss_horizon(cfg: Config) -> int:
    """The most response tokens a row may have: seq-mean-token-sum-norm's default constant."""
    mt = cfg.rl.multi_turn
    return mt.max_response_tokens if mt.enabled else cfg.rl.rollout.max_new_tokens


def scoring_temperature(cfg: Config) -> float:
    """The temperature log-probs are computed at: the rollout's sampling temperature (1
    for greedy), so the PPO ratio compares the distribution the samples came from."""
    t = cfg.rl.rollout.temperature
    return t if t > 0 else 1.0


def sequence_log_probs(model: torch.nn.Module, batch: Batch, device: torch.device, micro_batch_size: int,
                       with_entropy: bool, temperature: float = 1.0,
                       chunk_tokens: int | None = None, shape: PassShape | None = None) -> dict[str, torch.Tensor]:
    """Log-probs (and entropy) of `batch`'s sequences under `model` at `temperature`, 0
    outside ``response_mask``; collective (ranks may hold different numbers of rows).
    `chunk_tokens`: the LM head over chunks of tokens (`compute_log_probs`). `shape`: the
    layout and micro-batches of the pass (``rl.packing``, token budgets); None: padded rows,
    `micro_batch_size` at a time."""
    t = batch.tensors
    layout = "padded" if shape is None else shape.layout
    groups = None if shape is None else shape.groups(t["attention_mask"])

    def run(ids, mask, pos, **images):
        return compute_log_probs(model, ids, mask, pos, with_entropy, temperature, chunk_tokens=chunk_tokens,
                                 layout=layout, sp_group=None if shape is None else shape.sp_group, **images)

    with torch.no_grad():
        out = forward_by_micro_batch(run, t["input_ids"], t["attention_mask"], t.get("position_ids"),
                                     micro_batch_size, device, images={k: t[k] for k in vision.IMAGE_KEYS if k in t},
                                     vl_config=vision.vl_config(model), groups=groups)
    keep = t["response_mask"].bool().to(out["log_probs"].device)
    return {k: v.masked_fill(~keep, 0.0).cpu() for k, v in out.items()}


class ActorWorker:
    """The policy under training (see the module docstring)."""

    def __init__(self, cfg: Config, runtime: Runtime):
        self.cfg = cfg
        self.runtime = runtime
        resolve_policy_loss(cfg.rl.actor.policy_loss)  # a user's module:function imported at start-up
        self.engine = TrainEngine(rl_engine_config(cfg), runtime)
        self.forward_shape = forward_shape(cfg, self.engine.model, self.engine.sp_group)
        self.update_shape = update_shape(cfg, self.engine.model, self.engine.sp_group)
        # Ulysses: the sp peers of a group hold the same rows and compute the same loss
        self.replicas = self.engine.spec.ulysses

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and ``entropy`` ``(B, T)`` of this rank's sequences."""
        self.model.eval()
        out = sequence_log_probs(self.model, batch, self.runtime.device, self.cfg.train.micro_batch_size,
                                 with_entropy=True, temperature=scoring_temperature(self.cfg),
                                 chunk_tokens=self.engine.chunk_tokens, shape=self.forward_shape)
        self.model.train()
        return Batch.from_dict({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO on this rank's rows: ``ppo_epochs`` passes, each over ``ppo_mini_batches``
        equal mini-batches (one optimizer step each). Needs the layout tensors plus
        ``advantages`` and ``old_log_probs`` (without them the update must be on-policy, one
        epoch of one mini-batch: the old log-probs are then the update's own, detached, and
        the ``entropy``, ``kl`` and ``rollout/*`` metrics come from its forward) and, with
        the KL loss, ``ref_log_probs``. ``rl.actor.off_policy`` (`alg.off_policy_token_loss`)
        tis or decoupled: also ``rollout_log_probs``, the behaviour policy's; decoupled
        needs ``old_log_probs`` (the proximal policy), tis takes the ratio against the
        behaviour policy and reads the old log-probs only for ``off_policy/*`` (the weights
        at the start of the update). Ranks may hold different numbers of rows (0
        included). Returns metrics averaged over steps and ranks."""
        a = self.cfg.rl.actor
        n_mini = a.ppo_mini_batches
        check_mini_batches(len(batch), n_mini, self.runtime.device)
        on_policy = "old_log_probs" not in batch.tensors
        if on_policy and (a.ppo_epochs != 1 or n_mini != 1):
            raise ValueError("update_actor: the batch lacks old_log_probs, which only an on-policy update "
                             f"(1 epoch of 1 mini-batch) can do without; this one has {a.ppo_epochs} x {n_mini}")
        correction = a.off_policy.correction
        if on_policy and correction == "decoupled":
            raise ValueError("update_actor: rl.actor.off_policy.correction=decoupled needs the proximal policy's "
                             "old_log_probs, recomputed by compute_log_prob before the update; the batch lacks them")
        needed = [*_SEQ_KEYS, "advantages"] + ([] if on_policy else ["old_log_probs"])
        needed += ["ref_log_probs"] if a.kl_loss.enabled else []
        needed += ["rollout_log_probs"] if self.cfg.rl.rollout.tis_cap is not None or correction != "none" else []
        missing = [k for k in needed if k not in batch.tensors]
        if missing:
            raise ValueError(f"update_actor: the batch lacks {missing}")
        device = self.runtime.device
        # The same keys on every rank (a rank without rows still reports them): the
        # reductions below are collective.
        names = ["actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/loss",
                 "actor/grad_norm", "actor/lr", "actor/skipped_steps"]
        names += ["actor/entropy_loss"] * (a.entropy_coef != 0) + ["actor/kl_loss"] * a.kl_loss.enabled
        names += [*_OFF_POLICY_SHARES] * (correction != "none")
        if on_policy:
            names += ["entropy"] + ["kl"] * ("ref_log_probs" in batch.tensors)
            names += [*_MISMATCH_SHARES, *_MISMATCH_MAXES] * ("rollout_log_probs" in batch.tensors)
        metrics: dict[str, list[float]] = {k: [] for k in names}
        self.model.train()
        mini_size = len(batch) // n_mini
        shape = self.update_shape
        for _ in range(a.ppo_epochs):
            for mini in (batch.split(mini_size) if mini_size else [batch] * n_mini):
                tokens, seqs = global_counts(mini.tensors["response_mask"], device, replicas=self.replicas)
                mask = mini.tensors["attention_mask"]
                micro = [mini[g] for g in shape.groups(mask)]
                # FSDP averages gradients over all ranks; the loss is already over the
                # global mini-batch, so undo that average (under Ulysses each rank's
                # gradient is that of its slice of the rows: the sp peers' add up).
                local = self.engine.accumulate(micro, self._ppo_loss(tokens, seqs, metrics, on_policy),
                                               self.engine.grad_average_size, dummy_seq_len=shape.dummy_len(mask))
                res = self.engine.finish_step(local / self.replicas, 1)
                metrics["actor/loss"].append(res.loss)
                metrics["actor/grad_norm"].append(res.grad_norm)
                metrics["actor/lr"].append(res.lr)
                metrics["actor/skipped_steps"].append(float(res.skipped))
        # Per-micro-batch values are summed shares of the mini-batch total: report totals
        # per mini-batch, i.e. sum over a rank's micro-batches, then over ranks; maxima
        # are the largest over micro-batches and ranks.
        out = mean_over_ranks({k: v for k, v in metrics.items() if not _is_share(k) and k not in _MISMATCH_MAXES},
                              device)
        # One all-reduce for all the shares, one for all the maxima.
        shares = sorted(k for k in metrics if _is_share(k))
        steps = a.ppo_epochs * n_mini
        if shares:
            totals = torch.tensor([sum(metrics[k]) / steps / self.replicas for k in shares], dtype=torch.float64,
                                  device=device)
            dist.all_reduce(totals)
            out.update(zip(shares, totals.tolist()))
        tops = sorted(set(metrics) & set(_MISMATCH_MAXES))
        if tops:
            top = torch.tensor([max(metrics[k], default=0.0) for k in tops], dtype=torch.float64, device=device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            out.update(zip(tops, top.tolist()))
        return out

    def _ppo_loss(self, tokens: float, seqs: float, metrics: dict[str, list[float]],
                  on_policy: bool = False) -> Callable[[nn.Module, Batch], torch.Tensor]:
        """The loss of one micro-batch of a global mini-batch with `tokens` response tokens
        in `seqs` sequences: the PPO policy loss, minus the entropy bonus, plus the KL loss;
        each call appends the micro-batch's terms to `metrics`. `on_policy`: the old
        log-probs are the forward's own, detached, and the step's policy metrics (entropy,
        KL to the reference, rollout mismatch) are taken from the same forward."""
        a = self.cfg.rl.actor
        clip_low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
        clip_high = a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio
        mode = a.loss_agg_mode
        pg_fn = resolve_policy_loss(a.policy_loss)
        user = ":" in a.policy_loss
        scale = a.loss_scale_factor or loss_horizon(self.cfg)
        # verl's config mapping: the loss's options and the global mini-batch's counts
        # (dp_size 1: the division by the replicas happens in update_actor)
        pg_cfg = {"clip_ratio": a.clip_ratio, "clip_ratio_low": clip_low, "clip_ratio_high": clip_high,
                  "clip_ratio_c": a.clip_ratio_c, "tau_pos": a.tau_pos, "tau_neg": a.tau_neg,
                  "loss_agg_mode": mode, "policy_loss": a.policy_loss_options.model_dump(),
                  "global_batch_info": {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": seqs,
                                        "loss_scale_factor": scale}}
        temperature = scoring_temperature(self.cfg)
        chunk_tokens = self.engine.chunk_tokens
        tis_cap = self.cfg.rl.rollout.tis_cap
        off = a.off_policy
        device = self.runtime.device
        layout = self.update_shape.layout

        def loss_fn(model: nn.Module, mb: Batch) -> torch.Tensor:
            t = {k: v.to(device) for k, v in mb.tensors.items()}
            mask = t["response_mask"].bool()
            out = compute_log_probs(model, t["input_ids"], t["attention_mask"], t["position_ids"],
                                    with_entropy=a.entropy_coef != 0 or on_policy, temperature=temperature,
                                    chunk_tokens=chunk_tokens, layout=layout, sp_group=self.update_shape.sp_group,
                                    **vision.forward_kwargs(t))
            logp = out["log_probs"]
            old = logp.detach() if on_policy else t["old_log_probs"]
            if on_policy:
                _policy_metrics(metrics, old, out["entropy"].detach(), t, mask, tokens)
            if off.correction in ("none", "decoupled"):
                # decoupled: the ratio against `old`, the proximal policy, times the behaviour
                # weights (the same composition for every loss); none: rollout mismatch weights
                if off.correction == "decoupled":
                    weights = alg.tis_weights(old, t["rollout_log_probs"], mask, off.cap)
                    for k, v in alg.off_policy_weights(old, t["rollout_log_probs"], mask, off.cap, tokens).items():
                        metrics[k].append(float(v))
                else:
                    weights = None if tis_cap is None else alg.tis_weights(old, t["rollout_log_probs"], mask, tis_cap)
                try:
                    pg, m = pg_fn(old, logp, t["advantages"], mask, mode, pg_cfg, weights)
                except Exception as e:
                    if not user:
                        raise
                    raise UserFunctionError("rl.actor.policy_loss", f"{a.policy_loss} raised "
                                            f"{type(e).__name__}: {e}", "fix the function") from e
                if user:
                    pg, m = checked_loss_output(a.policy_loss, (pg, m))
            else:
                # tis: the ratio against the behaviour policy; decoupled: against `old`, the
                # proximal policy. `old` is the policy at the start of the update either way.
                behave = t["rollout_log_probs"]
                per_token, m = alg.off_policy_token_loss(off.correction, logp, t["advantages"], mask,
                                                         behave_logp=behave, prox_logp=old, cap=off.cap,
                                                         clip_low=clip_low, clip_high=clip_high, clip_c=a.clip_ratio_c)
                pg = alg.aggregate_loss(per_token, mask, mode, tokens, seqs, scale)
                for k, v in alg.off_policy_weights(old, behave, mask, off.cap, tokens).items():
                    metrics[k].append(float(v))
                m = {"actor/pg_clipfrac": m["clipfrac"], "actor/pg_clipfrac_lower": m["clipfrac_lower"],
                     "actor/ppo_kl": m["approx_kl"]}
            loss = pg
            if a.entropy_coef != 0:
                ent = alg.aggregate_loss(out["entropy"], mask, mode, tokens, seqs, scale)
                loss = loss - a.entropy_coef * ent
                metrics["actor/entropy_loss"].append(float(ent.detach()))
            if a.kl_loss.enabled:
                kl = alg.aggregate_loss(alg.kl_penalty(logp, t["ref_log_probs"], a.kl_loss.type),
                                        mask, mode, tokens, seqs, scale)
                loss = loss + a.kl_loss.coef * kl
                metrics["actor/kl_loss"].append(float(kl.detach()))
            metrics["actor/pg_loss"].append(float(pg.detach()))
            for k in alg.PG_METRICS:  # a loss that does not measure one leaves it without entries
                if k in m:
                    metrics[k].append(float(m[k]))
            return loss

        return loss_fn


_MISMATCH_SHARES = ("rollout/log_prob_diff_abs_mean", "rollout/importance_ratio_mean")
_OFF_POLICY_SHARES = ("off_policy/is_weight_mean", "off_policy/truncated_share")
_MISMATCH_MAXES = ("rollout/log_prob_diff_abs_max", "rollout/importance_ratio_max")


@torch.no_grad()
def _policy_metrics(metrics: dict[str, list[float]], logp: torch.Tensor, entropy: torch.Tensor,
                    t: dict[str, torch.Tensor], mask: torch.Tensor, tokens: float) -> None:
    """The metrics the controller takes from the old-log-prob forward when there is one
    (`shardwise.rl.trainer`), from an on-policy update's forward: token means over the
    global mini-batch as shares (``entropy``, ``kl`` = k1 to the reference,
    `rollout_mismatch`'s means) and per-micro-batch maxima."""
    metrics["entropy"].append(float(alg.aggregate_loss(entropy, mask, "token-mean", tokens)))
    if "kl" in metrics:
        k1 = alg.kl_penalty(logp, t["ref_log_probs"], "k1")
        metrics["kl"].append(float(alg.aggregate_loss(k1, mask, "token-mean", tokens)))
    if _MISMATCH_SHARES[0] in metrics:
        terms = alg.mismatch_terms(logp, t["rollout_log_probs"], mask)
        for share, top, x in zip(_MISMATCH_SHARES, _MISMATCH_MAXES, terms):
            metrics[share].append(float(alg.aggregate_loss(x, mask, "token-mean", tokens)))
            if bool(mask.any()):
                metrics[top].append(float(x.max()))


def _is_share(key: str) -> bool:
    """Terms aggregated with global counts: each micro-batch holds a share."""
    return key in ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "entropy", "kl", *_MISMATCH_SHARES,
                   *_OFF_POLICY_SHARES)


class LoraReference:
    """The reference policy of a LoRA actor: the actor's own model with its adapters
    disabled, i.e. the frozen base (no second copy of the weights, no memory of its own)."""

    def __init__(self, actor: ActorWorker):
        self.actor = actor

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        model = self.actor.model
        was = model.training
        model.eval()
        with lora.adapters_disabled(model):
            out = sequence_log_probs(model, batch, self.actor.runtime.device, self.actor.cfg.train.micro_batch_size,
                                     with_entropy=False, temperature=scoring_temperature(self.actor.cfg),
                                     chunk_tokens=self.actor.engine.chunk_tokens, shape=self.actor.forward_shape)
        model.train(was)
        return Batch.from_dict({"ref_log_probs": out["log_probs"]})


class ReferenceWorker:
    """The frozen initial policy (no optimizer)."""

    def __init__(self, cfg: Config, runtime: Runtime):
        self.cfg = cfg
        self.runtime = runtime
        self.engine = InferEngine(cfg, runtime)
        self.shape = forward_shape(cfg, self.engine.model, self.engine.sp_group)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        out = sequence_log_probs(self.engine.model, batch, self.runtime.device, self.cfg.train.micro_batch_size,
                                 with_entropy=False, temperature=scoring_temperature(self.cfg),
                                 chunk_tokens=self.engine.chunk_tokens, shape=self.shape)
        return Batch.from_dict({"ref_log_probs": out["log_probs"]})
