"""Asynchronous RL: a generator group runs ahead of the training group, bounded in staleness.

With ``rl.async.enabled`` the run has two kinds of worker groups: "rl" (the actor, with
the reference, a colocated critic and reward model; no rollout) on ``nproc -
generator_ranks`` ranks, and "gen" (`shardwise.rl.workers.generator.GeneratorWorker`, the
rollout engine over a copy of the policy; with ``rl.async.reference_on`` generator or
balanced also the reference, whose log-probs it adds to each batch it generates, or to a
share of its rows) on ``generator_ranks`` ranks of its own; a
critic or reward model of its own keeps its group as in the synchronous run. Both kinds
start at once. After every update the actor's rank 0 pushes the new weights to the
generator ranks over a collective of their own (`shardwise.distributed.bridge.WeightBridge`,
joined by both sides at once at start-up); the generator swaps them in between batches.

Policy versions: version v is the policy after v updates (a resumed run starts at its
step, v0). The batch that trains in step s (the update that makes version s + 1) comes
from a version >= s - max_staleness (S). Each generated row carries its version
(``arrays["version"]``); its staleness when it trains is s - version.

The loop (`AsyncController.rollout`, then the synchronous `Controller.update`):

- throttle (default; AReaL's capacity rule): at the start of step s, generation is submitted
  for every step t <= s + S not submitted yet, asking for version ``max(v0, t - S)``: the
  generator waits (bounded) until it holds that version, so nothing it generates is ever too
  old and nothing is thrown away. With S = 0 each step's generation waits for the previous
  update: the same prompts, seeds, samples, metrics and weights as the synchronous run on
  as many training ranks.
- drop: generation is submitted as far (t <= s + S) but never waits for weights (it asks
  only for v0): the generator makes it from the newest version it holds, and the rows of
  step s older than S versions when s trains are dropped (``async/dropped``) and generated
  again from version s - S or newer. (It was submitted one step further, t <= s + S + 1:
  at step s the newest version is s, so a generator that kept up made that batch S + 1
  versions old, and every step from the third on dropped its whole batch; issue 50.)

Then the trainer waits for step s's batch (``time/trainer_wait``), scores it, updates, and
publishes version s + 1 (``time/publish``: gathering the full weights; the push itself runs
in the background and overlaps the next generation).

Metrics, besides the synchronous run's: ``async/staleness_mean``, ``async/staleness_max``
(over the step's rows), ``async/dropped`` (rows dropped as too old), ``time/trainer_wait``,
``time/publish``; from the generator ``time/generate`` (its seconds generating the batch,
beside the trainer's step, not a phase of it), ``time/generator_wait`` (its idle time since its
previous batch plus its wait for weights), ``time/weight_sync`` (swapping weights in) and,
with the reference on the generator, ``time/generator_ref`` (its reference forward) and
``async/reference_share`` (the share of the step's rows it scored); from the actor
``time/weight_gather`` and ``weight_sync/bytes``; the ``off_policy/*`` figures of
``rl.actor.off_policy``.

Checkpoints hold, besides the synchronous run's state, the policy version, the steps in
flight (submitted, not trained yet) and the reference's share on the generator; the
sampler position saved is the one before the first of those steps drew its prompts. A resumed run generates the steps that were in flight
again, from the checkpoint's weights, with the same prompts and sampling seeds: at
max_staleness 0 nothing was in flight and the resumed run equals the uninterrupted one; at
S > 0 those steps now come from a newer policy than they would have (staleness 0 instead of
up to S), so the resumed run is a valid, not an identical, continuation.

Faults: every wait on the other side (a batch, the weight push, the bridge's set-up, the
held-out evaluation) is bounded by ``rl.async.timeout_s`` and ends in one line naming the
group, the ranks and what they were doing: the workers bound their own waits (a generator
for a policy version, the bridge for a join or a push) by it, and the controller waits
`MARGIN_S` longer for their answer, so that the worker's line, which says what it waited
for, comes first. A rank that dies ends the run within seconds with one line naming its
group, rank, pid and call (`shardwise.rl.cluster`), and the CLI adds the last checkpoint.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shardwise.config.schema import Config
from shardwise.config.validate import rl_train_ranks
from shardwise.data.batch import Batch
from shardwise.data.rewards import RewardFn
from shardwise.engine.evaluate import EvalPlan
from shardwise.models.vision import VisionInputs
from shardwise.rl.cluster import Pending, RayWorkerGroup, WorkerError, WorkerGroup, gpus_for, init_ray
from shardwise.rl.local import group_class, local_gpus
from shardwise.rl.trainer import Controller, _slowest_rank, concat_rounds, engine_metrics, worker_groups
from shardwise.rl.workers.generator import GeneratorWorker, reference_on_generator
from shardwise.rl.workers.hybrid import RLWorker
from shardwise.telemetry import PhaseTimer
from shardwise.telemetry.startup import StartupClock

log = logging.getLogger(__name__)

__all__ = ["AsyncController", "async_worker_groups", "rebalanced_share"]

MARGIN_S = 30.0
"""The controller waits this much longer than ``rl.async.timeout_s`` for a call whose worker
bounds its own wait by the same timeout: the worker's line (which names what it waited for)
comes first."""
PROBE_S = 10.0
"""After the weight push failed, how long the controller waits for the generator group to
show whether one of its ranks died (Ray reports a dead process within a second or two)."""


def async_worker_groups(cfg: Config) -> dict[str, list[str]]:
    """Worker groups of an asynchronous run, name -> roles: the synchronous run's without
    the rollout, and "gen" (the generator)."""
    groups = worker_groups(cfg)
    # reference_on generator moves the reference; balanced has both sides score a share of the rows
    moved = {"rollout", "ref"} if cfg.rl.async_.reference_on == "generator" else {"rollout"}
    groups["rl"] = [r for r in groups["rl"] if r not in moved]
    groups["gen"] = ["generator", "ref"] if reference_on_generator(cfg) else ["generator"]
    return groups


def rebalanced_share(share: float, generator_wait: float, trainer_wait: float, reference_s: float) -> float:
    """The share of a batch's rows whose reference forward the generator runs
    (``reference_on: balanced``), moved after a step in which the generator waited
    `generator_wait` seconds, the trainer `trainer_wait`, and the reference's forward took
    `reference_s` on both sides together: moving a share d of the rows moves about
    d x `reference_s` seconds of work from one side to the other, so half the wait
    difference (which would even the waits) is d = (generator_wait - trainer_wait) / (2 x
    reference_s); a quarter of that is taken, as the batches the change reaches are up to
    `max_staleness` steps ahead of the waits measured, and one step's waits are noisy.
    Within [0, 1]."""
    if reference_s <= 0:
        return share
    return min(1.0, max(0.0, share + 0.25 * (generator_wait - trainer_wait) / (2.0 * reference_s)))


class AsyncController(Controller):
    """The single controller of an asynchronous run (see the module docstring). `world_size`
    is every rank of the run; the training groups get ``world_size - generator_ranks``."""

    def __init__(self, cfg: Config, world_size: int, records: list[dict[str, Any]], tokenizer,
                 tokenizer_dir: str, reward_fn: RewardFn | None, vision: VisionInputs | None = None,
                 schemas: list[dict] | None = None, eval_plan: EvalPlan | None = None,
                 eval_scorer: RewardFn | None = None):
        train = rl_train_ranks(cfg, world_size)
        super().__init__(cfg, train, records, tokenizer, tokenizer_dir, reward_fn, vision, schemas, eval_plan,
                         eval_scorer)
        a = cfg.rl.async_
        self.generator_ranks = world_size - train
        self.max_staleness, self.timeout_s, self.on_stale = a.max_staleness, a.timeout_s, a.on_stale
        self.gen: WorkerGroup | None = None
        self.first_version = 0
        """v0: the policy version the run started from (its step)."""
        self.version = 0
        """The newest version published to the generator."""
        self.in_flight: dict[int, tuple[Pending, Batch]] = {}
        """Step -> (its generation, its prompts), for steps submitted and not trained yet."""
        self._next_step = 0
        self._sampler_at: dict[int, dict[str, int]] = {}
        """The sampler's position before step t drew its prompts (what a checkpoint saves)."""
        self._published = False
        """Whether this step published its version (a step without an update did not)."""
        self.reference_share = (0.0 if not reference_on_generator(cfg)
                                else 1.0 if a.reference_on == "generator" else 0.5)
        """The share of each batch's rows (the first of each generator rank's) whose
        reference log-probs the generator adds (``rl.async.reference_on``: actor 0, generator 1, balanced moved
        after every step by `rebalanced_share`); the actor scores the rest."""

    # -- the worker groups
    def start(self, clock: StartupClock | None = None) -> None:
        """Start Ray (`rl.backend` ray), then the training groups and the generator group at once."""
        clock = clock or StartupClock()
        self._start_scorers()
        plan = async_worker_groups(self.cfg)
        ranks = self.world_size * (len(plan) - 1) + self.generator_ranks  # = ray_cpus of the whole run
        group_cls = group_class(self.cfg)
        if group_cls is RayWorkerGroup:
            init_ray(num_cpus=ranks)
            clock.lap("ray")
        cfg_dict = self.cfg.model_dump(by_alias=True, mode="json")
        logs = self.run_dir / "logs"
        # GPUs for every rank of every group, or none: a group started first must not leave
        # the other waiting for the devices it took
        gpu = gpus_for(ranks) if group_cls is RayWorkerGroup else local_gpus() >= ranks

        def build(name: str, roles: list[str]) -> WorkerGroup:
            if name == "gen":
                return group_cls(GeneratorWorker, self.generator_ranks, cfg_dict, self.pad_id, self.eos_id,
                                 name=name, use_gpu=gpu, log_dir=logs)
            return group_cls(RLWorker, self.world_size, cfg_dict, roles, self.pad_id, self.eos_id, name=name,
                             sp=self.cfg.parallel.ulysses_size, use_gpu=gpu, log_dir=logs)

        with ThreadPoolExecutor(len(plan)) as pool:
            started = {name: pool.submit(build, name, roles) for name, roles in plan.items()}
        failed: BaseException | None = None
        for name, f in started.items():
            try:
                g = f.result()
            except BaseException as e:  # noqa: BLE001 - the first group's error is raised below
                failed = failed or e
                continue
            if name == "gen":
                self.gen = g
            else:
                self.groups[name] = g
        if failed is not None:
            self.close(graceful=False)
            raise failed
        assert self.gen is not None
        (self.run_dir / "workers.json").write_text(json.dumps(
            {name: g.places_dict() for name, g in self.all_groups().items()}, indent=2))
        clock.lap("worker_groups")
        self._split_startup(clock)

    def all_groups(self) -> dict[str, WorkerGroup]:
        """The training groups and the generator group."""
        return {**self.groups, **({"gen": self.gen} if self.gen is not None else {})}

    def _split_startup(self, clock: StartupClock) -> None:
        """As `Controller._split_startup`, but the groups started at once: the parts of the
        rank, of any group, whose parts took longest in all (the start-up's critical path)."""
        clock.split("worker_groups", _slowest_rank([parts for g in self.all_groups().values()
                                                    for parts in g.startup_seconds()]))

    def push_weights(self) -> dict[str, float]:
        """The weight bridge between the actor's rank 0 and the generator ranks (both sides
        join at once), then the first push: the run's starting policy, version v0; its
        metrics."""
        assert self.gen is not None
        addr, port = self.group.bridge_address()
        world = 1 + self.generator_ranks
        joins = [g.submit("bridge_join", addr, port, world, self.timeout_s) for g in (self.group, self.gen)]
        for p in joins:
            p.result(self.timeout_s + MARGIN_S, what="joining the weight bridge")
        return self.publish(self.step)

    def publish(self, version: int) -> dict[str, float]:
        """The actor's weights to the generator as `version` (gathered now, sent in the
        background); the gather's metrics."""
        try:
            out = self.group.submit("publish_weights", version).result(
                self.timeout_s + MARGIN_S, what=f"publishing the weights of version {version}")
        except WorkerError as e:
            lost = self._generator_lost()
            if lost is not None:  # the push broke because a generator rank died: name that rank
                raise lost from e
            raise
        self.version = version
        return dict(out or {})

    def _generator_lost(self) -> WorkerError | None:
        """After a push failed: the generator group's own line when one of its ranks is dead
        (its process gone: "worker group 'gen' lost rank R in ... died (killed by SIGKILL)"),
        found through the generations in flight, or a cheap call when none is; None when
        its ranks answer, or do not within `PROBE_S` (the push's own error then stands)."""
        if self.gen is None:
            return None
        probes = [(p, f"generate_sequences for step {t + 1}") for t, (p, _) in sorted(self.in_flight.items())]
        try:
            for p, what in probes or [(self.gen.submit("weight_version"), "receiving the weights")]:
                p.result(PROBE_S, what=what)
        except WorkerError as w:
            # both backends word a dead rank so (`RayWorkerGroup._failure`, the local group's)
            return w if str(w).startswith(f"worker group {self.gen.name!r} lost ") else None
        return None

    def close(self, graceful: bool = True) -> None:
        """The generator group first (its bridge receiver), then the training groups."""
        if self.gen is not None:
            self.gen.shutdown(graceful=graceful)
            self.gen = None
        super().close(graceful)

    # -- state
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # the steps in flight are generated again on resume: the sampler goes back to the first
        state["sampler"] = self._sampler_at.get(self.step, state["sampler"])
        state["async"] = {"policy_version": self.version, "in_flight": sorted(self.in_flight),
                          "reference_share": self.reference_share}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.first_version = self.version = self._next_step = self.step
        if self.cfg.rl.async_.reference_on == "balanced" and "reference_share" in state.get("async", {}):
            self.reference_share = float(state["async"]["reference_share"])  # where the balance had moved it
        again = state.get("async", {}).get("in_flight", [])
        if again:
            log.info("resumed at step %d (policy version %d): steps %s were in flight and are generated again "
                     "from the checkpoint's weights", self.step, state["async"]["policy_version"],
                     ", ".join(str(t + 1) for t in again))

    # -- one step
    def train_step(self) -> dict[str, float]:
        self._published = False
        metrics = super().train_step()
        if not self._published:  # no update this step (rl.filter_groups): the version still moves on
            metrics.update(self.publish(self.step))
        self._sampler_at = {t: v for t, v in self._sampler_at.items() if t >= self.step}
        # (not after the run's first step: its trainer waits for the first batch whatever the share)
        if self.cfg.rl.async_.reference_on == "balanced" and self.cfg.rl.reference.enabled \
                and self.step > self.first_version + 1:
            self.reference_share = rebalanced_share(
                self.reference_share, metrics.get("time/generator_wait", 0.0), metrics.get("time/trainer_wait", 0.0),
                metrics.get("time/generator_ref", 0.0) + metrics.get("time/ref", 0.0))
        return metrics

    def update(self, batch: Batch, timer: PhaseTimer, metrics: dict[str, float]) -> None:
        """The synchronous update, then version step + 1 published."""
        super().update(batch, timer, metrics)
        with timer("publish"):
            metrics.update(self.publish(self.step + 1))
        self._published = True

    def submit_ahead(self) -> None:
        """Generation for every step the capacity rule allows that is not submitted yet."""
        assert self.gen is not None
        s, limit = self.max_staleness, self.cfg.train.max_steps - 1
        # not further with drop: at step s the newest version is s, so a batch for s + S + 1
        # made at once is S + 1 old when it trains, and all of it would be dropped
        horizon = self.step + s
        while self._next_step <= min(horizon, limit):
            t = self._next_step
            self._sampler_at[t] = self.sampler.state_dict()
            prompts = self.next_prompts(step=t)
            least = self.first_version if self.on_stale == "drop" else max(self.first_version, t - s)
            # balanced: the generator also scores rows while the trainer is still before step t
            steal = t if self.cfg.rl.async_.reference_on == "balanced" and self.cfg.rl.reference.enabled else None
            self.in_flight[t] = (self.gen.submit("generate_sequences", prompts, least, self.reference_share,
                                                 step=steal),
                                 prompts)
            self._next_step += 1

    def rollout(self, timer: PhaseTimer, metrics: dict[str, float], round_: int = 0) -> tuple[Batch, dict[str, float]]:
        """This step's batch from the generator (submitted ahead), scored; adds the
        staleness figures and the generator's own to `metrics`."""
        if round_:
            raise RuntimeError("asynchronous RL generates one round per step (rl.filter_groups_refill is refused)")
        self.submit_ahead()
        with timer("trainer_wait"):
            batch = self._take(self.step, metrics)
        engine_metrics(batch, metrics)
        staleness = self.step - np.asarray(batch.arrays["version"], dtype=np.int64)
        metrics["async/staleness_mean"] = float(staleness.mean())
        metrics["async/staleness_max"] = float(staleness.max())
        with timer("reward"):
            return self.score(batch)

    def _take(self, step: int, metrics: dict[str, float]) -> Batch:
        """Step `step`'s generated batch; with on_stale drop, its rows too old regenerated."""
        assert self.gen is not None
        pending, prompts = self.in_flight.pop(step)
        batch = pending.result(self.timeout_s + MARGIN_S, what=f"generate_sequences for step {step + 1}")
        dropped = 0
        if self.on_stale == "drop":
            stale = step - np.asarray(batch.arrays["version"], dtype=np.int64) > self.max_staleness
            if stale.any():
                old, keep = np.flatnonzero(stale), np.flatnonzero(~stale)
                dropped = len(old)
                least = max(self.first_version, step - self.max_staleness)
                again = self.gen.submit("generate_sequences", prompts[old], least, self.reference_share).result(
                    self.timeout_s + MARGIN_S, what=f"generate_sequences for step {step + 1} (rows too old)")
                if len(keep):  # back in the prompts' order
                    order = np.argsort(np.concatenate([keep, old]), kind="stable")
                    batch = concat_rounds([batch[keep], again], self.pad_id)[order]
                else:
                    batch = again
        metrics["async/dropped"] = float(dropped)
        return batch

    # -- evaluation
    def _eval_generate(self):
        """The generator group, once it holds the current policy (after the steps it was
        given before: at most max_staleness + 1, each from a version it holds already)."""
        def generate(batch: Batch) -> Batch:
            assert self.gen is not None
            kind = "greedy" if batch.meta.get("greedy") else "sampled"
            out = self.gen.submit("generate_sequences", batch, self.version).result(
                self.timeout_s + MARGIN_S, what=f"generate_sequences for the evaluation at step {self.step} ({kind})")
            self._keep_push(out)
            return out
        return generate
