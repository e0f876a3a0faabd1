"""The RL recipe behind `shardwise rl`: check everything, then one controller over Ray workers.

`prepare` runs every check the config and its files allow before Ray starts: the mesh,
rows per step against the ranks and mini-batches, the model and reward-model folders, the
tokenizer, the prompts, the reward function, an explicit resume folder and the sharding
plan (on the meta device); with ``rl.async`` the mesh is the training ranks' (nproc -
generator_ranks) and what the asynchronous run does not do yet is refused (`check_rl_async`).
`run` builds the `shardwise.rl.trainer.Controller` (with rl.async the
`shardwise.rl.async_trainer.AsyncController`) from what was prepared, starts the worker
groups, resumes, evaluates the policy (``eval``: step 0, every ``eval.every_steps``, the
end; a built-in task's held-out accuracy by default), trains, exports the actor (with
``checkpoint.export_from: best`` the best evaluation's checkpoint) and plots the metrics.
The controller writes ``run.dir/metrics.jsonl`` and the trackers of ``run.loggers`` (each step's scalars, the
config, the summary without the per-step history).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.checkpoint.best import best_checkpoint, read_best
from shardwise.config.schema import Config
from shardwise.config.validate import (
    MeshSpec,
    check_generation_engine,
    check_rl_rows,
    check_tools_kwargs,
    mesh_spec,
    rl_train_ranks,
)
from shardwise.data.chat import export_template, use_chat_template
from shardwise.data.encode import truncation_note
from shardwise.data.rewards import RewardFn, VerlReward, check_data_sources, contain, resolve_reward_fn
from shardwise.data.tokenizer import check_vocab, load_tokenizer, tokenizer_dir
from shardwise.distributed import ulysses
from shardwise.engine.evaluate import EvalPlan
from shardwise.errors import ConfigError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.plan import ShardingPlan
from shardwise.jobs.inputs import (
    check_agents,
    check_causal_task,
    check_data,
    check_eval,
    check_model,
    check_resume,
    check_tokenizer,
    check_tokens,
    check_vllm_engine,
    ground_truth_key,
    job_tokenizer,
    vision_inputs,
    wants_tools_tokenizer,
)
from shardwise.jobs.preference import check_reward_model
from shardwise.jobs.report import rl as report
from shardwise.jobs.tracking import open_metrics
from shardwise.models import families
from shardwise.models.hub import resolve_inputs
from shardwise.models.loading import check_weights_folder, load_hf_config
from shardwise.models.vision import is_vision_language
from shardwise.rl import distill
from shardwise.rl.algorithms.user import check_user_functions
from shardwise.rl.async_trainer import AsyncController
from shardwise.rl.cluster import check_ray_address
from shardwise.rl.trainer import Controller, heldout_summary, mean_timing
from shardwise.telemetry import plot_metrics
from shardwise.telemetry.logs import ThirdPartyToFile
from shardwise.telemetry.metrics import read_metrics
from shardwise.telemetry.plots import val_panels
from shardwise.telemetry.startup import StartupClock, launched_at

log = logging.getLogger(__name__)

__all__ = ["Prepared", "eval_scorer", "load_best", "plot_panels", "prepare", "report", "run"]


@dataclass
class Prepared:
    """What `prepare` checked, for `run` in the same process (the controller)."""

    cfg: Config
    spec: MeshSpec
    world_size: int
    rows_per_step: int
    records: list[dict[str, Any]]
    reward_fn: RewardFn | None
    plan: ShardingPlan | None = None
    """The actor's plan on the meta device (its memory per rank, for the launch line)."""
    schemas: list[dict] | None = None
    """rl.multi_turn: the tools' schemas the chat template gets (None: single-turn rollouts)."""
    eval_plan: EvalPlan | None = None
    """The evaluation (`check_eval`; None: none): at step 0, every eval.every_steps, the end."""
    eval_scorer: RewardFn | None = None
    """What scores the evaluation's answers (`eval_scorer`)."""
    clock: StartupClock = field(default_factory=StartupClock)
    """The start-up's timeline so far (``launch``: the process's start to `prepare`, and
    ``prepare``); `run` goes on with it to the first step."""


def prepare(cfg: Config, world_size: int, clock: StartupClock | None = None) -> Prepared:
    """Every check that can fail on the user's input; raises a ShardwiseError, starts
    nothing, writes nothing. The workers build their own models; the meta model and plan
    built here only check the plan. `clock`: the start-up's timeline so far (default: one
    from the command's launch). Its inputs named by Hub id or GGUF file are resolved first,
    once, into the local paths the workers read (`shardwise.models.hub.resolve_inputs`)."""
    cfg = resolve_inputs(cfg)
    clock = clock or StartupClock(launched_at())
    clock.lap("launch")  # the interpreter, imports, the config and the command's own checks
    train_ranks = rl_train_ranks(cfg, world_size)  # rl.async: the generator group takes the rest
    spec = mesh_spec(cfg.parallel, train_ranks, None if train_ranks == world_size else
                     f"the {train_ranks} training rank(s) (--nproc {world_size} less rl.async.generator_ranks "
                     f"{world_size - train_ranks})")
    check_causal_task(cfg, "`shardwise rl`")
    check_ray_address()  # a cluster that is not there fails here, not after minutes of Ray's retries
    rows = check_rl_rows(cfg, spec.dp_size)
    check_generation_engine(cfg.rl.rollout, world_size - train_ranks or world_size, "rl.rollout")
    check_token_budgets(cfg)
    check_model(cfg)
    families.check_packing(load_hf_config(cfg.model), False, cfg.rl.packing)  # hybrids whose layers mix documents
    check_rl_async(cfg)
    check_user_functions(cfg)  # a user's rl.actor.policy_loss / rl.advantage imported once here
    schemas = check_rl_agents(cfg)
    if cfg.rl.rollout.engine == "vllm":  # what the installed vLLM cannot serve fails here, not on rank 0
        check_vllm_engine(load_hf_config(cfg.model), "rl.rollout", "model.config")
    check_rl_ulysses(cfg, spec.ulysses)
    if cfg.rl.reward.model is not None:
        check_weights_folder(cfg.rl.reward.model, "rl.reward.model")
    check_tokenizer(cfg)
    if cfg.rl.reward.model is not None:
        check_reward_model(cfg.rl.reward.model, job_tokenizer(cfg))
    if cfg.rl.distill.teacher is not None:
        distill.check_teacher(cfg, load_hf_config(cfg.model).get_text_config().vocab_size, job_tokenizer(cfg))
        cfg = distill.loss_config(cfg)  # mode loss: the actor's KL loss to the reference, which is the teacher
    check_resume(cfg, "rl")
    check_tokens(cfg)
    truth, truth_name = ground_truth_key(cfg)
    records = check_data(cfg, truth, scoring=True, response_name=truth_name)
    fn = resolve_reward_fn(cfg.rl.reward.function) if cfg.rl.reward.function is not None else None
    if cfg.rl.reward.combine == "function" and not (isinstance(fn, VerlReward) and fn.takes_extra_info):
        raise ConfigError("rl.reward.combine", f"function hands the reward model's score to "
                          f"{cfg.rl.reward.function} as extra_info['model_score'], which it does not take",
                          "give a compute_score(data_source, solution_str, ground_truth, extra_info) function")
    check_data_sources(fn, records)
    fn = contain(fn, cfg.rl.reward.function)  # a user's function runs in a child of its own (started by run)
    evaluation = check_eval(cfg, "rl")
    if schemas is not None and cfg.rl.multi_turn.tools_kwargs_key:  # per-row tool arguments the rollouts read
        for rows, source_key in ((records, "data.source"), (evaluation.records if evaluation else [], "eval.source")):
            check_tools_kwargs(rows, cfg.rl.multi_turn.tools_kwargs_key, "rl.multi_turn.tools_kwargs_key", source_key)
    scorer = eval_scorer(cfg, evaluation, fn)
    _, plan = plan_for(cfg, spec)  # pattern errors surface here, on the meta device
    clock.lap("prepare")
    return Prepared(cfg, spec, world_size, rows, records, fn, plan, clock=clock, schemas=schemas,
                    eval_plan=evaluation, eval_scorer=scorer)


def eval_scorer(cfg: Config, plan: EvalPlan | None, job_fn: RewardFn | None) -> RewardFn | None:
    """What scores the evaluation's answers (``plan.reward``, resolved by `check_eval`:
    eval.reward, else a built-in task's scorer for its held-out prompts, else the job's):
    the job's own function (`job_fn`, contained as the job runs it) when the plan names it,
    else the spec resolved and, a user's ``module:function``, contained the same way. None
    without a plan, or where an environment's reward scores alone."""
    if plan is None or plan.reward is None:
        return None if plan is None else job_fn
    spec = plan.reward.strip()
    if cfg.rl.reward.function is not None and spec == cfg.rl.reward.function.strip():
        return job_fn
    key = "eval.reward" if cfg.eval.reward is not None else "eval.source" if plan.builtin else "rl.reward.function"
    return contain(resolve_reward_fn(spec, key), spec)


def check_rl_agents(cfg: Config) -> list[dict] | None:
    """`shardwise.jobs.inputs.check_agents` for rl.multi_turn, and a reward to train on:
    rl.reward.function / .model, or the environment's reward(). Returns the tools' schemas
    (None: single-turn rollouts)."""
    checked = check_agents(cfg, "rl")
    if checked is None:
        return None
    schemas, _, env = checked
    rl = cfg.rl
    if rl.reward.function is None and rl.reward.model is None and (env is None or not env.has_reward):
        raise ConfigError("rl.reward", "no reward: rl.reward.function and rl.reward.model are null and "
                          f"{'no rl.environment' if env is None else rl.environment + ' has no reward()'} gives one",
                          "set rl.reward.function, or give the environment a reward() method")
    return schemas


def check_rl_async(cfg: Config) -> None:
    """ConfigError naming the key when ``rl.async`` meets what the asynchronous run does not
    do yet: refilled group filtering (its
    extra rounds would generate inside a step), a LoRA actor's adapters pushed alone
    (``vllm.lora_sync: adapter``: the generator group takes the weights merged) and a
    vision-language policy (the generator group takes text prompts)."""
    if not cfg.rl.async_.enabled:
        return
    off = "or set rl.async.enabled=false"
    if cfg.rl.filter_groups != "none" and cfg.rl.filter_groups_refill:
        raise ConfigError("rl.filter_groups_refill", "asynchronous RL (rl.async) generates each step's prompts "
                          "ahead and cannot refill a step with more rounds", f"set rl.filter_groups_refill=false, {off}")
    if cfg.rl.async_.reference_on != "actor" and not cfg.rl.reference.enabled:
        raise ConfigError("rl.async.reference_on", f"{cfg.rl.async_.reference_on} puts the reference policy's forward "
                          "on the generator ranks, but rl.reference.enabled is false", "set rl.async.reference_on=actor, "
                          "or rl.reference.enabled=true")
    if cfg.model.lora.enabled and cfg.rl.rollout.vllm.lora_sync == "adapter":
        raise ConfigError("rl.rollout.vllm.lora_sync", "asynchronous RL (rl.async) pushes a LoRA actor's weights "
                          "merged to its generator group, not its adapters", f"set it to merged, {off}")
    if is_vision_language(load_hf_config(cfg.model)):
        raise ConfigError("model.path", "asynchronous RL (rl.async) generates from text prompts and does not "
                          "train a vision-language policy yet", off.removeprefix("or "))


def check_rl_ulysses(cfg: Config, sp: int) -> None:
    """ConfigError naming the key when Ulysses (``parallel.ulysses_size`` > 1) meets what it
    cannot split in RL: rows not packed, a rollout engine other than HF's on the training
    ranks (whose generation runs whole sequences on every rank of a group; with ``rl.async``
    the generator group's ranks generate, without Ulysses), a head count sp does not divide."""
    if sp == 1:
        return
    if cfg.rl.packing is False:
        raise ConfigError("rl.packing", "Ulysses sequence parallel in RL splits packed rows",
                          "leave rl.packing unset (or true), or set parallel.ulysses_size=1")
    if cfg.rl.rollout.engine != "hf" and not cfg.rl.async_.enabled:  # rl.async: the generator group's own ranks
        raise ConfigError("rl.rollout.engine", f"the {cfg.rl.rollout.engine} engine is not run under Ulysses "
                          "sequence parallel yet", "use hf, set rl.async.enabled=true (the generator ranks run "
                          "no Ulysses), or set parallel.ulysses_size=1")
    if cfg.rl.reward.model is not None:
        raise ConfigError("rl.reward.model", "a reward model is not run under Ulysses sequence parallel yet",
                          "use a rule-based reward (rl.reward.function), or set parallel.ulysses_size=1")
    ulysses.check_model(load_hf_config(cfg.model), sp)


def check_token_budgets(cfg: Config) -> None:
    """ConfigError naming the key when a token budget of the RL passes cannot hold the
    longest row a rollout can make: a prompt of data.max_length tokens and a response of
    rl.rollout.max_new_tokens."""
    response, what = cfg.rl.rollout.max_new_tokens, "rl.rollout.max_new_tokens"
    if cfg.rl.multi_turn.enabled:  # every token after the prompt, the model's and the tools'
        response, what = cfg.rl.multi_turn.max_response_tokens, "rl.multi_turn.max_response_tokens"
    longest = cfg.data.max_length + response
    for key, budget in (("rl.actor.max_tokens_per_micro_batch", cfg.rl.actor.max_tokens_per_micro_batch),
                        ("rl.log_prob_max_tokens_per_micro_batch", cfg.rl.log_prob_max_tokens_per_micro_batch)):
        if budget is not None and budget < longest:
            raise ConfigError(key, f"{budget} tokens do not hold the longest row a rollout can make: "
                              f"data.max_length ({cfg.data.max_length}) + {what} "
                              f"({response}) = {longest} tokens",
                              f"raise it to at least {longest}")


def run(prepared: Prepared) -> dict[str, Any]:
    """The whole RL run; returns a summary (paths, accuracy before/after, final metrics).
    Other libraries' warnings and log lines go to ``run.dir/logs/`` (`shardwise.telemetry.logs`)."""
    with ThirdPartyToFile(Path(prepared.cfg.run.dir) / "logs" / "controller.log"):
        return _run(prepared)


def plot_panels(cfg: Config, on_policy_shortcut: bool) -> list[tuple[str, list[str]]]:
    """The panels of ``rl.png``, each with only the metrics a run of `cfg` logs
    (`on_policy_shortcut`: the controller's, no old-log-prob forward)."""
    kl = ["kl"] if cfg.rl.reference.enabled else []
    asynchronous = cfg.rl.async_.enabled
    panels = [("reward / accuracy", ["reward/mean"] + ["accuracy"] * (cfg.rl.reward.function is not None)),
              ("response length", ["response_length/mean"]),
              ("KL to reference / entropy" if kl else "entropy", [*kl, "entropy"]),
              ("actor", ["actor/grad_norm", "actor/pg_clipfrac"]),
              ("seconds per phase", ["time/step", "time/trainer_wait" if asynchronous else "time/generate",
                                     "time/update_actor"] + ["time/old_log_prob"] * (not on_policy_shortcut))]
    if asynchronous:
        panels.append(("staleness (policy versions)", ["async/staleness_mean", "async/staleness_max"]))
    if cfg.rl.critic.enabled:
        panels.append(("critic", ["critic/vf_loss"]))
    if cfg.rl.filter_groups != "none":
        panels.append(("groups in the update", ["filter/kept_groups", "filter/dropped_groups"]))
    if cfg.rl.actor.off_policy.correction != "none":
        panels.append(("off-policy weights", ["off_policy/is_weight_mean", "off_policy/truncated_share"]))
    if cfg.rl.multi_turn.enabled:
        panels.append(("multi-turn", ["multi_turn/turns_mean", "tools/calls_per_trajectory", "multi_turn/truncated"]))
    return panels


def load_best(ctl: Controller) -> int | None:
    """``checkpoint.export_from: best``: the actor's weights of the best evaluation's
    checkpoint (``checkpoint.keep_best``, `best_checkpoint`) loaded into the workers before
    the export; returns its step (None when none was recorded: the last step is exported,
    said once)."""
    found = best_checkpoint(ctl.run_dir)
    if found is None:
        log.warning("checkpoint.export_from=best: no best checkpoint was recorded in %s; exporting the last step",
                    ctl.run_dir / "checkpoints")
        return None
    step = int((read_best(ctl.run_dir) or {}).get("step", ctl.step))
    if step != ctl.step:
        ctl.group.load_actor(str(found))
        log.info("checkpoint.export_from=best: exporting step %d (%s)", step, found)
    return step


def _run(prepared: Prepared) -> dict[str, Any]:
    cfg = prepared.cfg
    folder = tokenizer_dir(cfg.model.tokenizer, cfg.model.path, cfg.run.dir, build=True,
                           tools=wants_tools_tokenizer(cfg))
    tokenizer = use_chat_template(load_tokenizer(folder), cfg.data.chat_template)
    check_vocab(tokenizer, load_hf_config(cfg.model).get_text_config().vocab_size)
    vision = vision_inputs(cfg, tokenizer)
    note = truncation_note(tokenizer, prepared.records, cfg.data.max_length, with_response=False, progress=True)
    if note:
        log.warning("data: %s", note)
    if cfg.rl.filter_groups == "none" and (cfg.rl.filter_groups_refill
                                           or "filter_groups_max_rounds" in cfg.rl.model_fields_set):
        log.warning("rl.filter_groups_refill / filter_groups_max_rounds have no effect with rl.filter_groups=none")
    if note := families.rl_packing_note(load_hf_config(cfg.model), cfg.rl.packing):
        log.warning("%s", note)
    if cfg.model.lora.enabled:
        log.warning("lora: the actor trains LoRA adapters (r=%d); %s", cfg.model.lora.r,
                    "the reference is the actor with its adapters disabled (no second model in memory)"
                    if cfg.rl.reference.enabled else "no reference")
    kind = AsyncController if cfg.rl.async_.enabled else Controller
    ctl = kind(cfg, prepared.world_size, prepared.records, tokenizer, str(folder), prepared.reward_fn,
               vision, prepared.schemas, prepared.eval_plan, prepared.eval_scorer)
    summary: dict[str, Any] = {"run_dir": str(ctl.run_dir), "metrics": str(ctl.run_dir / "metrics.jsonl")}
    clock = prepared.clock
    clock.lap("controller")  # the launch line, the tokenizer, the controller
    writer = None
    plotter = ThreadPoolExecutor(1)
    plotted: Future[str] | None = None
    try:
        ctl.start(clock)
        resumed = ctl.resume()
        writer = open_metrics(cfg, enabled=True, after_step=ctl.step)
        clock.lap("resume")
        if ctl.push_weights():
            clock.lap("first_push")
        summary["resumed_from_step"] = ctl.step if resumed else None
        if ctl.eval_plan is not None:  # the policy as it starts (step 0, or the resumed step)
            ctl.run_evaluation(writer, record=not (resumed and ctl.evaluated_before(writer)))
            clock.lap("eval")
            if cfg.checkpoint.keep_best is not None and not resumed:
                ctl.save(final=False)  # the starting policy may stay the best: it needs a checkpoint
                clock.lap("checkpoint")
        startup = clock.metrics()
        summary["startup"] = {k.removeprefix("time/startup/"): v for k, v in startup.items()}
        history = ctl.fit(writer, startup)
        # every metrics line is logged (each flushed as it is written): the plot is drawn
        # while the model is exported and the worker groups stop, mostly waits for processes
        if (ctl.run_dir / "metrics.jsonl").is_file():
            plotted = plotter.submit(_plot, cfg, ctl)
        summary["steps"] = ctl.step
        summary["history"] = history
        summary["timing"] = mean_timing(history)
        summary.update(heldout_summary(ctl.evaluations))
        if cfg.checkpoint.export_from == "best" and cfg.checkpoint.export_hf:
            summary["exported_step"] = load_best(ctl)
        if cfg.checkpoint.export_hf and cfg.model.lora.enabled:
            summary["adapter"] = ctl.group.export_adapter(str(ctl.run_dir / "adapter"))
        if cfg.checkpoint.export_hf and (not cfg.model.lora.enabled or cfg.checkpoint.export_merged):
            summary["hf"] = ctl.group.export_hf(str(ctl.run_dir / "hf"), ctl.tokenizer_dir)
            if vision is not None:
                vision.save(summary["hf"])
            export_template(summary["hf"], cfg.data.chat_template)
        summary["checkpoint"] = str(ctl.run_dir / "checkpoints")
    except BaseException:
        if writer is not None:
            writer.close(failed=True)
        ctl.close(graceful=False)
        plotter.shutdown(cancel_futures=True)
        raise
    assert writer is not None
    with writer, plotter:  # closed here; as failed if the plot raises
        try:
            ctl.close()
        finally:
            if plotted is not None:
                summary["plot"] = plotted.result()
        writer.log_summary({k: v for k, v in summary.items() if k != "history"})  # the trackers have it as metrics
    return summary


def _plot(cfg: Config, ctl: Controller) -> str:
    """``run.dir/rl.png`` of the run's metrics; its path."""
    metrics = ctl.run_dir / "metrics.jsonl"
    panels = plot_panels(cfg, ctl.on_policy_shortcut) + val_panels(read_metrics(metrics))  # + the evaluation's
    return str(plot_metrics(metrics, ctl.run_dir / "rl.png", panels))
