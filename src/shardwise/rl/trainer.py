"""The single controller of RL post-training: one process driving Ray worker groups.

Each step: prompts -> generate (n samples per prompt) -> reward -> old log-probs ->
(reference log-probs) -> (values) -> advantages -> (update critic) -> update actor. The
old log-probs are skipped when the update is on-policy (one epoch, one mini-batch, no KL
in the reward; ``rl.actor.on_policy_shortcut``): the actor's update forward gives them. GRPO:
group outcome advantages, no critic. PPO: GAE with a critic. The estimator is looked up
by name in `shardwise.registry.ADVANTAGE_ESTIMATORS`.

The controller holds the prompts, the tokenizer (to decode responses for rule-based
rewards), the sampler position and the metrics; the workers hold the models. The recipe
that checks a config and drives a whole run is `shardwise.jobs.rl`.

Rows per step are ``train.global_batch_size`` prompts x ``rl.rollout.n`` samples, split
evenly over the data-parallel ranks; ``train.micro_batch_size`` rows per forward. With
``rl.filter_groups`` (DAPO's dynamic sampling, `Controller.sample`) the groups whose rewards
are all equal leave the step after the reward; with ``rl.filter_groups_refill`` more prompts
are sampled until the step is full again. The update then runs on fewer rows: as many whole
groups as split evenly over the ranks and ``rl.actor.ppo_mini_batches``
(`shardwise.config.validate.rl_update_groups`), or none (the step makes no update); its
losses are normalised over those rows alone (``global_counts`` of the workers).

Metrics (one line per step in run.dir/metrics.jsonl): ``reward/mean``, ``accuracy`` (share
of samples whose rule-based score is >= 1, i.e. fully right), ``response_length/mean``
and ``/clip_frac`` (share that hit max_new_tokens), all over every sample generated in the
step (every refill round too, filtered or not); ``entropy``, ``kl`` (k1 between the
policy and the reference, nats/token) over the update's rows; ``filter/*`` with
``rl.filter_groups`` (`Controller.sample`); the ``actor/*`` and ``critic/*`` update metrics
(loss, clip fractions, grad norm, lr) and ``time/<phase>`` seconds for generate, reward,
old_log_prob, ref, values, advantage, update_critic, update_actor, checkpoint and step,
and ``time/dispatch``: the part of those phases spent moving batches between the
controller and the workers (splitting, serializing, Ray scheduling) rather than in the
workers' methods; ``batch/tokens`` (real tokens of the step's rows), ``batch/padding_share``
(the share of the rows' padded layout that is padding: what forwards without
``rl.packing`` compute for nothing) and ``perf/update_tokens_per_s`` (real tokens x
ppo_epochs / time/update_actor);
``rollout/*``: the rollout engine's log-probs of the sampled tokens against the actor's
(absolute difference, importance ratio; `shardwise.rl.algorithms.rollout_mismatch`);
with an engine that keeps its own weights (vllm), ``time/weight_sync`` (inside
``time/generate``) and ``weight_sync/bytes`` of the step's push. With ``rl.multi_turn``
(`shardwise.agents.loop`): ``multi_turn/*`` and ``tools/*`` over every trajectory of the step
(`trajectory_metrics`), ``time/tools`` (the slowest rank's, inside ``time/generate``);
``response_length/*`` count the model's tokens only and ``clip_frac`` is the share of
truncated trajectories. The first step's line
also holds ``time/startup/<part>``: where the start-up went (`Controller.start` times Ray
and the worker groups, the workers their models and engine; `shardwise.jobs.rl` the rest).

Evaluation (``eval``, or a built-in task's held-out prompts; `Controller.run_evaluation`):
before the first step (step 0, or the step a resumed run starts from), every
``eval.every_steps`` and after the last step, the rollout engine answers the evaluation's
prompts (greedy and / or n samples; multi-turn with the tools) and its reward scores them
(`shardwise.engine.evaluate`). Each evaluation is a line of its own at its step (``val/*``,
``time/eval``), a file run.dir/samples/step_XXXXXXX.jsonl and the first
``eval.samples_logged`` rows sent to the trackers. With ``checkpoint.keep_best`` every
evaluation step is also a checkpoint step and best.json (`shardwise.checkpoint.best`) says
which one is the best (in the critic's checkpoints too).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardwise.agents.loop import agent_prompt_batch, trajectory_metrics
from shardwise.checkpoint.best import BEST_FILE, forget_best_after, record_best
from shardwise.checkpoint.layout import CHECKPOINTS_DIR, resume_line
from shardwise.config.schema import Config
from shardwise.config.validate import mesh_spec, rl_update_groups
from shardwise.data.batch import Batch
from shardwise.data.chat import text_prompts_as_chat
from shardwise.data.rewards import ContainedReward, RewardFn, score_sequences
from shardwise.data.sampler import GlobalBatchSampler
from shardwise.data.tokenizer import pad_token_id
from shardwise.engine.evaluate import EvalPlan, evaluate, extract_fn, is_eval_step, write_samples
from shardwise.engine.generate import prompt_batch, sample_keys
from shardwise.models.vision import VisionInputs
from shardwise.registry import ADVANTAGE_ESTIMATORS
from shardwise.rl import algorithms as alg
from shardwise.rl import distill
from shardwise.rl.algorithms.user import UserFunctionError, resolve_estimator
from shardwise.rl.cluster import RayWorkerGroup, WorkerGroup, init_ray, ray_cpus, worker_groups
from shardwise.rl.local import group_class
from shardwise.rl.workers.hybrid import CRITIC_DIR, RLWorker
from shardwise.rl.workers.reward import RAW_PROMPT, RewardModelInputs, with_model_scores
from shardwise.telemetry import MetricsWriter, PhaseTimer, Progress
from shardwise.telemetry.metrics import read_metrics
from shardwise.telemetry.startup import StartupClock

log = logging.getLogger(__name__)

__all__ = ["Controller", "concat_rounds", "drop_zero_variance_groups", "heldout_summary", "mean_timing",
           "merge_reward_metrics", "worker_groups"]


class Controller:
    """The single controller (see the module docstring).

    `records` are the prompts (with their ground truths), `tokenizer` and its folder the
    run's, `reward_fn` the rule-based reward (None: the reward model alone). `eval_plan`:
    what the evaluation asks and how often (`shardwise.jobs.inputs.check_eval`; None: no
    evaluation), scored by `eval_scorer`. Nothing is started until `start`.
    """

    def __init__(self, cfg: Config, world_size: int, records: list[dict[str, Any]], tokenizer,
                 tokenizer_dir: str, reward_fn: RewardFn | None, vision: VisionInputs | None = None,
                 schemas: list[dict] | None = None, eval_plan: EvalPlan | None = None,
                 eval_scorer: RewardFn | None = None):
        self.cfg = cfg
        self.world_size = world_size
        self.run_dir = Path(cfg.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(by_alias=True, mode="json"), indent=2))
        self.tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self.pad_id = pad_token_id(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.records = records
        self.sampler = GlobalBatchSampler(len(self.records), cfg.train.global_batch_size, cfg.run.seed)
        self._batches = iter(self.sampler)
        self.reward_fn = reward_fn
        self.rm_inputs = RewardModelInputs.needed(cfg.rl.reward.model, tokenizer)
        """A reward model with a tokenizer of its own reads each row re-rendered for it
        (None: it reads the policy's ids)."""
        if self.rm_inputs is not None:
            log.info("rl.reward.model %s has a tokenizer of its own: each row is re-rendered for it",
                     cfg.rl.reward.model)
        self.vision = vision
        """A VL policy's image encoder: prompts carry their images (`shardwise.models.vision`)."""
        self.schemas = schemas if cfg.rl.multi_turn.enabled else None
        """rl.multi_turn: the tools' schemas; prompts are chats rendered with them
        (`shardwise.agents.loop.agent_prompt_batch`) and the workers roll out trajectories."""
        self.eval_plan, self.eval_scorer = eval_plan, eval_scorer
        self.eval_extract = extract_fn(eval_plan.reward) if eval_plan is not None else None
        """The answer maj@k votes on: an ``extract`` beside a module:function reward."""
        self.evaluations: list[tuple[int, dict[str, float], dict[str, dict[str, float]]]] = []
        """Every evaluation of this process so far: (step, its ``val/*`` and ``time/eval``,
        its `heldout_tools`), oldest first (`heldout_summary` reads the first and last)."""
        self._eval_engine: dict[str, float] = {}
        """The engine's figures of the running evaluation's generate calls (`_keep_push`)."""
        self.heldout_tools: dict[str, dict[str, float]] = {}
        """rl.multi_turn: the trajectory figures (`trajectory_metrics`: ``tools/share``,
        ``tools/calls_per_trajectory``, ...) of the last evaluation, under "greedy" and
        "sampled" (its two passes)."""
        k = cfg.rl.kl_in_reward
        self.kl_ctl = alg.kl_controller(k.controller, k.coef, k.target, k.horizon)
        self.estimator = resolve_estimator(cfg.rl.advantage)
        self.needs_baseline = ":" not in cfg.rl.advantage and ADVANTAGE_ESTIMATORS.traits(cfg.rl.advantage).get(
            "needs_baseline", False)
        a = cfg.rl.actor
        self.on_policy_shortcut = (a.on_policy_shortcut and a.ppo_epochs == 1 and a.ppo_mini_batches == 1
                                   and not cfg.rl.kl_in_reward.enabled and a.off_policy.correction != "decoupled")
        """No old-log-prob forward: the update is on-policy (`ActorWorker.update_actor`; with
        off_policy tis its ratio is against the rollout's log-probs anyway). Never with
        off_policy decoupled, whose proximal policy is the recomputed old log-probs."""
        self.dp_size = mesh_spec(cfg.parallel, world_size).dp_size
        self.step = 0
        self.groups: dict[str, WorkerGroup] = {}

    # -- the worker groups
    def start(self, clock: StartupClock | None = None) -> None:
        """Start Ray (`rl.backend` ray) and the worker groups; with `clock`, laps ``ray`` and
        ``worker_groups`` (the parts the workers timed moved out of it: `_split_startup`)."""
        clock = clock or StartupClock()
        self._start_scorers()
        plan = worker_groups(self.cfg)
        group_cls = group_class(self.cfg)
        if group_cls is RayWorkerGroup:
            init_ray(num_cpus=ray_cpus(self.cfg, self.world_size))
            clock.lap("ray")
        cfg_dict = self.cfg.model_dump(by_alias=True, mode="json")
        for name, roles in plan.items():
            self.groups[name] = group_cls(RLWorker, self.world_size, cfg_dict, roles, self.pad_id,
                                          self.eos_id, name=name, sp=self.cfg.parallel.ulysses_size,
                                          log_dir=self.run_dir / "logs")
        # Where each rank runs (node id, address, pid): on a cluster, the first thing to
        # know when a node misbehaves.
        (self.run_dir / "workers.json").write_text(json.dumps(
            {name: g.places_dict() for name, g in self.groups.items()}, indent=2))
        clock.lap("worker_groups")
        self._split_startup(clock)

    def _split_startup(self, clock: StartupClock) -> None:
        """Move what the workers timed (the model loads, the engine: `RLWorker.startup_seconds`)
        out of ``worker_groups``: per part, the slowest rank's seconds, summed over the groups
        (groups start one after the other); what is left is Ray's actors, the workers'
        imports and their process groups."""
        parts: dict[str, float] = {}
        for g in self.groups.values():
            for part, seconds in _slowest_rank(g.startup_seconds()).items():
                parts[part] = parts.get(part, 0.0) + seconds
        clock.split("worker_groups", parts)

    def _start_scorers(self) -> None:
        """The contained reward functions (the job's, the evaluation's when another): their
        processes import the functions while Ray starts."""
        for fn in self._scorers():
            fn.start()

    def _scorers(self) -> list[ContainedReward]:
        fns = [self.reward_fn] + [self.eval_scorer] * (self.eval_scorer is not self.reward_fn)
        return [fn for fn in fns if isinstance(fn, ContainedReward)]

    def push_weights(self) -> dict[str, float]:
        """The first push of the actor's weights into a rollout engine that keeps its own
        (vLLM), before anything generates; {} for an engine that shares the actor's."""
        return self.group.push_weights()

    @property
    def group(self) -> WorkerGroup:
        """The hybrid engine's group (actor, rollout, reference)."""
        return self.groups["rl"]

    def group_of(self, role: str) -> WorkerGroup:
        """The group hosting `role`."""
        for name, roles in worker_groups(self.cfg).items():
            if role in roles:
                return self.groups[name]
        raise KeyError(role)

    def close(self, graceful: bool = True) -> None:
        """Release the worker groups; not graceful after an error (workers may be stuck in
        a collective, a teardown barrier would wait for them)."""
        for fn in self._scorers():  # with whatever they started
            fn.close()
        for g in self.groups.values():
            g.shutdown(graceful=graceful)
        self.groups = {}

    # -- state
    def state_dict(self) -> dict[str, Any]:
        k = self.cfg.rl.kl_in_reward
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_coef": self.kl_ctl.value,
                "kl_start": [k.controller, k.coef]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self._batches = iter(self.sampler)
        # The adaptive controller's coefficient goes on from where it was, unless the
        # controller or its starting coef changed since (``rl.kl_in_reward`` applies on resume,
        # `shardwise.jobs.resume`); a fixed one is the config's (it used to keep the saved coef).
        k = self.cfg.rl.kl_in_reward
        if k.controller == "adaptive" and state.get("kl_start", ["adaptive", k.coef]) == ["adaptive", k.coef]:
            self.kl_ctl.value = float(state["kl_coef"])

    def resume(self) -> bool:
        extras = {name: g.load_checkpoint() for name, g in self.groups.items()}
        steps = {name: None if e is None else e["step"] for name, e in extras.items()}
        if len(set(steps.values())) > 1:
            raise RuntimeError(f"the worker groups' checkpoints are at different steps {steps}; "
                               "set checkpoint.resume to one step's folder or never")
        if extras["rl"] is None:
            for folder in self._checkpoint_roots():  # a fresh start: an earlier run's record is not this run's
                (folder / CHECKPOINTS_DIR / BEST_FILE).unlink(missing_ok=True)
            return False
        self.load_state_dict(extras["rl"])
        if self.cfg.checkpoint.keep_best is not None:  # a best found after this step is gone with its step
            for folder in self._checkpoint_roots():
                forget_best_after(folder, self.step)
        return True

    def _checkpoint_roots(self) -> list[Path]:
        """The folders whose ``checkpoints/`` this run saves into: run.dir (the actor) and,
        with a critic, run.dir/critic (`shardwise.rl.workers.hybrid.CRITIC_DIR`)."""
        return [self.run_dir] + [self.run_dir / CRITIC_DIR] * self.cfg.rl.critic.enabled

    def save(self, final: bool) -> None:
        for g in self.groups.values():
            g.save_checkpoint(self.step, self.state_dict(), final)

    def should_save(self, step: int) -> bool:
        """Every ``checkpoint.every_steps``, the last step and, with ``checkpoint.keep_best``,
        every evaluation step (the best must have a checkpoint)."""
        max_steps = self.cfg.train.max_steps
        plan = self.eval_plan
        return _should_save(self.cfg, step, max_steps) or (
            self.cfg.checkpoint.keep_best is not None and plan is not None
            and is_eval_step(step, plan.every_steps, max_steps))

    def wait_checkpoints(self) -> None:
        for g in self.groups.values():
            g.wait_checkpoint()

    # -- one step
    def next_prompts(self, round_: int = 0, step: int | None = None) -> Batch:
        """The sampler's next global batch of prompts, each repeated rl.rollout.n times, with
        the sampling seed of this step's sampling round `round_` (0, then 1, 2, ... for the
        refills of ``rl.filter_groups_refill``). A prompt's uid names its group; each row's
        ``sample_key`` ("{uid}/{j}") seeds its sampling, whichever rank generates it. `step`:
        the step they are for (default the current one; the asynchronous run draws ahead)."""
        step = self.step if step is None else step
        indices = next(self._batches)
        tag = str(step) if round_ == 0 else f"{step}.{round_}"
        uids = [f"{tag}-{i}" for i in range(len(indices))]
        batch = self.prompt_batch([self.records[i] for i in indices], uids)
        batch = batch.repeat(self.cfg.rl.rollout.n, interleave=True)
        batch = batch.union(Batch.from_dict(arrays={"sample_key": sample_keys(uids, self.cfg.rl.rollout.n)}))
        batch.meta["seed"] = self.cfg.run.seed * 1_000_003 + step + round_ * _ROUND_SEED
        return batch

    def prompt_batch(self, records: list[dict[str, Any]], uids: list[str]) -> Batch:
        """The prompt batch of `records`: `prompt_batch`, or with rl.multi_turn chats
        rendered with the tools' schemas (`agent_prompt_batch`)."""
        if self.schemas is not None:
            batch = agent_prompt_batch(self.tokenizer, records, self.cfg.data.max_length, uids, self.schemas)
        else:
            batch = prompt_batch(self.tokenizer, records, self.cfg.data.max_length, uids, self.vision)
        if self.rm_inputs is not None:  # what the reward model's own rendering starts from
            batch = batch.union(Batch.from_dict(arrays={RAW_PROMPT: [r["prompt"] for r in records]}))
        return batch

    def score(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``token_level_scores`` (rule-based reward plus reward-model score, each at the
        last response token: with multi-turn rollouts the last token the model generated)
        and the reward metrics. Multi-turn rows are scored by `score_sequences` on their
        final answer: an environment's ``env_reward`` takes the reward function's place, and
        with rl.multi_turn.truncated_reward a truncated trajectory gets that value."""
        mask = batch.tensors["response_mask"].bool()
        scores = torch.zeros(mask.shape, dtype=torch.float32)
        metrics: dict[str, float] = {}
        last = _last_token_index(mask)
        has = mask.any(-1)
        rows = torch.arange(len(batch))[has]
        rule = rm = None
        by_function = self.cfg.rl.reward.combine == "function"
        if self.cfg.rl.reward.model is not None:
            rm_batch = batch if self.rm_inputs is None else self.rm_inputs.batch(batch, self.tokenizer)
            rm = self.group_of("reward_model").compute_rm_score(rm_batch).tensors["rm_scores"].float()
            metrics["reward/model_mean"] = float(rm.mean())
        if self.reward_fn is not None or self.schemas is not None:  # multi-turn: the environment may score alone
            truncated = self.cfg.rl.multi_turn.truncated_reward if self.schemas is not None else None
            to_score = with_model_scores(batch, rm) if by_function else batch
            scored = score_sequences(to_score, self.tokenizer, self.reward_fn, self.cfg.rl.reward.timeout_s,
                                     truncated_reward=truncated)
            rule = scored.tensors["token_level_scores"].sum(-1)
            metrics |= {k: v for k, v in scored.meta["metrics"].items()  # a function's own metrics (dict returns)
                        if not k.startswith("reward/score_") and k != "reward/empty_responses"}
        if rule is not None:
            scores[rows, last[has]] += rule[has]
            metrics["accuracy"] = float((rule >= 1.0).float().mean())
            metrics["reward/rule_mean"] = float(rule.mean())
        if rm is not None and not by_function:
            scores[rows, last[has]] += rm[has]
        ov = self.cfg.rl.reward.overlong
        if ov.enabled:  # DAPO's soft overlong punishment, on the response's length in tokens
            budget = (self.cfg.rl.multi_turn.max_response_tokens if self.cfg.rl.multi_turn.enabled
                      else self.cfg.rl.rollout.max_new_tokens)
            excess = mask.sum(-1).float() - (budget - ov.buffer_len)
            penalty = torch.clamp(-excess / ov.buffer_len * ov.penalty_factor, max=0.0)
            scores[rows, last[has]] += penalty[has]
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
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
        if rl.distill.teacher is not None and rl.distill.mode == "reward":
            rewards = rewards + distill.reward_term(t, rl.distill.coef)
        if rl.kl_in_reward.enabled:
            rewards, kl = alg.apply_kl_in_reward(rewards, t["old_log_probs"], t["ref_log_probs"], mask,
                                                 self.kl_ctl.value, rl.kl_in_reward.type)
            self.kl_ctl.update(kl, len(batch))
            metrics["kl_in_reward/coef"] = self.kl_ctl.value
        try:
            adv, returns = alg.call_estimator(self.estimator, rewards, mask, values=t.get("values"),
                                              group_ids=list(batch.arrays["uid"]), gamma=rl.gamma, lam=rl.lam,
                                              norm_adv_by_std=rl.norm_adv_by_std,
                                              reward_baselines=t.get("reward_baselines"))
        except Exception as e:
            if ":" not in rl.advantage:
                raise
            raise UserFunctionError("rl.advantage", f"{rl.advantage} raised {type(e).__name__}: {e}",
                                    "fix the function") from e
        if ":" in rl.advantage and not (isinstance(adv, torch.Tensor) and adv.shape == mask.shape
                                        and isinstance(returns, torch.Tensor) and returns.shape == mask.shape):
            raise UserFunctionError("rl.advantage", f"{rl.advantage} returned advantages / returns not of the "
                                    f"batch's shape {tuple(mask.shape)}", "return two (batch, response_len) tensors")
        metrics["advantages/abs_mean"] = float(alg.masked_mean(adv.abs(), mask))
        return batch.union(Batch.from_dict({"token_level_rewards": rewards, "advantages": adv,
                                            "returns": returns})), metrics

    def rollout(self, timer: PhaseTimer, metrics: dict[str, float], round_: int = 0) -> tuple[Batch, dict[str, float]]:
        """One sampling round: the next prompts generated and scored; returns the scored
        batch and its reward metrics. The engine's own figures (the weight push before
        generating, only in the round that pushes) go to `metrics`: the slowest rank's."""
        prompts = self.next_prompts(round_)
        with timer("generate"):
            batch = self.group.generate_sequences(prompts)
        engine_metrics(batch, metrics)
        with timer("reward"):
            batch, scored = self.score(batch)
        if self.needs_baseline:  # REMAX: the reward of a greedy answer to each row's prompt
            prompts.meta["greedy"] = True  # on the generation engine, counted in time/generate_baseline
            with timer("generate_baseline"):
                base = self.group.generate_sequences(prompts)
            with timer("reward_baseline"):
                base, _ = self.score(base)
            batch = batch.union(Batch.from_dict({"reward_baselines": base.tensors["token_level_scores"].sum(-1)}))
        return batch, scored

    def sample(self, timer: PhaseTimer, metrics: dict[str, float]) -> Batch:
        """The step's rows for the update, after ``rl.filter_groups`` (see `RLConfig`).

        Without filtering: one round, every row. With it: the groups whose rewards are all
        equal leave; with refill, more rounds (at most ``filter_groups_max_rounds``) until
        ``train.global_batch_size`` groups are kept; the kept groups, in sampling order,
        cut to at most ``global_batch_size`` and to what splits evenly over the
        data-parallel ranks and mini-batches (`rl_update_groups`). May return no rows.

        Adds to `metrics`: the reward metrics and ``response_length/*`` over every sample
        generated this step (all rounds: the curves stay comparable with filtering off);
        with filtering ``filter/kept_groups`` (groups in the update), ``/dropped_groups``
        (zero reward variance), ``/trimmed_groups`` (kept but beyond what the update takes),
        ``/rounds`` (extra sampling rounds) and ``/kept_reward_mean`` (``reward/mean`` over
        the update's rows)."""
        rl = self.cfg.rl
        batch, m = self.rollout(timer, metrics, 0)
        generated, scored = [batch], [m]
        if rl.filter_groups != "none":
            n, wanted = rl.rollout.n, self.cfg.train.global_batch_size
            kept = [drop_zero_variance_groups(batch)]
            have = len(kept[0]) // n
            while rl.filter_groups_refill and have < wanted and len(generated) <= rl.filter_groups_max_rounds:
                batch, m = self.rollout(timer, metrics, len(generated))
                generated.append(batch)
                scored.append(m)
                kept.append(drop_zero_variance_groups(batch))
                have += len(kept[-1]) // n
            take = rl_update_groups(min(have, wanted), n, self.dp_size, rl.actor.ppo_mini_batches)
            batch = concat_rounds(kept, self.pad_id)[:take * n]
            metrics["filter/kept_groups"] = float(take)
            metrics["filter/dropped_groups"] = float(sum(len(b) for b in generated) // n - have)
            metrics["filter/trimmed_groups"] = float(have - take)
            metrics["filter/rounds"] = float(len(generated) - 1)
            if take:
                metrics["filter/kept_reward_mean"] = float(batch.tensors["token_level_scores"].sum(-1).mean())
        metrics.update(merge_reward_metrics(generated, scored))
        # model tokens only: a multi-turn row's tool turns are outside its response_mask
        lengths = torch.cat([b.tensors["response_mask"].sum(-1) for b in generated]).float()
        metrics["response_length/mean"] = float(lengths.mean())
        if self.schemas is not None:  # clipped: the trajectory ran out of tokens or turns
            metrics["response_length/clip_frac"] = float(sum(bool(x) for b in generated for x in b.arrays["truncated"])
                                                         / max(sum(len(b) for b in generated), 1))
            metrics.update(trajectory_metrics(generated))
        else:
            metrics["response_length/clip_frac"] = float((lengths >= rl.rollout.max_new_tokens).float().mean())
        return batch

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        timer = PhaseTimer(synchronize=False)
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        dispatch_before = sum(gr.dispatch_s for gr in self.groups.values())
        batch = self.sample(timer, metrics)
        if len(batch):
            self.update(batch, timer, metrics)
        else:
            log.warning("step %d: no update: rl.filter_groups=%s dropped %d groups and the %d kept do not split "
                        "over the data-parallel ranks and mini-batches", self.step + 1, self.cfg.rl.filter_groups,
                        metrics["filter/dropped_groups"], metrics["filter/trimmed_groups"])
        if self.cfg.rl.filter_groups != "none":
            metrics["filter/skipped_update"] = float(not len(batch))
        self.step += 1
        max_steps = self.cfg.train.max_steps
        if self.should_save(self.step):
            with timer("checkpoint"):
                self.save(final=self.step == max_steps)
        metrics.update(timer.as_dict())
        # inside the phases above: the step's controller <-> worker data movement
        metrics["time/dispatch"] = sum(gr.dispatch_s for gr in self.groups.values()) - dispatch_before
        metrics["time/step"] = time.perf_counter() - t0
        return metrics

    def update(self, batch: Batch, timer: PhaseTimer, metrics: dict[str, float]) -> None:
        """Old log-probs, reference, values, advantages and the updates on the step's
        scored rows (``entropy``, ``kl`` and the update metrics are over these rows)."""
        rl = self.cfg.rl
        g = self.group
        mask = batch.tensors["response_mask"].bool()
        if not self.on_policy_shortcut:
            with timer("old_log_prob"):
                batch = batch.union(g.compute_log_prob(batch))
            metrics["entropy"] = float(alg.masked_mean(batch.tensors["entropy"], mask))
            metrics.update(alg.rollout_mismatch(batch.tensors["old_log_probs"], batch.tensors["rollout_log_probs"],
                                                mask))
        if rl.reference.enabled:
            batch = self.reference_log_probs(batch, timer, metrics)
            if rl.distill.teacher is not None:  # the reference is the teacher (shardwise.rl.distill)
                metrics.update(distill.metrics(batch.tensors))
                metrics["time/teacher"] = timer.as_dict().get("time/ref", 0.0)
            if not self.on_policy_shortcut:
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
        # The update's real tokens, the share of its rows' padded (B, T) layout that is
        # padding (what forwards without rl.packing compute for nothing), and its speed.
        real = int(batch.tensors["attention_mask"].sum())
        metrics["batch/tokens"] = float(real)
        metrics["batch/padding_share"] = 1.0 - real / max(batch.tensors["attention_mask"].numel(), 1)
        seconds = timer.as_dict().get("time/update_actor", 0.0)
        if seconds > 0:
            metrics["perf/update_tokens_per_s"] = real * rl.actor.ppo_epochs / seconds
        if self.step < rl.record_batches:
            folder = self.run_dir / "batches"
            folder.mkdir(exist_ok=True)
            (folder / f"step_{self.step + 1:08d}.batch").write_bytes(batch.to_bytes())

    def reference_log_probs(self, batch: Batch, timer: PhaseTimer, metrics: dict[str, float]) -> Batch:
        """`batch` with ``ref_log_probs`` on every row: the reference's forward on the rows
        that do not have them yet. The asynchronous run's generator may have scored some or
        all where it generated them (``rl.async.reference_on``; ``arrays["ref_scored"]``
        says which, and goes: ``async/reference_share`` is their share)."""
        scored = batch.arrays.get("ref_scored")
        if scored is not None:
            batch = Batch(batch.tensors, {k: v for k, v in batch.arrays.items() if k != "ref_scored"}, batch.meta)
            metrics["async/reference_share"] = float(np.mean(scored)) if len(scored) else 0.0
        if "ref_log_probs" in batch.tensors and (scored is None or bool(np.all(scored))):
            return batch
        with timer("ref"):
            if "ref_log_probs" not in batch.tensors:
                return batch.union(self.group.compute_ref_log_prob(batch))
            rest = np.flatnonzero(~np.asarray(scored, dtype=bool))
            ref = batch.tensors["ref_log_probs"].clone()
            ref[torch.from_numpy(rest)] = self.group.compute_ref_log_prob(batch[rest]).tensors["ref_log_probs"]
            return Batch({**batch.tensors, "ref_log_probs": ref}, batch.arrays, batch.meta)

    def fit(self, writer: MetricsWriter, startup: dict[str, float] | None = None) -> list[dict[str, float]]:
        """Steps until ``train.max_steps`` (from wherever `resume` left the controller), with
        the progress bar and one line per logged step to `writer` (opened after `resume`,
        with ``after_step=self.step``; the caller closes it); returns every step's metrics.
        `startup` (``time/startup/*``) joins the first step's line, not the history. After
        each evaluation step (``eval.every_steps`` and the last; `is_eval_step`) the policy
        is evaluated (`run_evaluation`: its own line)."""
        max_steps = self.cfg.train.max_steps
        bar = Progress(total=max_steps, enabled=True, desc=self.cfg.rl.algorithm, initial=self.step)
        history: list[dict[str, float]] = []
        pending = dict(startup or {})
        plan = self.eval_plan
        val: dict[str, float] = {}
        try:
            while self.step < max_steps:
                m = self.train_step()
                history.append(m)
                if self.step % self.cfg.train.log_every == 0 or self.step == max_steps:
                    writer.log(self.step, {**m, **pending})
                    pending = {}
                if plan is not None and is_eval_step(self.step, plan.every_steps, max_steps):
                    val = _bar_figures(self.run_evaluation(writer))
                bar.update(1, reward=m["reward/mean"], **({"acc": m["accuracy"]} if "accuracy" in m else {}), **val)
            self.wait_checkpoints()
        finally:
            bar.close()
        return history

    # -- evaluation
    def run_evaluation(self, writer: MetricsWriter, record: bool = True) -> dict[str, float]:
        """Evaluate the current policy (step `self.step`) on the plan's prompts through the
        rollout engine (`shardwise.engine.evaluate.evaluate`: greedy and sampled passes,
        multi-turn with the tools, scored by the evaluation's reward within
        ``rl.reward.timeout_s``). With `record` (False: a resumed run's step the run before
        already recorded): write its samples to run.dir/samples/step_XXXXXXX.jsonl, its
        metrics (``val/*``, ``time/eval``) to `writer` as a line of their own and its first
        ``eval.samples_logged`` rows to the trackers; with ``checkpoint.keep_best``, record
        whether this step is the best so far. Returns the metrics."""
        plan = self.eval_plan
        assert plan is not None
        self.heldout_tools, self._eval_engine = {}, {}
        result = evaluate(self._eval_generate(), self.tokenizer, plan, self.eval_scorer, seed=self.cfg.run.seed,
                          max_length=self.cfg.data.max_length, step=self.step, timeout_s=self.cfg.rl.reward.timeout_s,
                          timeout_key="rl.reward.timeout_s", batch_fn=self._eval_batch_fn(), vision=self.vision,
                          chat=text_prompts_as_chat(self.cfg.data), extract=self.eval_extract)
        self.evaluations.append((self.step, dict(result.metrics), dict(self.heldout_tools)))
        if not record:
            return result.metrics
        write_samples(self.run_dir, self.step, result.rows, resume_line)
        # an engine that keeps its own weights took the update's push here, before answering
        writer.log(self.step, {**result.metrics, **self._eval_engine})
        if plan.samples_logged:
            writer.log_samples(self.step, result.rows[:plan.samples_logged])
        metric = self.cfg.checkpoint.keep_best
        if metric is not None:  # each group's checkpoints know their best (prune keeps it)
            new = [record_best(folder, metric, self.step, result.metrics) for folder in self._checkpoint_roots()]
            if any(new):  # this step's save pruned before it was the best: the former best may go now
                for g in self.groups.values():
                    g.prune_checkpoints()
        return result.metrics

    def evaluated_before(self, writer: MetricsWriter) -> bool:
        """Whether `writer`'s file already holds an evaluation's line at this step (a run
        resumed from a step it evaluated at: logged once)."""
        return writer.path.is_file() and any(
            m.get("step") == self.step and "time/eval" in m for m in read_metrics(writer.path))

    def _eval_batch_fn(self):
        """Multi-turn: the evaluation's prompts are asked with the tools (`prompt_batch`)."""
        return self.prompt_batch if self.schemas is not None else None

    def _eval_generate(self):
        """The workers' ``generate_sequences``; multi-turn: it also keeps the trajectories'
        figures in ``heldout_tools["greedy" | "sampled"]`` (the score is the final answer's,
        `shardwise.data.rewards.score_sequences`; this is how it was reached)."""
        def generate(batch: Batch) -> Batch:
            out = self.group.generate_sequences(batch)
            self._keep_push(out)
            if self.schemas is not None:
                self.heldout_tools["greedy" if batch.meta.get("greedy") else "sampled"] = trajectory_metrics(out)
            return out
        return generate

    def _keep_push(self, out: Batch) -> None:
        """The weight push an evaluation's generate made (an engine that keeps its own
        weights, after an update: ``weight_sync/*``, ``time/weight_sync``, the slowest
        rank's), for the evaluation's line: the next step's generate pushes nothing."""
        for name, values in out.meta.pop("metrics", {}).items():
            if name.startswith("weight_sync/") or name == "time/weight_sync":
                value = float(max(values) if isinstance(values, list) else values)
                self._eval_engine[name] = self._eval_engine.get(name, 0.0) + value


def _bar_figures(metrics: dict[str, float]) -> dict[str, float]:
    """The evaluation's headline figures for the progress bar's postfix."""
    out = {}
    if "val/accuracy" in metrics:
        out["val_acc"] = metrics["val/accuracy"]
    elif "val/reward_mean" in metrics:
        out["val_reward"] = metrics["val/reward_mean"]
    return out


def heldout_summary(evaluations: list[tuple[int, dict[str, float], dict[str, dict[str, float]]]]
                    ) -> dict[str, Any]:
    """The summary's figures of the first and the last evaluation (`Controller.evaluations`;
    the last is the first when there was one): ``accuracy_before`` / ``_after`` (greedy
    ``val/accuracy``), ``sampled_before`` / ``_after`` (``{"pass@k": ...}`` of each k),
    ``heldout_tools_before`` / ``_after`` (multi-turn), ``eval`` (the last evaluation's
    metrics) and ``eval_step``; None each where there was no evaluation."""
    if not evaluations:
        return {f"{k}_{w}": None for k in ("accuracy", "sampled", "heldout_tools") for w in ("before", "after")} \
            | {"eval": None, "eval_step": None}
    out: dict[str, Any] = {}
    for when, (_, metrics, tools) in (("before", evaluations[0]), ("after", evaluations[-1])):
        out[f"accuracy_{when}"] = metrics.get("val/accuracy")
        passes = sorted((int(k.removeprefix("val/pass@")), v) for k, v in metrics.items() if k.startswith("val/pass@"))
        out[f"sampled_{when}"] = {f"pass@{k}": v for k, v in passes} or None
        out[f"heldout_tools_{when}"] = tools or None
    out["eval"], out["eval_step"] = evaluations[-1][1], evaluations[-1][0]
    return out


_ROW_METRICS = ("multi_turn/", "tools/")
"""Metrics of a multi-turn rollout's rows, computed over the whole step (`trajectory_metrics`)
rather than taken from one rank's figures."""


def engine_metrics(batch: Batch, metrics: dict[str, float]) -> None:
    """The generating ranks' figures (``batch.meta["metrics"]``, removed from it) added to
    `metrics`: each the slowest rank's; not the rows' multi-turn figures (`_ROW_METRICS`),
    which `Controller.sample` computes over the whole step."""
    for name, values in batch.meta.pop("metrics", {}).items():
        if not name.startswith(_ROW_METRICS):
            metrics[name] = metrics.get(name, 0.0) + float(max(values) if isinstance(values, list) else values)


def _slowest_rank(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The parts of the rank whose parts took longest in all (one rank's parts add up to
    less than the group's start, as the start-up's parts must)."""
    return max(per_rank, key=lambda parts: sum(parts.values()), default={})


def mean_timing(history: list[dict[str, float]]) -> dict[str, float]:
    """Mean seconds of each phase per step (the first step, which warms up, left out when
    there are others); phases that did not run in a step count 0 there."""
    steps = history[1:] if len(history) > 1 else history
    keys = sorted({k for m in steps for k in m if k.startswith("time/")})
    return {k: sum(m.get(k, 0.0) for m in steps) / len(steps) for k in keys} if steps else {}


_ROUND_SEED = 1_000_000_007
"""Added to a step's sampling seed once per refill round: more than any step count, so no
round samples with the seed of another step's round."""

# The sequence-aligned tensors of a scored rollout batch (prompt columns, then response
# columns) and the prompt-only ones: left-padded when rounds of different prompt widths
# are joined. The ids get the pad id, everything else 0 (masked out, position 0).
_SEQ_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs",
             "token_level_scores")
_PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def drop_zero_variance_groups(batch: Batch) -> Batch:
    """`batch` without the groups (rows of one uid) whose sequence scores are all equal."""
    scores = batch.tensors["token_level_scores"].sum(-1)
    return batch[~alg.zero_variance_groups(scores, list(batch.arrays["uid"]))]


def concat_rounds(batches: list[Batch], pad_id: int) -> Batch:
    """The rows of several sampling rounds in one batch: the prompt columns left-padded to
    the widest round's (each round's prompts are as wide as its longest), the response
    columns right-padded to the widest round's (a multi-turn round's responses are as wide
    as its longest trajectory), the rounds' sampling seeds dropped from meta."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.tensors["prompt_ids"].shape[1] for b in batches)
    response = max(b.tensors["input_ids"].shape[1] - b.tensors["prompt_ids"].shape[1] for b in batches)
    padded = []
    for b in batches:
        extra = width - b.tensors["prompt_ids"].shape[1]
        after = response - (b.tensors["input_ids"].shape[1] - b.tensors["prompt_ids"].shape[1])
        tensors = dict(b.tensors)
        for k in (*_SEQ_KEYS, *_PROMPT_KEYS, "responses"):
            if k not in tensors:
                continue
            v = tensors[k]
            fill = pad_id if k in ("input_ids", "prompt_ids", "responses") else 0
            left = extra if k != "responses" else 0
            right = after if k not in _PROMPT_KEYS else 0
            if left or right:
                # right padding's positions go on as generate's own (the row's last position)
                tail = v[:, -1:].expand(-1, right) if k == "position_ids" else \
                    torch.full((v.shape[0], right), fill, dtype=v.dtype)
                tensors[k] = torch.cat([torch.full((v.shape[0], left), fill, dtype=v.dtype), v, tail], dim=1)
        padded.append(Batch(tensors=tensors, arrays=dict(b.arrays),
                            meta={k: v for k, v in b.meta.items() if k != "seed"}))
    return Batch.concat(padded)


def merge_reward_metrics(batches: list[Batch], metrics: list[dict[str, float]]) -> dict[str, float]:
    """The reward metrics of a step's sampling rounds (`Controller.score`'s, per round) as
    if scored at once: means weighted by rows, ``reward/std`` over every row."""
    if len(batches) == 1:
        return metrics[0]
    rows = [len(b) for b in batches]
    out = {}
    for k in sorted({k for m in metrics for k in m}):
        pairs = [(r, m[k]) for r, m in zip(rows, metrics) if k in m]
        out[k] = sum(r * v for r, v in pairs) / max(sum(r for r, _ in pairs), 1)
    seq = torch.cat([b.tensors["token_level_scores"].sum(-1) for b in batches])
    out["reward/std"] = float(seq.std()) if len(seq) > 1 else 0.0
    return out


def _should_save(cfg: Config, step: int, max_steps: int) -> bool:
    every = cfg.checkpoint.every_steps
    return (every > 0 and step % every == 0) or step == max_steps


def _last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last nonzero position of each row (0 for an empty row)."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask, positions, torch.zeros_like(positions)).amax(-1)
