"""The SFT job behind `shardwise train`: data -> TrainEngine -> checkpoints -> HF export.

Everything that can be wrong in the config is checked by `prepare` before any process
group exists; `run` is the loop. Rank 0 shows a progress bar and writes
`run.dir/metrics.jsonl` (and TensorBoard events when installed) and a PNG plot at the end.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config.schema import Config
from shardwise.distributed.mesh import MeshSpec, mesh_spec
from shardwise.distributed.runtime import Runtime, env_world
from shardwise.engine.batching import check_batch_sizes
from shardwise.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    cfg: Config
    spec: MeshSpec
    grad_accum: int


def prepare(cfg: Config, world_size: int | None = None) -> Prepared:
    """All config and input checks (world size, model folder, data, resume folder); raises
    a ShardwiseError, starts nothing, writes nothing."""
    from shardwise.fsdp.build import plan_for
    from shardwise.jobs.inputs import check_data, check_model, check_resume

    world = world_size if world_size is not None else env_world()[1]
    spec = mesh_spec(cfg.parallel, world)
    accum = check_batch_sizes(cfg.train, spec.dp_size)
    check_model(cfg)
    check_resume(cfg)
    check_data(cfg, cfg.data.response_key)
    plan_for(cfg, spec)  # pattern errors surface here, on the meta device
    if spec.ulysses > 1:
        from shardwise.distributed.ulysses import check_model
        from shardwise.models.loading import load_hf_config

        if cfg.data.packing:
            raise ConfigError("data.packing", "packed rows cannot be split by Ulysses sequence parallel",
                              "set data.packing=false, or parallel.ulysses_size=1")
        check_model(load_hf_config(cfg.model), spec.ulysses)
    return Prepared(cfg, spec, accum)


def resolve_tokenizer(cfg: Config, runtime: Runtime):
    """The tokenizer: model.tokenizer, else model.path, else the built-in task's char
    tokenizer built by rank 0 into run.dir/tokenizer."""
    from transformers import AutoTokenizer

    from shardwise.data.tokenizer import build_char_tokenizer, has_tokenizer_files, locate_tokenizer

    if cfg.model.tokenizer is not None and not has_tokenizer_files(cfg.model.tokenizer):
        raise ConfigError("model.tokenizer", f"{cfg.model.tokenizer!r} holds no tokenizer files")
    # Rank 0 decides whether to build, and every rank follows its decision: a rank that
    # looked after rank 0 had written the folder would otherwise skip the barrier.
    found = locate_tokenizer(cfg.model.tokenizer, cfg.model.path, cfg.run.dir) if runtime.is_main else None
    decision = [None if found is None else str(found)]
    dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        found = Path(decision[0])
    else:
        found = Path(cfg.run.dir) / "tokenizer"
        if runtime.is_main:
            build_char_tokenizer(found)
        dist.barrier()
    return AutoTokenizer.from_pretrained(str(found)), str(found)


def check_vocab(tokenizer, hf_config) -> None:
    if len(tokenizer) > hf_config.vocab_size:
        raise ConfigError("model.config.vocab_size", f"{hf_config.vocab_size} is smaller than the "
                          f"tokenizer's {len(tokenizer)} tokens", f"set vocab_size >= {len(tokenizer)}")


class SFTData:
    """Tokenised examples and the per-step batches of this rank."""

    def __init__(self, cfg: Config, tokenizer, dp_rank: int, dp_size: int):
        from shardwise.data.collate import tokenize_pair, truncation_note
        from shardwise.data.sampler import GlobalBatchSampler
        from shardwise.data.sources import load_records

        d = cfg.data
        records = load_records(d.source, d.prompt_key, d.response_key, seed=cfg.run.seed)
        self.examples = [tokenize_pair(tokenizer, r["prompt"], r["response"], d.max_length) for r in records]
        note = truncation_note(tokenizer, records, d.max_length, with_response=True) if dist.get_rank() == 0 else None
        if note:
            log.warning("data: %s", note)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.cfg = cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = GlobalBatchSampler(len(self.examples), cfg.train.global_batch_size, cfg.run.seed)
        self._it = iter(self.sampler)

    def collate(self, examples: list) -> dict[str, torch.Tensor]:
        from shardwise.data.collate import pack_collate, pad_collate

        if self.cfg.data.packing:
            return pack_collate(examples, self.cfg.data.max_length, self.pad_id)
        return pad_collate(examples, self.pad_id)

    def next_step(self) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """(this rank's micro-batches, loss tokens in the whole global batch, tokens in it)."""
        from shardwise.data.collate import example_loss_tokens
        from shardwise.data.sampler import micro_batches, rank_share

        indices = next(self._it)
        global_examples = [self.examples[i] for i in indices]
        loss_tokens = sum(example_loss_tokens(ex) for ex in global_examples)
        if loss_tokens == 0:
            from shardwise.errors import DataError

            raise DataError(f"data.max_length: no example of a global batch keeps a response token after "
                            f"truncation to {self.cfg.data.max_length} tokens; raise data.max_length")
        tokens = sum(len(ex["input_ids"]) for ex in global_examples)
        mine = rank_share(indices, self.dp_rank, self.dp_size)
        mbs = [self.collate([self.examples[i] for i in mb])
               for mb in micro_batches(mine, self.cfg.train.micro_batch_size)]
        return mbs, loss_tokens, tokens

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = iter(self.sampler)


def run(cfg: Config, runtime: Runtime) -> dict:
    """Train; returns a summary dict (paths and final numbers) on every rank."""
    from shardwise.checkpoint.dcp import CheckpointManager
    from shardwise.engine.train import TrainEngine
    from shardwise.models.loading import load_hf_config
    from shardwise.telemetry import MetricsWriter, Progress, peak_memory_bytes, plot_metrics

    run_dir = Path(cfg.run.dir)
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(by_alias=True, mode="json"), indent=2))
    tokenizer, tok_dir = resolve_tokenizer(cfg, runtime)
    check_vocab(tokenizer, load_hf_config(cfg.model))
    engine = TrainEngine(cfg, runtime)
    data = SFTData(cfg, tokenizer, engine.dp_rank, engine.dp_size)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint, runtime)
    start = ckpt.resolve_resume()
    if start is not None:
        extra = ckpt.load(engine, start)
        data.load_state_dict(extra["sampler"])
        if runtime.is_main:
            log.info("resumed from %s at step %d", start, engine.step)
    max_steps = cfg.train.max_steps
    metrics = MetricsWriter(run_dir, enabled=runtime.is_main, after_step=engine.step)
    bar = Progress(total=max_steps, enabled=runtime.is_main, desc="sft", initial=engine.step)
    last = {}
    try:
        while engine.step < max_steps:
            t0 = time.perf_counter()
            mbs, loss_tokens, tokens = data.next_step()
            res = engine.train_step(mbs, loss_tokens)
            dt = time.perf_counter() - t0
            step = engine.step
            last = {"loss": res.loss, "grad_norm": res.grad_norm, "lr": res.lr,
                    "tokens_per_s": tokens / dt, "step_time_s": dt, "skipped": int(res.skipped),
                    "peak_memory_bytes": peak_memory_bytes(runtime.device)}
            if step % cfg.train.log_every == 0 or step == max_steps:
                metrics.log(step, last)
            bar.update(1, loss=res.loss, **{"tok/s": tokens / dt})
            if ckpt.should_save(step, max_steps):
                ckpt.save(engine, step, extra={"sampler": data.state_dict()}, final=step == max_steps)
        ckpt.wait()
    finally:
        bar.close()
        metrics.close()
    summary = {"run_dir": str(run_dir), "steps": engine.step, "final": last,
               "metrics": str(run_dir / "metrics.jsonl"), "checkpoint": str(ckpt.latest() or "")}
    if cfg.checkpoint.export_hf:
        from shardwise.checkpoint.hf_export import export_model

        out = run_dir / "hf"
        export_model(engine.model, out, load_hf_config(cfg.model), tokenizer_dir=tok_dir)
        summary["hf"] = str(out)
        if runtime.is_main and cfg.data.source.startswith("builtin:"):
            from shardwise.data.tasks import HELDOUT_PROMPTS, HELDOUT_SEED_OFFSET
            from shardwise.jobs.evaluate import task_accuracy

            summary["accuracy"] = task_accuracy(out, cfg.data.source.split(":", 1)[1], n=HELDOUT_PROMPTS,
                                                seed=cfg.run.seed + HELDOUT_SEED_OFFSET)
    if runtime.is_main and (run_dir / "metrics.jsonl").is_file():
        png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "sft.png",
                           [("loss", ["loss"]), ("learning rate", ["lr"]), ("grad norm", ["grad_norm"])])
        summary["plot"] = str(png)
    return summary
