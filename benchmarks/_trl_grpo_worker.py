"""One rank of TRL's `GRPOTrainer` for `rl_vs_trl.py`; runs in the benchmark's TRL venv.

    accelerate launch --cpu --num_processes 2 benchmarks/_trl_grpo_worker.py SPEC.json

SPEC.json (written by `rl_vs_trl.py`) holds everything this run must match in the shardwise
run: the model folder, the prompt records in the order shardwise's sampler visits them
(one global batch per step), the reward spec, ``data.max_length``, the GRPOConfig fields,
the learning-rate multiplier of every optimizer step and where to write.

What is shardwise's here, imported from its source tree (pure Python plus torch, no
shardwise install): the prompt tokenization (`tokenize_prompt`: ``[bos] + prompt``, the
last max_length tokens), the decoding a reward function sees (`decode_responses`: up to
the first eos, no special tokens) and the reward function itself (`resolve_reward_fn`).
Everything else (sampling, advantages, the loss, the optimizer) is TRL's.

Rank 0 writes one JSON line per optimizer step to SPEC["steps_path"]: ``step``,
``reward`` (TRL's logged mean reward of the step's completions), ``time`` (wall clock at
the step's end, seconds since the epoch) and ``train_start`` (wall clock at the first
step's start), plus TRL's other logged numbers and rank 0's own count of the step
(`Phases`): ``time/generate`` (`_generate`), ``time/reward`` (`_calculate_rewards`),
``time/log_probs`` (the forwards without gradient: old / reference log-probs),
``time/update`` (the loss forwards and backwards, and the optimizer step), and
``update/tokens`` / ``update/padded_tokens``: the real (attention-mask) tokens of the
loss forwards and all the tokens they ran on, padding included.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from shardwise.data.batch import Batch
from shardwise.data.encode import tokenize_prompt
from shardwise.data.rewards import decode_responses, resolve_reward_fn


class Phases:
    """This rank's seconds per phase and update-forward token counts since the last log."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + value

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


PHASES = Phases()


class StepLog(TrainerCallback):
    """Wall clock of each optimizer step's end, joined with the step's logged metrics and
    `PHASES`; times the optimizer step into ``time/update``."""

    def __init__(self, path: Path):
        self.path = path
        self.train_start: float | None = None
        self.ends: dict[int, float] = {}
        self.opt_start = 0.0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.opt_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        PHASES.add("time/update", time.perf_counter() - self.opt_start)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.train_start is None:
            self.train_start = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.ends[state.global_step] = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        step = state.global_step
        line = {"step": step, "time": self.ends.get(step, time.time()), "train_start": self.train_start,
                **{k: v for k, v in logs.items() if isinstance(v, (int, float))}, **PHASES.take()}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def task_reward(fn, tokenizer):
    """A TRL reward function scoring each completion as shardwise does: the completion's
    tokens decoded by `decode_responses`, then ``fn(prompt, text, ground_truth)``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def reward(prompts, completions, completion_ids, ground_truth, **kwargs):
        width = max((len(x) for x in completion_ids), default=1) or 1
        ids = torch.full((len(completion_ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(completion_ids), width), dtype=torch.long)
        for row, tokens in enumerate(completion_ids):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
        texts, _ = decode_responses(Batch.from_dict({"input_ids": ids, "response_mask": mask}), tokenizer)
        return [float(fn(str(p), t, str(g))) for p, t, g in zip(prompts, texts, ground_truth, strict=True)]

    reward.__name__ = "task_reward"
    return reward


class TimedTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with shardwise's prompt tokens and learning-rate factors, and
    rank 0's phases counted into `PHASES` (`_trl_agentic_worker.py` subclasses it).

    ``max_length``: ``data.max_length``; ``lr_factors``: shardwise's multiplier of every
    optimizer step."""

    def __init__(self, *args, max_length: int, lr_factors: list[float], **kwargs):
        self.prompt_max_length = max_length
        self.lr_factors = lr_factors
        super().__init__(*args, **kwargs)

    # shardwise's prompt tokens ([bos] + prompt, last max_length) instead of TRL's
    # tokenizer(text) (which adds no bos with this tokenizer)
    def _tokenize_prompts(self, prompts: list):
        return [tokenize_prompt(self.processing_class, p, self.prompt_max_length) for p in prompts], None, {}

    # Rank 0's phases (`Phases`): generation, reward, the no-grad log-prob forwards and
    # the update (training_step less the generation it triggers; the optimizer step is
    # timed by StepLog), and the update forwards' real and padded tokens.
    def _generate(self, prompts):
        t0 = time.perf_counter()
        try:
            return super()._generate(prompts)
        finally:
            PHASES.add("time/generate", time.perf_counter() - t0)

    def _calculate_rewards(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super()._calculate_rewards(*args, **kwargs)
        finally:
            PHASES.add("time/reward", time.perf_counter() - t0)

    def _prepare_inputs(self, generation_batch):
        t0 = time.perf_counter()
        try:
            return super()._prepare_inputs(generation_batch)
        finally:
            self._prepare_s += time.perf_counter() - t0

    def training_step(self, model, inputs, num_items_in_batch):
        self._prepare_s = 0.0
        t0 = time.perf_counter()
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            PHASES.add("time/update", time.perf_counter() - t0 - self._prepare_s)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *args, **kwargs):
        t0 = time.perf_counter()
        grad = torch.is_grad_enabled()
        try:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)
        finally:
            if grad:
                PHASES.add("update/tokens", float(attention_mask.sum()))
                PHASES.add("update/padded_tokens", float(attention_mask.numel()))
            else:
                PHASES.add("time/log_probs", time.perf_counter() - t0)

    # shardwise's schedule, step for step (HF's warmup starts at 0, shardwise's at 1/warmup)
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            factors = self.lr_factors
            opt = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: factors[min(s, len(factors) - 1)])
            self._created_lr_scheduler = True
        return self.lr_scheduler


def records(spec: dict) -> list[dict]:
    """The prompt records of every step, in shardwise's order (SPEC["records_path"])."""
    return [json.loads(x) for x in Path(spec["records_path"]).read_text().splitlines()]


def train(spec: dict, trainer_cls: type[TimedTrainer], **kwargs) -> int:
    """`trainer_cls` built from SPEC (model, GRPOConfig fields, prompt length, lr factors,
    the step log) and `kwargs` (the dataset, reward functions, tokenizer, ...), trained."""
    trainer = trainer_cls(model=spec["model"], args=GRPOConfig(**spec["grpo_config"]),
                          callbacks=[StepLog(Path(spec["steps_path"]))], max_length=int(spec["max_length"]),
                          lr_factors=[float(x) for x in spec["lr_factors"]], **kwargs)
    trainer.train()
    return 0


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in records(spec)])
    return train(spec, TimedTrainer, reward_funcs=task_reward(resolve_reward_fn(spec["reward"]), tokenizer),
                 train_dataset=dataset, processing_class=tokenizer)


def leave(status: int) -> None:
    """Leave without the interpreter's shutdown: a gloo thread torn down at exit aborts a
    rank now and then ("terminate called without an active exception") after its work is
    done, and torchrun would report the run as failed (shardwise's ranks do the same)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    leave(main())
