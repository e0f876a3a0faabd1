"""The RL trainer behind `shardwise rl`: one controller process driving Ray worker groups.

Each step (seed 003): prompts -> generate (n samples per prompt) -> reward -> old
log-probs -> (reference log-probs) -> (values) -> advantages -> (update critic) ->
update actor. GRPO: group outcome advantages, no critic. PPO: GAE with a critic.

The controller holds the prompts, the tokenizer (to decode responses for rule-based
rewards), the sampler position and the metrics; the workers hold the models. Everything
that can be wrong in the config is checked by `prepare` before Ray starts.

Rows per step are ``train.global_batch_size`` prompts x ``rl.rollout.n`` samples, split
evenly over the data-parallel ranks; ``train.micro_batch_size`` rows per forward.

Metrics (run.dir/metrics.jsonl, one line per step): ``reward/mean``, ``accuracy`` (share
of samples whose rule-based score is >= 1, i.e. fully right), ``response_length/mean``
and ``/clip_frac`` (share that hit max_new_tokens), ``entropy``, ``kl`` (k1 between the
policy and the reference, nats/token), the ``actor/*`` and ``critic/*`` update metrics
(loss, clip fractions, grad norm, lr) and ``time/<phase>`` seconds for generate, reward,
old_log_prob, ref, values, advantage, update_critic, update_actor, checkpoint and step.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.config.schema import Config
from shardwise.data.tasks import HELDOUT_PROMPTS, HELDOUT_SEED_OFFSET
from shardwise.distributed.mesh import MeshSpec, mesh_spec
from shardwise.errors import ConfigError
from shardwise.rl import algorithms as alg
from shardwise.rl.batch import Batch
from shardwise.rl.workers.rollout import prompt_batch

log = logging.getLogger(__name__)

EVAL_PROMPTS = HELDOUT_PROMPTS
"""Held-out prompts of a built-in task scored (greedy) before and after RL."""
EVAL_SEED_OFFSET = HELDOUT_SEED_OFFSET


@dataclass
class Prepared:
    cfg: Config
    spec: MeshSpec
    rows_per_step: int


def prepare(cfg: Config, world_size: int) -> Prepared:
    """Every check that needs the world size; raises ConfigError, starts nothing."""
    rl = cfg.rl
    spec = mesh_spec(cfg.parallel, world_size)
    from shardwise.distributed.ulysses import train_only

    train_only(spec.ulysses, "`shardwise rl`")
    if rl.rollout.engine != "hf":
        raise ConfigError("rl.rollout.engine", f"{rl.rollout.engine!r} is not available yet", "use hf")
    if rl.algorithm == "ppo" and not rl.critic.enabled:
        raise ConfigError("rl.critic.enabled", "rl.algorithm=ppo trains a critic",
                          "set rl.critic.enabled=true and rl.advantage=gae")
    if rl.algorithm == "grpo" and rl.advantage == "gae":
        raise ConfigError("rl.advantage", "gae needs the critic of rl.algorithm=ppo",
                          "use grpo, rloo or reinforce_plus_plus, or set rl.algorithm=ppo")
    if rl.advantage in ("grpo", "rloo") and rl.rollout.n < 2:
        raise ConfigError("rl.rollout.n", f"{rl.advantage} compares samples of one prompt and needs n >= 2",
                          "set rl.rollout.n=4")
    if (rl.actor.kl_loss.enabled or rl.kl_in_reward.enabled) and not rl.reference.enabled:
        which = "rl.actor.kl_loss" if rl.actor.kl_loss.enabled else "rl.kl_in_reward"
        raise ConfigError("rl.reference.enabled", f"{which} needs the reference policy",
                          "set rl.reference.enabled=true")
    rows = cfg.train.global_batch_size * rl.rollout.n
    dp = spec.dp_size
    if rows % dp:
        raise ConfigError("train.global_batch_size",
                          f"{cfg.train.global_batch_size} prompts x rl.rollout.n={rl.rollout.n} = {rows} rows "
                          f"do not split over {dp} data-parallel ranks",
                          f"make prompts x n a multiple of {dp}")
    if (rows // dp) % rl.actor.ppo_mini_batches:
        raise ConfigError("rl.actor.ppo_mini_batches",
                          f"{rl.actor.ppo_mini_batches} does not divide the {rows // dp} rows of each rank",
                          "pick a divisor of (global_batch_size x n / ranks)")
    if rl.reward.function is None and rl.reward.model is None:
        raise ConfigError("rl.reward", "no reward: both rl.reward.function and rl.reward.model are null",
                          "set rl.reward.function=builtin:arithmetic or a module:function")
    if rl.reward.function is not None:
        from shardwise.rl.workers.reward import resolve_reward_fn

        resolve_reward_fn(rl.reward.function)
    if rl.reward.model is not None and not (Path(rl.reward.model) / "config.json").is_file():
        raise ConfigError("rl.reward.model", f"{rl.reward.model!r} holds no config.json",
                          "point it at a sequence-classification model folder written by save_pretrained")
    from shardwise.fsdp.build import plan_for
    from shardwise.jobs.inputs import check_data, check_model, check_resume
    from shardwise.models.loading import check_weights_folder

    check_model(cfg)
    if rl.reward.model is not None:
        check_weights_folder(rl.reward.model, "rl.reward.model")
    check_resume(cfg)
    check_data(cfg, cfg.data.response_key)

    plan_for(cfg, spec)  # pattern errors surface here, on the meta device
    return Prepared(cfg, spec, rows)


def worker_groups(cfg: Config) -> dict[str, list[str]]:
    """Worker groups this config needs, name -> roles. "rl" is the hybrid engine (actor +
    rollout [+ reference]); the critic and the reward model join it when colocated."""
    groups: dict[str, list[str]] = {"rl": ["actor", "rollout"]}
    if cfg.rl.reference.enabled:
        groups["rl"].append("ref")
    if cfg.rl.critic.enabled:
        groups["rl" if cfg.rl.critic.colocated else "critic"] = \
            groups.get("rl" if cfg.rl.critic.colocated else "critic", []) + ["critic"]
    if cfg.rl.reward.model is not None:
        name = "rl" if cfg.rl.reward.colocated else "reward"
        groups[name] = groups.get(name, []) + ["reward_model"]
    return groups


def controller_tokenizer(cfg: Config):
    """(tokenizer, its folder): model.tokenizer, model.path, run.dir/tokenizer, or the
    built-in char tokenizer built into run.dir/tokenizer."""
    from transformers import AutoTokenizer

    from shardwise.data.tokenizer import (
        build_char_tokenizer,
        has_tokenizer_files,
        locate_tokenizer,
    )

    if cfg.model.tokenizer is not None and not has_tokenizer_files(cfg.model.tokenizer):
        raise ConfigError("model.tokenizer", f"{cfg.model.tokenizer!r} holds no tokenizer files")
    found = locate_tokenizer(cfg.model.tokenizer, cfg.model.path, cfg.run.dir)
    if found is None:
        found = Path(cfg.run.dir) / "tokenizer"
        build_char_tokenizer(found)
    tok = AutoTokenizer.from_pretrained(str(found))
    if tok.eos_token_id is None:
        raise ConfigError("model.tokenizer", f"the tokenizer in {str(found)!r} has no eos token",
                          "RL generation stops at eos; use a tokenizer that defines one")
    return tok, str(found)


class Controller:
    """The single controller (see the module docstring)."""

    def __init__(self, cfg: Config, world_size: int):
        from shardwise.data.sampler import GlobalBatchSampler
        from shardwise.data.sources import load_records
        from shardwise.models.loading import load_hf_config

        self.cfg = cfg
        self.world_size = world_size
        self.run_dir = Path(cfg.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(by_alias=True, mode="json"), indent=2))
        self.tokenizer, self.tokenizer_dir = controller_tokenizer(cfg)
        from shardwise.jobs.sft import check_vocab

        check_vocab(self.tokenizer, load_hf_config(cfg.model))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        d = cfg.data
        self.records = load_records(d.source, d.prompt_key, d.response_key, seed=cfg.run.seed)
        from shardwise.data.collate import truncation_note

        note = truncation_note(self.tokenizer, self.records, d.max_length, with_response=False)
        if note:
            log.warning("data: %s", note)
        self.sampler = GlobalBatchSampler(len(self.records), cfg.train.global_batch_size, cfg.run.seed)
        self._batches = iter(self.sampler)
        self.reward_fn = None
        if cfg.rl.reward.function is not None:
            from shardwise.rl.workers.reward import resolve_reward_fn

            self.reward_fn = resolve_reward_fn(cfg.rl.reward.function)
        self.kl_ctl = alg.FixedKLController(cfg.rl.kl_in_reward.coef)
        self.step = 0
        self.groups: dict[str, Any] = {}

    # -- the worker groups
    def start(self) -> None:
        from shardwise.rl.cluster import RayWorkerGroup, init_ray
        from shardwise.rl.workers.hybrid import RLWorker

        plan = worker_groups(self.cfg)
        init_ray(num_cpus=self.world_size * len(plan))
        cfg_dict = self.cfg.model_dump(by_alias=True, mode="json")
        for name, roles in plan.items():
            self.groups[name] = RayWorkerGroup(RLWorker, self.world_size, cfg_dict, roles, self.pad_id,
                                               self.eos_id, name=name)

    @property
    def group(self):
        """The hybrid engine's group (actor, rollout, reference)."""
        return self.groups["rl"]

    def group_of(self, role: str):
        """The group hosting `role`."""
        for name, roles in worker_groups(self.cfg).items():
            if role in roles:
                return self.groups[name]
        raise KeyError(role)

    def close(self, graceful: bool = True) -> None:
        """Release the worker groups; not graceful after an error (workers may be stuck in
        a collective, a teardown barrier would wait for them)."""
        for g in self.groups.values():
            g.shutdown(graceful=graceful)
        self.groups = {}

    # -- state
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_coef": self.kl_ctl.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self._batches = iter(self.sampler)
        self.kl_ctl.value = float(state["kl_coef"])

    def resume(self) -> bool:
        extras = {name: g.load_checkpoint() for name, g in self.groups.items()}
        steps = {name: None if e is None else e["step"] for name, e in extras.items()}
        if len(set(steps.values())) > 1:
            raise RuntimeError(f"the worker groups' checkpoints are at different steps {steps}; "
                               "set checkpoint.resume to one step's folder or never")
        if extras["rl"] is None:
            return False
        self.load_state_dict(extras["rl"])
        return True

    def save(self, final: bool) -> None:
        for g in self.groups.values():
            g.save_checkpoint(self.step, self.state_dict(), final)

    def wait_checkpoints(self) -> None:
        for g in self.groups.values():
            g.wait_checkpoint()

    # -- one step
    def next_prompts(self) -> Batch:
        indices = next(self._batches)
        uids = [f"{self.step}-{i}" for i in range(len(indices))]
        batch = prompt_batch(self.tokenizer, [self.records[i] for i in indices], self.cfg.data.max_length, uids)
        batch = batch.repeat(self.cfg.rl.rollout.n, interleave=True)
        batch.meta["seed"] = self.cfg.run.seed * 1_000_003 + self.step
        return batch

    def score(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``token_level_scores`` (rule-based reward plus reward-model score, each at the
        last response token) and the reward metrics."""
        mask = batch.tensors["response_mask"].bool()
        scores = torch.zeros(mask.shape, dtype=torch.float32)
        metrics: dict[str, float] = {}
        last = _last_token_index(mask)
        has = mask.any(-1)
        if self.reward_fn is not None:
            from shardwise.rl.workers.reward import score_sequences

            scored = score_sequences(batch, self.tokenizer, self.reward_fn)
            rule = scored.tensors["token_level_scores"].sum(-1)
            scores += scored.tensors["token_level_scores"]
            metrics["accuracy"] = float((rule >= 1.0).float().mean())
            metrics["reward/rule_mean"] = float(rule.mean())
        if self.cfg.rl.reward.model is not None:
            rm = self.group_of("reward_model").compute_rm_score(batch).tensors["rm_scores"].float()
            rows = torch.arange(len(batch))[has]
            scores[rows, last[has]] += rm[has]
            metrics["reward/model_mean"] = float(rm.mean())
        seq = scores.sum(-1)
        metrics["reward/mean"] = float(seq.mean())
        metrics["reward/std"] = float(seq.std()) if len(seq) > 1 else 0.0
        return batch.union(Batch.from_dict({"token_level_scores": scores})), metrics

    def advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        rl = self.cfg.rl
        t = batch.tensors
        mask = t["response_mask"].bool()
        metrics: dict[str, float] = {}
        rewards = t["token_level_scores"]
        if rl.kl_in_reward.enabled:
            rewards, kl = alg.apply_kl_in_reward(rewards, t["old_log_probs"], t["ref_log_probs"], mask,
                                                 self.kl_ctl.value, rl.kl_in_reward.type)
            self.kl_ctl.update(kl, len(batch))
            metrics["kl_in_reward/coef"] = self.kl_ctl.value
        uids = list(batch.arrays["uid"])
        if rl.advantage == "gae":
            adv, returns = alg.gae_advantages(rewards, t["values"], mask, rl.gamma, rl.lam)
        elif rl.advantage == "grpo":
            adv = alg.grpo_advantages(rewards, mask, uids)
            returns = adv
        elif rl.advantage == "rloo":
            adv = alg.rloo_advantages(rewards, mask, uids)
            returns = adv
        else:
            adv = alg.reinforce_plus_plus_advantages(rewards, mask, rl.gamma)
            returns = adv
        metrics["advantages/abs_mean"] = float(alg.masked_mean(adv.abs(), mask))
        return batch.union(Batch.from_dict({"token_level_rewards": rewards, "advantages": adv,
                                            "returns": returns})), metrics

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        from shardwise.telemetry import PhaseTimer

        rl = self.cfg.rl
        g = self.group
        timer = PhaseTimer(synchronize=False)
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        with timer("generate"):
            batch = g.generate_sequences(self.next_prompts())
        with timer("reward"):
            batch, m = self.score(batch)
            metrics.update(m)
        with timer("old_log_prob"):
            batch = batch.union(g.compute_log_prob(batch))
        mask = batch.tensors["response_mask"].bool()
        metrics["entropy"] = float(alg.masked_mean(batch.tensors["entropy"], mask))
        if rl.reference.enabled:
            with timer("ref"):
                batch = batch.union(g.compute_ref_log_prob(batch))
            metrics["kl"] = float(alg.masked_mean(
                alg.kl_penalty(batch.tensors["old_log_probs"], batch.tensors["ref_log_probs"], "k1"), mask))
        if rl.critic.enabled:
            with timer("values"):
                batch = batch.union(self.group_of("critic").compute_values(batch))
        with timer("advantage"):
            batch, m = self.advantages(batch)
            metrics.update(m)
        if rl.critic.enabled:
            with timer("update_critic"):
                metrics.update(self.group_of("critic").update_critic(batch))
        with timer("update_actor"):
            metrics.update(g.update_actor(batch))
        lengths = mask.sum(-1).float()
        metrics["response_length/mean"] = float(lengths.mean())
        metrics["response_length/clip_frac"] = float((lengths >= rl.rollout.max_new_tokens).float().mean())
        self.step += 1
        max_steps = self.cfg.train.max_steps
        if _should_save(self.cfg, self.step, max_steps):
            with timer("checkpoint"):
                self.save(final=self.step == max_steps)
        metrics.update(timer.as_dict())
        metrics["time/step"] = time.perf_counter() - t0
        return metrics

    # -- evaluation
    def evaluate(self, n: int = EVAL_PROMPTS) -> float | None:
        """Greedy accuracy on held-out prompts of a built-in task (None for other data)."""
        source = self.cfg.data.source
        if self.reward_fn is None or not source.startswith("builtin:"):
            return None
        from shardwise.data.tasks import get_builtin_task
        from shardwise.rl.workers.reward import score_sequences

        records = get_builtin_task(source).make_examples(n, self.cfg.run.seed + EVAL_SEED_OFFSET)
        batch = prompt_batch(self.tokenizer, records, self.cfg.data.max_length, [f"eval-{i}" for i in range(n)])
        batch.meta.update(seed=0, greedy=True)
        out = score_sequences(self.group.generate_sequences(batch), self.tokenizer, self.reward_fn)
        return float((out.tensors["token_level_scores"].sum(-1) >= 1.0).float().mean())


def mean_timing(history: list[dict[str, float]]) -> dict[str, float]:
    """Mean seconds of each phase per step (the first step, which warms up, left out when
    there are others); phases that did not run in a step count 0 there."""
    steps = history[1:] if len(history) > 1 else history
    keys = sorted({k for m in steps for k in m if k.startswith("time/")})
    return {k: sum(m.get(k, 0.0) for m in steps) / len(steps) for k in keys} if steps else {}


def _should_save(cfg: Config, step: int, max_steps: int) -> bool:
    every = cfg.checkpoint.every_steps
    return (every > 0 and step % every == 0) or step == max_steps


def _last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last nonzero position of each row (0 for an empty row)."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask, positions, torch.zeros_like(positions)).amax(-1)


def run(cfg: Config, world_size: int) -> dict[str, Any]:
    """The whole RL run; returns a summary (paths, accuracy before/after, final metrics)."""
    from shardwise.telemetry import MetricsWriter, Progress, plot_metrics

    prepare(cfg, world_size)
    ctl = Controller(cfg, world_size)
    summary: dict[str, Any] = {"run_dir": str(ctl.run_dir), "metrics": str(ctl.run_dir / "metrics.jsonl")}
    max_steps = cfg.train.max_steps
    try:
        ctl.start()
        resumed = ctl.resume()
        summary["resumed_from_step"] = ctl.step if resumed else None
        summary["accuracy_before"] = ctl.evaluate()
        writer = MetricsWriter(ctl.run_dir, enabled=True, after_step=ctl.step)
        bar = Progress(total=max_steps, enabled=True, desc=cfg.rl.algorithm, initial=ctl.step)
        history: list[dict[str, float]] = []
        try:
            while ctl.step < max_steps:
                m = ctl.train_step()
                history.append(m)
                if ctl.step % cfg.train.log_every == 0 or ctl.step == max_steps:
                    writer.log(ctl.step, m)
                bar.update(1, reward=m["reward/mean"], **({"acc": m["accuracy"]} if "accuracy" in m else {}))
            ctl.wait_checkpoints()
        finally:
            bar.close()
            writer.close()
        summary["steps"] = ctl.step
        summary["history"] = history
        summary["timing"] = mean_timing(history)
        summary["accuracy_after"] = ctl.evaluate()
        if cfg.checkpoint.export_hf:
            summary["hf"] = ctl.group.export_hf(str(ctl.run_dir / "hf"), ctl.tokenizer_dir)
        summary["checkpoint"] = str(ctl.run_dir / "checkpoints")
    except BaseException:
        ctl.close(graceful=False)
        raise
    else:
        ctl.close()
    if (ctl.run_dir / "metrics.jsonl").is_file():
        panels = [("reward / accuracy", ["reward/mean", "accuracy"]),
                  ("response length", ["response_length/mean"]), ("KL to reference / entropy", ["kl", "entropy"]),
                  ("actor", ["actor/grad_norm", "actor/pg_clipfrac"]),
                  ("seconds per phase", ["time/step", "time/generate", "time/update_actor", "time/old_log_prob"])]
        if cfg.rl.critic.enabled:
            panels.append(("critic", ["critic/vf_loss"]))
        summary["plot"] = str(plot_metrics(ctl.run_dir / "metrics.jsonl", ctl.run_dir / "rl.png", panels))
    return summary
