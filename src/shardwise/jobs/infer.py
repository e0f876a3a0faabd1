"""The infer recipe behind `shardwise infer`: generate responses to the prompts of
``data.source`` with the FSDP2 infer engine (fsdp2_infer) and write them, scored where
there is something to score against, to a JSONL file.

The model is sharded exactly as for training (same plan, same precision) and generates
with the generation engine ``infer.engine`` names (`shardwise.engine.generate`). Prompts
are split over the data-parallel ranks in contiguous slices; every rank makes the same
number of generate calls (a rank short of prompts makes some with none).

Prompts: a file's records in file order (the first ``infer.num_prompts``), or a built-in
task's held-out prompts (``run.seed`` + `HELDOUT_SEED_OFFSET`, ``infer.num_prompts`` of
them, default `HELDOUT_PROMPTS`): the prompts behind the accuracy the SFT and RL jobs
print, so greedy ``shardwise infer`` on their exported model reproduces that figure.

The trackers of ``run.loggers`` get the config and the summary (rank 0).

Scoring: ``infer.reward`` (builtin:NAME or module:function, as ``rl.reward.function``)
against ``data.response_key``; by default a built-in task is scored by its own scorer and
a file is not scored (its ``response_key`` column is then not read).

Evaluation with tools (``infer.multi_turn.enabled``): each prompt is a multi-turn
trajectory of `shardwise.agents.loop.run_multi_turn`, the RL rollout's loop, with the tools
of ``infer.tools`` / the environment of ``infer.environment`` (run in worker processes, one
`ToolRunner` per rank); a line of the output is a whole trajectory (``messages``,
``num_turns``, ``tool_calls``, ``tool_errors``, ``truncated``, the final answer as its
``response``), scored by ``infer.reward`` and / or the environment's ``reward()``.

Evaluation (`shardwise.engine.evaluate`): when there is something to score, the answers
are counted as every job's evaluation counts them (``val/accuracy`` and ``val/reward_mean``
greedy, else ``val/pass@k`` / ``maj@k`` / ``best@k`` / ``mean@k`` over the infer.n samples
of a prompt, k from ``eval.k``, each per data_source too), into the summary and the
printed table, and written one line per answer to ``run.dir/samples/step_0000000.jsonl``
(the first ``eval.samples_logged`` rows also to the trackers that take tables).

Sampling (``infer.temperature`` > 0) is seeded by ``run.seed``, the call and the rank: a
run repeats exactly with the same world size and ``infer.batch_size``. Greedy output does
not depend on either.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from shardwise.agents.execute import ToolRunner
from shardwise.agents.loop import agent_prompt_batch, run_multi_turn
from shardwise.agents.tools import EnvironmentSpec, ToolSpec
from shardwise.config.schema import Config
from shardwise.config.validate import MeshSpec, check_generation_engine, check_tools_kwargs, mesh_spec
from shardwise.data.chat import use_chat_template
from shardwise.data.encode import truncation_note
from shardwise.data.rewards import (
    ContainedReward,
    RewardFn,
    check_data_sources,
    contain,
    decode_responses,
    resolve_reward_fn,
    score_sequences,
)
from shardwise.data.tasks import BUILTIN_PREFIX, HELDOUT_PROMPTS, HELDOUT_SEED_OFFSET
from shardwise.data.tokenizer import check_vocab, pad_token_id, shared_tokenizer
from shardwise.distributed.runtime import Runtime, env_world
from shardwise.distributed.ulysses import train_only
from shardwise.engine.evaluate import (
    EvalPlan,
    answer_row,
    bounded_extract,
    eval_metrics,
    extract_fn,
    write_samples,
)
from shardwise.engine.generate import build_generator, prompt_batch
from shardwise.engine.infer import InferEngine
from shardwise.engine.weight_sync import WeightSync, bucket_bytes
from shardwise.errors import ConfigError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.plan import ShardingPlan
from shardwise.jobs.inputs import (
    check_agents,
    check_causal_task,
    check_data,
    check_eval,
    check_model,
    check_tokenizer,
    check_tokens,
    check_vllm_engine,
    ground_truth_key,
    vision_inputs,
    wants_tools_tokenizer,
)
from shardwise.jobs.tracking import open_metrics
from shardwise.models.loading import load_hf_config
from shardwise.telemetry import Progress, peak_memory_bytes

log = logging.getLogger(__name__)

REWARD_KEY = "infer.reward"
SUMMARY_FILE = "infer_summary.json"

__all__ = ["Prepared", "prepare", "resume_words", "reward_spec", "run"]


@dataclass
class Prepared:
    """What `prepare` checked and built, for `run` in the same process."""

    cfg: Config
    spec: MeshSpec
    records: list[dict[str, Any]]
    """The prompts (and ground truths when scored)."""
    reward_spec: str | None
    reward_fn: RewardFn | None
    planned: tuple[nn.Module, ShardingPlan] | None
    """The meta model and its plan (used up by the engine that shards it)."""
    agents: Agents | None = None
    """infer.multi_turn's tools and environment (None: single-turn)."""
    eval_plan: EvalPlan | None = None
    """How the answers are evaluated (`check_eval`; None: nothing scores them)."""


@dataclass(frozen=True)
class Agents:
    """What infer.multi_turn calls, checked by `prepare`: the tools, the environment and the
    schemas the chat template gets."""

    tools: list[ToolSpec]
    environment: EnvironmentSpec | None
    schemas: list[dict]

    @property
    def env_reward(self) -> bool:
        """The environment gives each trajectory's reward (its ``reward()``)."""
        return self.environment is not None and self.environment.has_reward


def reward_spec(cfg: Config) -> str | None:
    """The scorer's name: ``infer.reward``, else a built-in source's own task, else None."""
    if cfg.infer.reward is not None:
        return cfg.infer.reward
    return cfg.data.source if cfg.data.source.startswith(BUILTIN_PREFIX) else None


def load_prompts(cfg: Config, scored: bool) -> list[dict[str, Any]]:
    """The records to generate for (see the module docstring); raises DataError /
    ConfigError for a source that cannot be read or holds no records. Scored, or with
    infer.multi_turn (an environment's ``reset(**row)`` and the per-row tool arguments read
    them), records carry ``data_source`` and ``extra_info``."""
    n = cfg.infer.num_prompts
    response_key, name = ground_truth_key(cfg) if scored else (None, "data.response_key")
    extras = scored or cfg.infer.multi_turn.enabled
    if cfg.data.source.startswith(BUILTIN_PREFIX):
        return check_data(cfg, response_key, seed=cfg.run.seed + HELDOUT_SEED_OFFSET, num_builtin=n or HELDOUT_PROMPTS,
                          heldout=True, scoring=extras, response_name=name)
    records = check_data(cfg, response_key, scoring=extras, response_name=name)
    return records[:n] if n else records


def prepare(cfg: Config, world_size: int | None = None) -> Prepared:
    """Every check that can fail on the user's input, before any process group exists:
    mesh, model folder, tokenizer, sharding plan, reward function, prompts."""
    world = world_size if world_size is not None else env_world()[1]
    spec = mesh_spec(cfg.parallel, world)
    train_only(spec.ulysses, "`shardwise infer`")
    check_causal_task(cfg, "`shardwise infer`")
    check_generation_engine(cfg.infer, world, "infer")
    check_model(cfg)
    if cfg.infer.engine == "vllm":  # what the installed vLLM cannot serve fails here, not on rank 0
        check_vllm_engine(load_hf_config(cfg.model), "infer", "model.config")
    # the tools and environment, as rl's: before the tokens (their tokenizer is the tools variant)
    checked = check_agents(cfg, "infer")
    agents = Agents(checked[1], checked[2], checked[0]) if checked is not None else None
    check_tokenizer(cfg)
    check_tokens(cfg)
    name = reward_spec(cfg)
    fn = resolve_reward_fn(name, key=REWARD_KEY) if name is not None else None
    records = load_prompts(cfg, scored=name is not None)
    check_data_sources(fn, records, REWARD_KEY)
    if agents is not None and cfg.infer.multi_turn.tools_kwargs_key:  # per-row tool arguments the loop reads
        check_tools_kwargs(records, cfg.infer.multi_turn.tools_kwargs_key, "infer.multi_turn.tools_kwargs_key",
                           "data.source")
    check_output(cfg)
    plan = check_eval(cfg, "infer", scored=name is not None or (agents is not None and agents.env_reward))
    fn = contain(fn, name)  # a user's function runs in a child of its own (started by run)
    planned = plan_for(cfg, spec)
    return Prepared(cfg, spec, records, name, fn, planned, agents, plan)


def resume_words(cfg: Config) -> str:
    """What the launching side says after an interrupted (or torchrun-ended) `shardwise
    infer`, where a training job names its last committed checkpoint: infer keeps none,
    and writes its answers only when every prompt has one."""
    return (f"shardwise infer keeps no checkpoints and writes {output_path(cfg)} only at the end; "
            "the same command answers every prompt again")


GENERATION_KEYS = ("index", "sample", "prompt", "response")
"""What every line of a generations file holds (`_generate_all`'s rows)."""


def output_path(cfg: Config) -> Path:
    """Where the generations go: ``infer.output`` (a ``..`` in it already resolved by the
    config), else ``run.dir/generations.jsonl``."""
    return Path(cfg.infer.output) if cfg.infer.output else Path(cfg.run.dir) / "generations.jsonl"


def check_output(cfg: Config) -> None:
    """ConfigError on ``infer.output`` when the generations could not be written there, or
    would replace something that is not an earlier output of `shardwise infer`: a folder, a
    path through a file, the data source itself, or a file whose first line is not a
    generation (a data set, another run's metrics.jsonl, a model's config.json)."""
    out = output_path(cfg)
    key = "infer.output" if cfg.infer.output else "run.dir"
    if out.is_dir():
        raise ConfigError(key, f"{str(out)!r} is a folder", f"name a file, e.g. {out / 'generations.jsonl'}")
    through = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if through is not None:
        raise ConfigError(key, f"{str(out)!r} lies under {str(through)!r}, which is a file, not a folder",
                          "name a file in a folder")
    if not out.is_file():
        return
    source = Path(cfg.data.source).expanduser()
    if source.exists() and source.resolve() == out.resolve():
        raise ConfigError(key, f"{str(out)!r} is data.source, the prompts being read",
                          f"name another file, e.g. {out.with_name(out.stem + '_generations.jsonl')}")
    try:
        with open(out, "rb") as f:
            first = f.readline(1 << 20).strip()
    except OSError as e:
        raise ConfigError(key, f"{str(out)!r} cannot be read: {e.strerror or e}") from None
    if not first:
        return
    try:
        row = json.loads(first)
    except ValueError:
        row = None
    if not (isinstance(row, dict) and all(k in row for k in GENERATION_KEYS)):
        raise ConfigError(key, f"{str(out)!r} exists and does not hold generations of `shardwise infer` "
                          f"(its first line has no {', '.join(GENERATION_KEYS)}), so it would be replaced",
                          "name a new file, or move that one away")


def _my_prompts(num: int, dp_rank: int, dp_size: int) -> range:
    """This rank's contiguous slice of ``range(num)``; the last ranks may get fewer, or none."""
    per = math.ceil(num / dp_size)
    return range(min(num, dp_rank * per), min(num, (dp_rank + 1) * per))


def run(prepared: Prepared, runtime: Runtime) -> dict[str, Any]:
    """Generate, score and write; returns the summary (complete on rank 0)."""
    cfg = prepared.cfg
    icfg = cfg.infer
    records = prepared.records
    run_dir = Path(cfg.run.dir)
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, _ = shared_tokenizer(cfg.model.tokenizer, cfg.model.path, cfg.run.dir,
                                    tools=wants_tools_tokenizer(cfg))
    use_chat_template(tokenizer, cfg.data.chat_template)
    check_vocab(tokenizer, load_hf_config(cfg.model).get_text_config().vocab_size)
    if runtime.is_main:
        note = truncation_note(tokenizer, records, cfg.data.max_length, with_response=False, progress=True)
        if note:
            log.warning("data: %s", note)
    if isinstance(prepared.reward_fn, ContainedReward):  # its process imports the function meanwhile
        prepared.reward_fn.start()
    engine = InferEngine(cfg, runtime, planned=prepared.planned)
    prepared.planned = None  # used up by fully_shard
    generator = build_generator(icfg.engine, engine.model, icfg, runtime, pad_token_id(tokenizer),
                                tokenizer.eos_token_id, key="infer.engine",
                                compute_dtype=cfg.fsdp.mixed_precision.param_dtype)
    runner = None
    if prepared.agents is not None:  # this rank's tool processes, printing to run.dir/logs/
        agents, mt = prepared.agents, icfg.multi_turn
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        runner = ToolRunner(agents.tools, agents.environment, timeout_s=icfg.tool_timeout_s, workers=mt.tool_workers,
                            max_chars=max(4096, 16 * mt.max_tool_response_tokens),
                            output=str(run_dir / "logs" / f"tools-rank{runtime.rank}.log"))
    # the trackers of run.loggers get the config and, from rank 0, the summary (no steps here)
    try:
        with open_metrics(cfg, enabled=runtime.is_main, after_step=None, jsonl=False) as trackers:
            summary, samples = _generate_all(prepared, runtime, engine, generator, tokenizer, runner)
            trackers.log_summary(summary)
            plan = prepared.eval_plan
            if plan is not None and plan.samples_logged and samples:
                trackers.log_samples(0, samples[:plan.samples_logged])
    finally:
        if runner is not None:
            runner.close()
    # Collective, before the process group goes. Not on an error path: a failed rank leaves
    # at once (`launch.rank_failed`) and a collective would wait for it.
    generator.shutdown()
    return summary


def _generate_all(prepared: Prepared, runtime: Runtime, engine: InferEngine, generator, tokenizer,
                  runner: ToolRunner | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generate, score and write; the summary (complete on rank 0) and the evaluation's rows
    (rank 0; [] when nothing is evaluated)."""
    cfg = prepared.cfg
    icfg = cfg.infer
    fn = prepared.reward_fn
    agents = prepared.agents
    scored = fn is not None or (agents is not None and agents.env_reward)
    plan = prepared.eval_plan
    extract = bounded_extract(extract_fn(prepared.reward_spec), icfg.reward_timeout_s, "infer.reward_timeout_s") \
        if plan is not None else None
    records = prepared.records
    run_dir = Path(cfg.run.dir)
    vision = vision_inputs(cfg, tokenizer)  # a VL model: each prompt's image (prepare checked the files)
    WeightSync(engine.model, generator, bucket_bytes=bucket_bytes(icfg)).sync()  # an engine with its own weights (vllm) gets the model's

    dp_size = engine.spec.dp_size
    mine = _my_prompts(len(records), runtime.rank, dp_size)
    calls = math.ceil(math.ceil(len(records) / dp_size) / icfg.batch_size)
    rows: list[dict[str, Any]] = []
    answers: list[dict[str, Any]] = []  # the evaluation's rows (`answer_row`)
    tokens = 0
    bar = Progress(total=calls, enabled=runtime.is_main, desc="infer")
    t0 = time.perf_counter()
    try:
        for call in range(calls):
            idx = list(mine[call * icfg.batch_size:(call + 1) * icfg.batch_size])
            recs, uids = [records[i] for i in idx], [str(i) for i in idx]
            if agents is not None:
                batch = agent_prompt_batch(tokenizer, recs, cfg.data.max_length, uids, agents.schemas)
            else:
                batch = prompt_batch(tokenizer, recs, cfg.data.max_length, uids, vision)
            batch = batch.repeat(icfg.n, interleave=True)
            batch.meta["seed"] = cfg.run.seed * 1_000_003 + call
            if agents is not None:  # collective like generate_sequences: every rank makes `calls` of them
                batch.meta["max_new_tokens"] = icfg.max_new_tokens  # per assistant turn
                out = run_multi_turn(generator, batch, tokenizer, runner, icfg.multi_turn, agents.schemas)
                texts = [str(t) for t in out.arrays["final_answer"]]
                ended = [not t for t in out.arrays["truncated"]]
            else:
                out = generator.generate_sequences(batch)
                texts, _ = decode_responses(out, tokenizer)
                ended = (out.tensors["responses"] == tokenizer.eos_token_id).any(-1).tolist()
            scores = judged = None
            if scored and len(out):
                judged = score_sequences(out, tokenizer, fn, icfg.reward_timeout_s, "infer.reward_timeout_s",
                                         truncated_reward=icfg.multi_turn.truncated_reward)
                scores = judged.tensors["token_level_scores"].sum(-1).tolist()
            lengths = out.tensors["response_mask"].sum(-1).tolist()  # the model's tokens (not the tools')
            tokens += int(sum(lengths))
            for j, text in enumerate(texts):
                i = idx[j // icfg.n]
                row = {"index": i, "sample": j % icfg.n, "prompt": records[i]["prompt"], "response": text,
                       "response_tokens": int(lengths[j]), "ended_with_eos": bool(ended[j])}
                if agents is not None:
                    row |= {k: _plain(out.arrays[k][j]) for k in TRAJECTORY_KEYS}
                if fn is not None:
                    row["ground_truth"] = records[i]["response"]
                if scores is not None:
                    row["score"] = float(scores[j])
                rows.append(row)
                if plan is not None and judged is not None:
                    answers.append(answer_row(step=0, index=i, sample=j % icfg.n, greedy=plan.greedy,
                                              record=records[i], response=text,
                                              reward=float(judged.arrays["score"][j]),
                                              info=judged.arrays["reward_info"][j], extract=extract))
            bar.update(1)
    finally:
        bar.close()
        if isinstance(fn, ContainedReward):  # with whatever it started
            fn.close()
    seconds = time.perf_counter() - t0

    gathered: list[Any] | None = [None] * runtime.world_size if runtime.is_main else None
    # Our own processes' plain dicts of str / int / float (never a file from outside).
    dist.gather_object({"rows": rows, "answers": answers, "tokens": tokens, "peak": peak_memory_bytes(runtime.device)},
                       gathered, dst=0)
    samples: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"prompts": len(records), "samples_per_prompt": icfg.n,
                               "greedy": icfg.temperature == 0, "world_size": runtime.world_size,
                               "seconds": seconds}
    if runtime.is_main:
        assert gathered is not None
        all_rows = sorted((r for part in gathered for r in part["rows"]), key=lambda r: (r["index"], r["sample"]))
        assert len(all_rows) == len(records) * icfg.n, (len(all_rows), len(records), icfg.n)
        generated = sum(part["tokens"] for part in gathered)
        summary.update(
            responses=len(all_rows),
            response_length_mean=generated / len(all_rows),
            ended_with_eos=sum(r["ended_with_eos"] for r in all_rows) / len(all_rows),
            tokens_per_s=generated / seconds if seconds > 0 else float("nan"),
            peak_memory_bytes=max(part["peak"] for part in gathered),
        )
        if agents is not None:
            summary |= trajectory_summary(all_rows)
        if scored:
            summary["reward"] = prepared.reward_spec or f"{agents.environment.spec}.reward"
            summary["score_mean"] = sum(r["score"] for r in all_rows) / len(all_rows)
            if prepared.reward_spec and prepared.reward_spec.startswith(BUILTIN_PREFIX):
                summary["accuracy"] = sum(r["score"] >= 1.0 for r in all_rows) / len(all_rows)
        if plan is not None:
            samples = sorted((r for part in gathered for r in part["answers"]), key=lambda r: (r["index"], r["sample"]))
            summary |= eval_metrics(samples, plan.ks, plan.greedy)
            summary["time/eval"] = seconds
            summary["samples"] = str(write_samples(run_dir, 0, samples))
        summary["output"] = str(_write_jsonl(output_path(cfg), all_rows))
        summary["summary"] = str(_write_json(run_dir / SUMMARY_FILE, summary))
    dist.barrier()
    return summary, samples


TRAJECTORY_KEYS = ("messages", "num_turns", "tool_calls", "tool_errors", "tool_timeouts", "truncated", "env_reward")
"""What a line of a multi-turn run's output holds beside `GENERATION_KEYS` (the final answer
is its ``response``)."""


def _plain(value: Any) -> Any:
    """A batch array's item as plain JSON (numpy scalars as Python numbers)."""
    return value.item() if hasattr(value, "item") else value


def trajectory_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The multi-turn figures of the summary, over all trajectories: the metrics of the RL
    rollout by the same names (``multi_turn/turns_mean``, ``tools/calls_per_trajectory``,
    ``tools/errors`` and ``tools/timeouts`` as totals, ``multi_turn/truncated`` as a share)."""
    n = len(rows)
    return {"multi_turn/turns_mean": sum(r["num_turns"] for r in rows) / n,
            "tools/calls_per_trajectory": sum(r["tool_calls"] for r in rows) / n,
            "tools/errors": float(sum(r["tool_errors"] for r in rows)),
            "tools/timeouts": float(sum(r["tool_timeouts"] for r in rows)),
            "multi_turn/truncated": sum(bool(r["truncated"]) for r in rows) / n}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def _write_json(path: Path, obj: dict[str, Any]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
    return path
