"""The SFT recipe behind `shardwise train`: data -> TrainEngine -> checkpoints -> HF export.

`prepare` runs every check a config and its files allow before any process group exists
(mesh, batch sizes, model folder, tokenizer, data, resume folder, the sharding plan on the
meta device) and keeps what it built; `run` is the loop, on every rank. Rank 0 shows a
progress bar and writes ``run.dir/metrics.jsonl`` (and to the trackers of ``run.loggers``:
each step's scalars, the config, the summary) and a PNG plot at the end. For a built-in
task the held-out greedy accuracy of the trained model is measured on all ranks
(`shardwise.engine.generate.heldout_accuracy`).
``model.task`` masked_lm / sequence_classification (encoders) run the same loop on the
data and losses of `shardwise.data.encoder`, without generation.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.dcp import CheckpointManager
from shardwise.checkpoint.hf_export import export_adapter, export_model
from shardwise.config.schema import Config
from shardwise.config.validate import MeshSpec, check_sft_batch, mesh_spec
from shardwise.data import encoder
from shardwise.data.chat import export_template, text_prompts_as_chat, use_chat_template
from shardwise.data.collate import example_loss_tokens, pack_collate, pad_collate
from shardwise.data.encode import encode_records, summarize_truncation
from shardwise.data.sampler import GlobalBatchSampler, micro_batches, rank_share, token_budget_micro_batches
from shardwise.data.tokenizer import check_vocab, pad_token_id, shared_tokenizer
from shardwise.distributed import ulysses
from shardwise.distributed.runtime import Runtime, env_world
from shardwise.engine.generate import (
    build_generator,
    generate_on_ranks,
    heldout_accuracy,
)
from shardwise.engine.train import TrainEngine
from shardwise.errors import ConfigError, DataError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.plan import ShardingPlan
from shardwise.jobs.inputs import (
    check_data,
    check_model,
    check_resume,
    check_tokenizer,
    check_tokens,
    vision_inputs,
    wants_tools_tokenizer,
)
from shardwise.jobs.tracking import open_metrics
from shardwise.models.loading import load_hf_config
from shardwise.models.vision import VisionInputs
from shardwise.telemetry import MetricsWriter, Progress, peak_memory_bytes, plot_metrics

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


def prepare(cfg: Config, world_size: int | None = None) -> Prepared:
    """All config and input checks for `world_size` ranks (default: torchrun's world);
    raises a ShardwiseError, starts nothing, writes nothing."""
    world = world_size if world_size is not None else env_world()[1]
    spec = mesh_spec(cfg.parallel, world)
    accum = check_sft_batch(cfg.train, spec.dp_size)
    check_model(cfg)
    check_tokenizer(cfg)
    check_resume(cfg, "train")
    if encoder.is_encoder_task(cfg.model.task):
        records = encoder.prepare_inputs(cfg, spec, load_hf_config(cfg.model))
    else:
        records = check_data(cfg, cfg.data.response_key, sft=True)
        check_tokens(cfg, records)
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
    planned = plan_for(cfg, spec, cfg.model.task)  # pattern errors surface here, on the meta device
    return Prepared(cfg, spec, accum, records, planned)


class SFTData:
    """Tokenised examples and the per-step batches of this rank."""

    loss_fn = None
    """The engine's default loss (the causal-LM loss); `shardwise.data.encoder.EncoderData` has its own."""

    def __init__(self, cfg: Config, records: list[dict[str, Any]], tokenizer, dp_rank: int, dp_size: int,
                 vision: VisionInputs | None = None):
        d = cfg.data
        self.vision = vision
        # a VL example's image tokens follow bos (shardwise.models.vision)
        encoded = encode_records(tokenizer, records, d.max_length, d.train_on,
                                 vision.prompt_prefix if vision is not None else (), progress=dist.get_rank() == 0)
        self.examples = []
        for r, enc in zip(records, encoded):
            ex = dict(enc.example)
            if vision is not None:
                ex["pixel_values"], ex["image_grid_thw"] = vision.encode(r["image"])
            self.examples.append(ex)
        note = (summarize_truncation([e.length for e in encoded], [e.lost for e in encoded], d.max_length, True)
                if dist.get_rank() == 0 else None)
        if note:
            log.warning("data: %s", note)
        self.pad_id = pad_token_id(tokenizer)
        self.cfg = cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = GlobalBatchSampler(len(self.examples), cfg.train.global_batch_size, cfg.run.seed)
        self._it = iter(self.sampler)

    def collate(self, examples: list) -> dict[str, torch.Tensor]:
        if self.cfg.data.packing:
            return pack_collate(examples, self.cfg.data.max_length, self.pad_id)
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
        mine = rank_share(indices, self.dp_rank, self.dp_size)
        budget = self.cfg.train.max_tokens_per_micro_batch
        if budget is None:
            split = micro_batches(mine, self.cfg.train.micro_batch_size)
        else:
            split = token_budget_micro_batches(mine, [len(self.examples[i]["input_ids"]) for i in mine], budget,
                                               packed=self.cfg.data.packing)
        mbs = [self.collate([self.examples[i] for i in mb]) for mb in split]
        return mbs, loss_tokens, tokens

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = iter(self.sampler)


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
    hf_config = load_hf_config(cfg.model)
    vision = vision_inputs(cfg, tokenizer)
    check_vocab(tokenizer, hf_config.get_text_config().vocab_size)
    engine = TrainEngine(cfg, runtime, task=cfg.model.task, planned=prepared.planned)
    prepared.planned = None  # fully_shard changed that model in place: it is the engine's now
    if encoder_task:
        data = encoder.EncoderData(cfg, prepared.records, tokenizer, engine.dp_rank, engine.dp_size)
    else:
        data = SFTData(cfg, prepared.records, tokenizer, engine.dp_rank, engine.dp_size, vision)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint, runtime, job="train")
    start = ckpt.resolve_resume()
    saved_final: dict[str, Any] = {}
    if start is not None:
        extra = ckpt.load(engine, start)
        data.load_state_dict(extra["sampler"])
        saved_final = _saved_final(extra, run_dir, engine.step)
        if runtime.is_main:
            log.info("resumed from %s at step %d", start, engine.step)
    max_steps = cfg.train.max_steps
    if start is not None and engine.step >= max_steps and runtime.is_main:
        log.warning("nothing left to train: %s is at step %d and train.max_steps is %d (raise train.max_steps "
                    "to train on); its model is exported and evaluated again", start, engine.step, max_steps)
    metrics = open_metrics(cfg, enabled=runtime.is_main, after_step=engine.step)
    try:
        summary = _train(cfg, runtime, engine, data, ckpt, metrics, max_steps, saved_final)
        summary |= _finish(cfg, runtime, engine, ckpt, hf_config, tokenizer, tok_dir, vision, encoder_task)
    except BaseException:
        metrics.close(failed=True)
        raise
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
           metrics: MetricsWriter, max_steps: int, last: dict[str, Any] | None = None) -> dict:
    """The steps until `max_steps`; the summary's steps, last metrics (`last` when no step
    is left: the resumed checkpoint's) and paths."""
    run_dir = Path(cfg.run.dir)
    bar = Progress(total=max_steps, enabled=runtime.is_main, desc="sft", initial=engine.step)
    last = dict(last or {})
    try:
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
            if step % cfg.train.log_every == 0 or step == max_steps:
                metrics.log(step, last)
            bar.update(1, loss=res.loss, **{"tok/s": tokens / dt})
            if ckpt.should_save(step, max_steps):
                ckpt.save(engine, step, extra={"sampler": data.state_dict(), "final": last}, final=step == max_steps)
        ckpt.close()
    finally:
        bar.close()
    return {"run_dir": str(run_dir), "steps": engine.step, "final": last,
            "metrics": str(run_dir / "metrics.jsonl"), "checkpoint": str(ckpt.latest() or "")}


def _finish(cfg: Config, runtime: Runtime, engine: TrainEngine, ckpt: CheckpointManager, hf_config, tokenizer,
            tok_dir, vision, encoder_task: bool) -> dict:
    """Exports, the held-out accuracy and the plot: the rest of the summary."""
    run_dir = Path(cfg.run.dir)
    summary: dict[str, Any] = {}
    if cfg.checkpoint.export_hf and cfg.model.lora.enabled:
        summary["adapter"] = str(export_adapter(engine.model, run_dir / "adapter", base=cfg.model.path))
    if cfg.checkpoint.export_hf and (not cfg.model.lora.enabled or cfg.checkpoint.export_merged):
        out = run_dir / "hf"
        export_model(engine.model, out, hf_config, tokenizer_dir=tok_dir, checkpoint=ckpt.latest())
        if vision is not None and runtime.is_main:
            vision.save(out)
        if runtime.is_main:
            export_template(out, cfg.data.chat_template)
        summary["hf"] = str(out)
    if ulysses_free(engine) and not encoder_task:
        generator = build_generator("hf", engine.model, cfg.infer, runtime, pad_token_id(tokenizer),
                                    tokenizer.eos_token_id)
        accuracy = heldout_accuracy(lambda batch: generate_on_ranks(generator, batch), tokenizer,
                                    cfg.data.source, cfg.run.seed, cfg.data.max_length, vision=vision,
                                    chat=text_prompts_as_chat(cfg.data))
        if accuracy is not None:
            summary["accuracy"] = accuracy
    if runtime.is_main and (run_dir / "metrics.jsonl").is_file():
        png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "sft.png",
                           [("loss", ["loss"]), ("learning rate", ["lr"]), ("grad norm", ["grad_norm"])])
        summary["plot"] = str(png)
    return summary


def ulysses_free(engine: TrainEngine) -> bool:
    """Generation takes whole sequences: not on a model whose attention is sequence-parallel."""
    return engine.sp_group is None
