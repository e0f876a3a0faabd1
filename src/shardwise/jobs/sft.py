"""The SFT recipe behind `shardwise train`: data -> TrainEngine -> checkpoints -> HF export.

`prepare` runs every check a config and its files allow before any process group exists
(mesh, batch sizes, model folder, tokenizer, data, resume folder, the sharding plan on the
meta device) and keeps what it built; `run` is the loop, on every rank. Rank 0 shows a
progress bar and writes ``run.dir/metrics.jsonl`` (and to the trackers of ``run.loggers``:
each step's scalars, the config, the summary) and a PNG plot at the end.
``model.task`` masked_lm / sequence_classification (encoders) run the same loop on the
data and losses of `shardwise.data.encoder`, without generation or evaluation.

Evaluation (``eval``, `shardwise.jobs.inputs.check_eval`): at step 0, every
``eval.every_steps`` and at the end (`shardwise.engine.evaluate.is_eval_step`), ``val/loss``
(the training loss's token weighting over every trained token of the validation set: the
sum of token losses over all ranks and rows / their number; the examples encoded, packed
and micro-batched as training does) and ``val/ppl`` = exp(val/loss); for a built-in task
(eval.source builtin:*, or no eval.source and a built-in data.source) also the answers the
model generates, scored (`shardwise.engine.evaluate.evaluate`: ``val/accuracy``, ...,
``run.dir/samples/step_XXXXXXX.jsonl``). Each evaluation is its own metrics line (with
``time/eval``). The held-out examples of the built-in data.source itself (no eval.source,
or eval.source naming the same task) with eval.every_steps 0 and no keep_best are evaluated
at the end only: the held-out accuracy this job always reported. ``checkpoint.keep_best``: every
evaluated step is checkpointed and the best recorded (`shardwise.checkpoint.best`);
``checkpoint.export_from: best`` exports that checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.best import best_checkpoint, forget_best_after, record_best
from shardwise.checkpoint.dcp import CheckpointManager
from shardwise.checkpoint.hf_export import export_adapter, export_model
from shardwise.checkpoint.layout import resume_line
from shardwise.config.schema import Config
from shardwise.config.validate import MeshSpec, check_sft_batch, mesh_spec
from shardwise.data import encoder
from shardwise.data.chat import export_template, text_prompts_as_chat, use_chat_template
from shardwise.data.collate import example_loss_tokens, pack_collate, pad_collate
from shardwise.data.encode import encode_records, summarize_truncation
from shardwise.data.pairs import PAIR_OBJECTIVES
from shardwise.data.rewards import ContainedReward, contain, resolve_reward_fn
from shardwise.data.sampler import GlobalBatchSampler, micro_batches, rank_share, token_budget_micro_batches
from shardwise.data.tasks import HELDOUT_SEED_OFFSET
from shardwise.data.tokenizer import check_vocab, pad_token_id, shared_tokenizer
from shardwise.distributed import ulysses
from shardwise.distributed.runtime import Runtime, env_world
from shardwise.engine.evaluate import EvalPlan, evaluate, extract_fn, is_eval_step, write_samples
from shardwise.engine.generate import build_generator, generate_on_ranks
from shardwise.engine.train import TrainEngine
from shardwise.errors import ConfigError, DataError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.plan import ShardingPlan
from shardwise.jobs import preference
from shardwise.jobs.inputs import (
    check_data,
    check_eval,
    check_model,
    check_resume,
    check_tokenizer,
    check_tokens,
    job_tokenizer,
    vision_inputs,
    wants_tools_tokenizer,
)
from shardwise.jobs.tracking import open_metrics
from shardwise.models import families
from shardwise.models.loading import load_hf_config
from shardwise.models.vision import VisionInputs
from shardwise.telemetry import MetricsWriter, Progress, peak_memory_bytes, plot_metrics, read_metrics, val_panels

log = logging.getLogger(__name__)

__all__ = ["Prepared", "SFTData", "prepare", "run"]


@dataclass
class Prepared:
    """What `prepare` checked and built, for `run` in the same process."""

    cfg: Config
    spec: MeshSpec
    grad_accum: int
    """Micro-batches per rank per optimizer step."""
    records: list[dict[str, Any]]
    """The examples of ``data.source``."""
    planned: tuple[nn.Module, ShardingPlan] | None
    """The meta model and its plan (used up by the engine that shards it)."""
    eval_plan: EvalPlan | None = None
    """What is evaluated during training (`check_eval`; None: nothing)."""
    val_records: list[dict[str, Any]] | None = None
    """The validation examples val/loss is taken over, as training reads examples (a
    built-in task's held-out examples read as data.source's are)."""


def prepare(cfg: Config, world_size: int | None = None) -> Prepared:
    """All config and input checks for `world_size` ranks (default: torchrun's world);
    raises a ShardwiseError, starts nothing, writes nothing."""
    world = world_size if world_size is not None else env_world()[1]
    spec = mesh_spec(cfg.parallel, world)
    accum = check_sft_batch(cfg.train, spec.dp_size)
    check_model(cfg)
    families.check_packing(load_hf_config(cfg.model), cfg.data.packing, None)  # hybrids whose layers mix documents
    check_tokenizer(cfg)
    check_resume(cfg, "train")
    if cfg.train.objective in PAIR_OBJECTIVES:  # DPO / reward model (shardwise.jobs.preference)
        preference.check_config(cfg, spec)
        check_tokens(cfg)
        tokenizer = job_tokenizer(cfg)
        records = preference.load_checked_pairs(cfg, tokenizer)
        plan = preference.pairs_eval_plan(cfg, tokenizer)
        task, extra = preference.engine_task(cfg, tokenizer)
        return Prepared(cfg, spec, accum, records, plan_for(cfg, spec, task, **extra), plan,
                        plan.records if plan is not None else None)
    plan = check_eval(cfg, "train")
    val_records = None
    if encoder.is_encoder_task(cfg.model.task):
        if plan is not None:
            raise ConfigError("eval.source", f"model.task {cfg.model.task} has no validation loss or answers to "
                              "evaluate yet (a causal LM's)", "unset eval.source")
        records = encoder.prepare_inputs(cfg, spec, load_hf_config(cfg.model))
    else:
        records = check_data(cfg, cfg.data.response_key, sft=True)
        check_tokens(cfg, records)
        if plan is not None:
            val_records = _validation_examples(cfg, plan)
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is not None and budget < cfg.data.max_length:
        raise ConfigError("train.max_tokens_per_micro_batch", f"{budget} tokens is less than data.max_length="
                          f"{cfg.data.max_length}, the longest an example can be",
                          f"raise it to at least {cfg.data.max_length}")
    if spec.ulysses > 1:
        if cfg.data.packing:
            raise ConfigError("data.packing", "packed rows cannot be split by Ulysses sequence parallel",
                              "set data.packing=false, or parallel.ulysses_size=1")
        ulysses.check_model(load_hf_config(cfg.model), spec.ulysses)
        best = cfg.checkpoint.keep_best
        if plan is not None and best is not None and best not in ("val/loss", "val/ppl"):
            raise ConfigError("checkpoint.keep_best", f"{best!r}: answers are not generated under Ulysses sequence "
                              "parallel (parallel.ulysses_size > 1), so the validation loss is all there is",
                              "use val/loss, or parallel.ulysses_size=1")
    planned = plan_for(cfg, spec, cfg.model.task)  # pattern errors surface here, on the meta device
    return Prepared(cfg, spec, accum, records, planned, plan, val_records)


def _validation_examples(cfg: Config, plan: EvalPlan) -> list[dict[str, Any]]:
    """The examples val/loss is taken over: the plan's records for a file (SFT examples
    already); a built-in task's held-out examples read as the training data are (a text
    prompt asked as a chat where training asks it so)."""
    if not plan.builtin:
        return plan.records
    return check_data(cfg, cfg.data.response_key, seed=cfg.run.seed + HELDOUT_SEED_OFFSET,
                      num_builtin=len(plan.records), heldout=True, sft=True, source=plan.source,
                      source_key="eval.source")


def encode_examples(cfg: Config, records: list[dict[str, Any]], tokenizer, vision: VisionInputs | None,
                    what: str) -> list[dict[str, Any]]:
    """The tokenised examples of `records` (`encode_records` with data.max_length and
    data.train_on; a VL example's image encoded beside); the truncation note on rank 0, a
    warning for the training data (`what` "data"), at INFO for the validation set."""
    d = cfg.data
    # a VL example's image tokens follow bos (shardwise.models.vision)
    encoded = encode_records(tokenizer, records, d.max_length, d.train_on,
                             vision.prompt_prefix if vision is not None else (), progress=dist.get_rank() == 0)
    examples = []
    for r, enc in zip(records, encoded):
        ex = dict(enc.example)
        if vision is not None:
            ex["pixel_values"], ex["image_grid_thw"] = vision.encode(r["image"])
        examples.append(ex)
    note = (summarize_truncation([e.length for e in encoded], [e.lost for e in encoded], d.max_length, True)
            if dist.get_rank() == 0 else None)
    if note:
        log.log(logging.WARNING if what == "data" else logging.INFO, "%s: %s", what, note)
    return examples


class SFTData:
    """Tokenised examples and the per-step batches of this rank."""

    loss_fn = None
    """The engine's default loss (the causal-LM loss); `shardwise.data.encoder.EncoderData` has its own."""

    def __init__(self, cfg: Config, records: list[dict[str, Any]], tokenizer, dp_rank: int, dp_size: int,
                 vision: VisionInputs | None = None):
        self._encode(cfg, records, tokenizer, dp_rank, dp_size, vision, "data")
        self.sampler = GlobalBatchSampler(len(self.examples), cfg.train.global_batch_size, cfg.run.seed)
        self._it = iter(self.sampler)

    def _encode(self, cfg: Config, records: list[dict[str, Any]], tokenizer, dp_rank: int, dp_size: int,
                vision: VisionInputs | None, what: str) -> None:
        """The examples of `records` (`encode_examples`; `what` names them in its notes) and
        what collating them needs."""
        self.vision = vision
        self.examples = encode_examples(cfg, records, tokenizer, vision, what)
        self.pad_id = pad_token_id(tokenizer)
        self.cfg = cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def collate(self, examples: list) -> dict[str, torch.Tensor]:
        if self.cfg.data.packing:
            batch = pack_collate(examples, self.cfg.data.max_length, self.pad_id)
            # No mask: transformers builds each layer's own from the restarting position ids
            # (the 4-D block-diagonal mask would turn sliding-window layers into full attention)
            # and shardwise's document boundaries reach the sequence-state layers.
            del batch["attention_mask"]
            return batch
        batch = pad_collate(examples, self.pad_id)
        if self.vision is not None:
            del batch["position_ids"]  # the model derives its 3-D rotary positions from the image grid
            batch["pixel_values"] = torch.stack([ex["pixel_values"] for ex in examples])
            batch["image_grid_thw"] = torch.stack([ex["image_grid_thw"] for ex in examples])
        return batch

    def next_step(self) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """(this rank's micro-batches, loss tokens in the whole global batch, tokens in it)."""
        indices = next(self._it)
        global_examples = [self.examples[i] for i in indices]
        loss_tokens = sum(example_loss_tokens(ex) for ex in global_examples)
        if loss_tokens == 0:
            raise DataError(f"data.max_length: no example of a global batch keeps a response token after "
                            f"truncation to {self.cfg.data.max_length} tokens; raise data.max_length")
        tokens = sum(len(ex["input_ids"]) for ex in global_examples)
        return self.micro_batches_of(rank_share(indices, self.dp_rank, self.dp_size)), loss_tokens, tokens

    def micro_batches_of(self, mine: list[int]) -> list[dict[str, torch.Tensor]]:
        """The collated micro-batches of the examples `mine` (indices), split as training
        splits a rank's share (`split`)."""
        return [self.collate([self.examples[i] for i in mb]) for mb in self.split(mine)]

    def split(self, mine: list[int]) -> list[list[int]]:
        """The examples `mine` (indices) in micro-batches: train.micro_batch_size examples
        each, or by train.max_tokens_per_micro_batch."""
        budget = self.cfg.train.max_tokens_per_micro_batch
        if budget is None:
            split = micro_batches(mine, self.cfg.train.micro_batch_size)
        else:
            split = token_budget_micro_batches(mine, [len(self.examples[i]["input_ids"]) for i in mine], budget,
                                               packed=self.cfg.data.packing)
        return split

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = iter(self.sampler)


class ValidationSet(SFTData):
    """The validation examples, encoded, collated and micro-batched as `SFTData`'s, and
    this data-parallel rank's micro-batches of ALL of them: contiguous shares of
    ceil(N / dp_size) examples (the last ranks may hold fewer, or none), no remainder
    dropped."""

    def __init__(self, cfg: Config, records: list[dict[str, Any]], tokenizer, dp_rank: int, dp_size: int,
                 vision: VisionInputs | None = None):
        self._encode(cfg, records, tokenizer, dp_rank, dp_size, vision, "eval")
        self.loss_tokens = sum(example_loss_tokens(ex) for ex in self.examples)
        """Trained tokens of the whole set (every rank's): val/loss's denominator."""
        if self.loss_tokens == 0:
            raise DataError(f"data.max_length: no example of the validation data keeps a response token after "
                            f"truncation to {cfg.data.max_length} tokens; raise data.max_length")
        per = -(-len(self.examples) // dp_size)
        mine = list(range(min(len(self.examples), dp_rank * per), min(len(self.examples), (dp_rank + 1) * per)))
        self.micro_batches = _Collated(self, self.split(mine) if mine else [])
        """This rank's micro-batches, each collated when it is read (a packed one's
        attention mask is (rows, 1, seq, seq): the whole set at once could be large)."""


class _Collated(Sequence):
    """Micro-batches of `data`'s examples by index lists, collated on access."""

    def __init__(self, data: SFTData, split: list[list[int]]):
        self.data, self.split = data, split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i):  # a Sequence of batches (no slices are taken)
        return self.data.collate([self.data.examples[j] for j in self.split[i]])


class Evaluation:
    """The evaluations of one `shardwise train` run (module docstring): val/loss and
    val/ppl over `val`, and for a plan with a scorer the generated answers
    (`shardwise.engine.evaluate.evaluate`), their samples file and the trackers' rows.
    `run` is collective (every rank calls it at the same steps)."""

    def __init__(self, cfg: Config, runtime: Runtime, engine: TrainEngine, plan: EvalPlan, val: ValidationSet,
                 tokenizer, vision: VisionInputs | None, metrics: MetricsWriter, only_at_end: bool):
        self.cfg, self.runtime, self.engine, self.plan, self.val = cfg, runtime, engine, plan, val
        self.tokenizer, self.vision, self.metrics = tokenizer, vision, metrics
        self.only_at_end = only_at_end
        self.run_dir = Path(cfg.run.dir)
        self.scorer = None
        self.generator = None
        if plan.reward is not None and ulysses_free(engine):  # whole sequences only (as the generation engines)
            self.scorer = contain(resolve_reward_fn(plan.reward, "eval.reward"), plan.reward)
            if isinstance(self.scorer, ContainedReward):
                self.scorer.start()
            self.generator = build_generator("hf", engine.model, cfg.infer, runtime, pad_token_id(tokenizer),
                                             tokenizer.eos_token_id)
        self.last: dict[str, float] = {}
        """The metrics of the latest evaluation (the summary's ``val``)."""
        self.samples: Path | None = None

    def due(self, step: int, max_steps: int) -> bool:
        if self.only_at_end:
            return step == max_steps
        return is_eval_step(step, self.plan.every_steps, max_steps)

    def run(self, step: int) -> dict[str, float]:
        """Evaluate the model as it is after `step` steps; logs the metrics line (rank 0),
        writes the samples file and sends the trackers their rows."""
        t0 = time.perf_counter()
        main = self.runtime.is_main
        rows: list[dict] = []
        if isinstance(self.val, preference.PairsValidation):  # pairs: the objective's own metrics
            out = self.val.evaluate()
            out["time/eval"] = time.perf_counter() - t0
            self.metrics.log(step, out)
            self.last = out
            return out
        total = self.engine.eval_loss_sum(self.val.micro_batches, progress=main)
        loss = total / self.val.loss_tokens
        out: dict[str, float] = {"val/loss": loss, "val/ppl": math.inf if loss > 700 else math.exp(loss)}
        if self.generator is not None:
            res = evaluate(lambda batch: generate_on_ranks(self.generator, batch), self.tokenizer, self.plan,
                           self.scorer, seed=self.cfg.run.seed, max_length=self.cfg.data.max_length, step=step,
                           timeout_s=self.cfg.rl.reward.timeout_s, timeout_key="rl.reward.timeout_s",
                           vision=self.vision, chat=text_prompts_as_chat(self.cfg.data),
                           extract=extract_fn(self.plan.reward), progress=main)
            out |= {k: v for k, v in res.metrics.items() if k != "time/eval"}
            rows = res.rows
        out["time/eval"] = time.perf_counter() - t0
        self.metrics.log(step, out)
        if rows and main:
            self.samples = write_samples(self.run_dir, step, rows, resume_line)
            if self.plan.samples_logged:
                self.metrics.log_samples(step, rows[:self.plan.samples_logged])
        self.last = out
        return out

    def close(self) -> None:
        if isinstance(self.scorer, ContainedReward):
            self.scorer.close()


def run(prepared: Prepared, runtime: Runtime) -> dict:
    """Train; returns a summary dict (paths and final numbers) on every rank."""
    cfg = prepared.cfg
    run_dir = Path(cfg.run.dir)
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(by_alias=True, mode="json"), indent=2))
    encoder_task = encoder.is_encoder_task(cfg.model.task)
    tokenizer, tok_dir = shared_tokenizer(cfg.model.tokenizer, cfg.model.path, cfg.run.dir, encoder=encoder_task,
                                          tools=wants_tools_tokenizer(cfg))
    use_chat_template(tokenizer, cfg.data.chat_template)
    pairs = cfg.train.objective in PAIR_OBJECTIVES
    task, extra = preference.engine_task(cfg, tokenizer) if pairs else (cfg.model.task, {})
    hf_config = load_hf_config(cfg.model, **extra)
    vision = vision_inputs(cfg, tokenizer)
    check_vocab(tokenizer, hf_config.get_text_config().vocab_size)
    engine = TrainEngine(cfg, runtime, task=task, planned=prepared.planned, **extra)
    prepared.planned = None  # fully_shard changed that model in place: it is the engine's now
    val_pairs = None
    if encoder_task:
        data = encoder.EncoderData(cfg, prepared.records, tokenizer, engine.dp_rank, engine.dp_size)
    elif pairs:
        data = preference.PairsData(cfg, prepared.records, tokenizer, engine)
        if prepared.val_records is not None:
            val_pairs = preference.PairsValidation(cfg, prepared.val_records, tokenizer, engine)
    else:
        data = SFTData(cfg, prepared.records, tokenizer, engine.dp_rank, engine.dp_size, vision)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint, runtime, job="train")
    start = ckpt.resolve_resume()
    if pairs:  # before a checkpoint is loaded: a stored reference is the initial policy's
        preference.build_reference(cfg, runtime, engine, [(data, preference.REFERENCE_FILE)] + (
            [(val_pairs, preference.VAL_REFERENCE_FILE)] if val_pairs is not None else []), run_dir, start is not None)
    saved_final: dict[str, Any] = {}
    if start is not None:
        extra = ckpt.load(engine, start)
        data.load_state_dict(extra["sampler"])
        saved_final = _saved_final(extra, run_dir, engine.step)
        if runtime.is_main:
            log.info("resumed from %s at step %d", start, engine.step)
    if cfg.checkpoint.keep_best is not None and runtime.is_main:
        forget_best_after(run_dir, engine.step)  # evaluations after the step resumed from never happened
    max_steps = cfg.train.max_steps
    if start is not None and engine.step >= max_steps and runtime.is_main:
        log.warning("nothing left to train: %s is at step %d and train.max_steps is %d (raise train.max_steps "
                    "to train on); its model is exported and evaluated again", start, engine.step, max_steps)
    metrics = open_metrics(cfg, enabled=runtime.is_main, after_step=engine.step)
    evaluation = None
    try:
        plan = prepared.eval_plan
        if plan is not None and prepared.val_records is not None:
            val = val_pairs if pairs else ValidationSet(cfg, prepared.val_records, tokenizer, engine.dp_rank,
                                                        engine.dp_size, vision)
            # a built-in data.source's held-out examples, nobody asked for more: at the end, as always
            only_at_end = (plan.builtin and plan.source == cfg.data.source and plan.every_steps == 0
                           and cfg.checkpoint.keep_best is None)
            evaluation = Evaluation(cfg, runtime, engine, plan, val, tokenizer, vision, metrics, only_at_end)
        summary = _train(cfg, runtime, engine, data, ckpt, metrics, max_steps, saved_final, evaluation,
                         resumed=start is not None)
        summary |= _finish(cfg, runtime, engine, ckpt, hf_config, tokenizer, tok_dir, vision, evaluation)
    except BaseException:
        metrics.close(failed=True)
        raise
    finally:
        if evaluation is not None:
            evaluation.close()
    metrics.log_summary(summary)
    metrics.close()
    return summary


def _saved_final(extra: dict[str, Any], run_dir: Path, step: int) -> dict[str, Any]:
    """The last step's metrics as of a resumed checkpoint (the summary's ``final`` when
    nothing is left to train): what the checkpoint recorded, else that step's line of
    metrics.jsonl (a checkpoint saved before it recorded them), else {}."""
    if isinstance(extra.get("final"), dict):
        return extra["final"]
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step") == step and "loss" in row:
            return {k: v for k, v in row.items() if k != "step"}
    return {}


def _train(cfg: Config, runtime: Runtime, engine: TrainEngine, data: SFTData, ckpt: CheckpointManager,
           metrics: MetricsWriter, max_steps: int, last: dict[str, Any] | None = None,
           evaluation: Evaluation | None = None, resumed: bool = False) -> dict:
    """The steps until `max_steps`, with the evaluations (`Evaluation.due`: the step is
    evaluated, then checkpointed, then recorded as best or not; a resumed run's first step
    was evaluated by the run that saved it); the summary's steps, last metrics (`last` when
    no step is left: the resumed checkpoint's) and paths."""
    run_dir = Path(cfg.run.dir)
    keep_best = cfg.checkpoint.keep_best

    def evaluate_and_save(step: int, save: bool, saved: bool = False) -> None:
        """Evaluate `step` when due (always when `saved`: the checkpoint resumed from, with
        nothing left to train), then checkpoint it when `save` or (keep_best) it was
        evaluated, unless `saved`; then record the best."""
        evaluated = evaluation is not None and (saved or evaluation.due(step, max_steps))
        if evaluated:
            evaluation.run(step)
        best_too = evaluated and keep_best is not None
        if (save or best_too) and not saved:
            ckpt.save(engine, step, extra={"sampler": data.state_dict(), "final": last}, final=step == max_steps)
        if best_too and runtime.is_main and record_best(run_dir, keep_best, step, evaluation.last):
            ckpt.prune()  # the best before it may be beyond keep_last now

    bar = Progress(total=max_steps, enabled=runtime.is_main, desc="sft", initial=engine.step)
    last = dict(last or {})
    try:
        if not resumed:
            evaluate_and_save(0, False)
        elif engine.step >= max_steps:  # a resume with nothing left: evaluated again
            evaluate_and_save(engine.step, False, saved=True)
        while engine.step < max_steps:
            t0 = time.perf_counter()
            mbs, loss_tokens, tokens = data.next_step()
            res = engine.train_step(mbs, loss_tokens, loss_fn=data.loss_fn,
                                    agree=cfg.train.max_tokens_per_micro_batch is not None)
            dt = time.perf_counter() - t0
            step = engine.step
            last = {"loss": res.loss, "grad_norm": res.grad_norm, "lr": res.lr,
                    "tokens_per_s": tokens / dt, "step_time_s": dt, "skipped": int(res.skipped),
                    "peak_memory_bytes": peak_memory_bytes(runtime.device)}
            if isinstance(data, preference.PairsData):
                last |= data.step_metrics()
            if step % cfg.train.log_every == 0 or step == max_steps:
                metrics.log(step, last)
            bar.update(1, loss=res.loss, **{"tok/s": tokens / dt})
            evaluate_and_save(step, ckpt.should_save(step, max_steps))
        ckpt.close()
    finally:
        bar.close()
    summary = {"run_dir": str(run_dir), "steps": engine.step, "final": last,
               "metrics": str(run_dir / "metrics.jsonl"), "checkpoint": str(ckpt.latest() or "")}
    if evaluation is not None and evaluation.last:
        summary["val"] = dict(evaluation.last)
        if "val/accuracy" in evaluation.last and evaluation.plan.builtin:
            summary["accuracy"] = evaluation.last["val/accuracy"]  # the held-out accuracy this job always reported
        if evaluation.samples is not None:
            summary["samples"] = str(evaluation.samples)
    return summary


def _finish(cfg: Config, runtime: Runtime, engine: TrainEngine, ckpt: CheckpointManager, hf_config, tokenizer,
            tok_dir, vision, evaluation: Evaluation | None) -> dict:
    """Exports (of the best checkpoint with ``checkpoint.export_from: best``) and the plot:
    the rest of the summary."""
    run_dir = Path(cfg.run.dir)
    summary: dict[str, Any] = {}
    source = ckpt.latest()
    if cfg.checkpoint.export_from == "best" and cfg.checkpoint.export_hf:
        box = [str(best_checkpoint(run_dir) or "") if runtime.is_main else None]
        if dist.is_initialized() and dist.get_world_size() > 1:  # rank 0 recorded it: every rank loads the same
            dist.broadcast_object_list(box, src=0)
        if box[0]:
            source = Path(box[0])
            if source != ckpt.latest():
                ckpt.load(engine, source)
        elif runtime.is_main:
            log.warning("checkpoint.export_from: best, but no best checkpoint is recorded in %s; the last step is "
                        "exported", ckpt.dir)
    if cfg.checkpoint.export_hf:
        summary["exported_step"] = engine.step
    if cfg.checkpoint.export_hf and cfg.model.lora.enabled:
        summary["adapter"] = str(export_adapter(engine.model, run_dir / "adapter", base=cfg.model.path))
    if cfg.checkpoint.export_hf and (not cfg.model.lora.enabled or cfg.checkpoint.export_merged):
        out = run_dir / "hf"
        export_model(engine.model, out, hf_config, tokenizer_dir=tok_dir, checkpoint=source)
        if vision is not None and runtime.is_main:
            vision.save(out)
        if runtime.is_main:
            export_template(out, cfg.data.chat_template)
        summary["hf"] = str(out)
    if runtime.is_main and (run_dir / "metrics.jsonl").is_file():
        panels = [("loss", ["loss"]), ("learning rate", ["lr"]), ("grad norm", ["grad_norm"])]
        if evaluation is not None:
            panels += val_panels(read_metrics(run_dir / "metrics.jsonl"))
        png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "sft.png", panels)
        summary["plot"] = str(png)
    return summary


def ulysses_free(engine: TrainEngine) -> bool:
    """Generation takes whole sequences: not on a model whose attention is sequence-parallel."""
    return engine.sp_group is None
