"""`shardwise train` on preference pairs: ``train.objective`` dpo and reward_model.

The SFT recipe (`shardwise.jobs.sft`) runs the loop, the checkpoints, the evaluation and
the export; this module supplies what differs: the pairs (`shardwise.data.pairs`, checked
before launch), the model's task (a one-label sequence classifier for a reward model),
the reference of DPO and the data object whose batches and loss the loop trains on.

The DPO reference (loss types that need one): with ``train.dpo.precompute_ref`` the
initial policy's log-probs of every pair, computed before the first step and stored in
run.dir/dpo_reference.safetensors (a resumed run reads them back; no second model ever
exists); else, with model.lora, the policy with its adapters off; else a frozen copy,
sharded like the policy (`shardwise.engine.infer.InferEngine`). Its log-probs of a step's
micro-batches are computed before the step's forwards and carried in the batches
(``ref_logps``).

One step: train.global_batch_size pairs, each rank its contiguous share, cut into
micro-batches of train.micro_batch_size pairs (2 x that many rows, chosen then rejected:
one forward for both); the loss is the mean over the global batch's pairs, so N ranks
give the 1-rank update.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardwise.config.schema import Config
from shardwise.data.pairs import check_pairs, collate_pairs, encode_pairs, load_pairs
from shardwise.data.sampler import GlobalBatchSampler, micro_batches, rank_share
from shardwise.data.tokenizer import has_tokenizer_files, load_tokenizer, pad_token_id
from shardwise.engine.evaluate import EvalPlan
from shardwise.engine.infer import InferEngine
from shardwise.engine.preference import REFERENCE_FREE, DPOLoss, RewardModelLoss, reference_log_probs
from shardwise.errors import ConfigError, DataError
from shardwise.models import lora
from shardwise.models.loading import load_hf_config

log = logging.getLogger(__name__)

__all__ = ["PairsData", "PairsValidation", "build_reference", "check_config", "engine_task", "load_checked_pairs", "pairs_eval_plan"]

REFERENCE_FILE = "dpo_reference.safetensors"
VAL_REFERENCE_FILE = "dpo_reference_val.safetensors"


def check_config(cfg: Config, spec) -> None:
    """Settings the pair objectives do not take (yet): ConfigError naming the key."""
    obj = cfg.train.objective
    if cfg.model.task != "causal_lm":
        raise ConfigError("model.task", f"{cfg.model.task}: train.objective={obj} starts from a causal LM "
                          "(a reward model's head is added by the objective)", "set model.task=causal_lm")
    refused = [
        (cfg.data.packing, "data.packing", "set data.packing=false"),
        (spec.ulysses > 1, "parallel.ulysses_size", "set parallel.ulysses_size=1"),
        (cfg.train.max_tokens_per_micro_batch is not None, "train.max_tokens_per_micro_batch",
         "leave it unset (pairs are micro-batched by train.micro_batch_size)"),
        (cfg.checkpoint.keep_best is not None, "checkpoint.keep_best", "leave it unset"),
        (obj == "reward_model" and cfg.train.chunked_loss.enabled, "train.chunked_loss.enabled",
         "set it to false (a reward model has no LM head)"),
    ]
    for bad, key, fix in refused:
        if bad:
            raise ConfigError(key, f"not supported with train.objective={obj} yet", fix)


def engine_task(cfg: Config, tokenizer) -> tuple[str, dict[str, Any]]:
    """(model task, config overrides) the objective trains: a reward model is the model with
    a one-label sequence-classification head (its pad id the config's, else the
    tokenizer's)."""
    if cfg.train.objective != "reward_model":
        return "causal_lm", {}
    pad = load_hf_config(cfg.model).get_text_config().pad_token_id
    return "sequence_classification", {"num_labels": 1, "pad_token_id": pad_token_id(tokenizer) if pad is None
                                       else pad}


def load_checked_pairs(cfg: Config, tokenizer, source: str | None = None, source_key: str = "data.source",
                       progress: bool = True) -> list[dict[str, Any]]:
    """The pairs of `source` (default data.source) that train (`check_pairs`), the note of
    the dropped ones logged."""
    pairs = load_pairs(cfg, source, source_key)
    kept, _, note = check_pairs(tokenizer, pairs, cfg.data.max_length, cfg.data.drop_bad_pairs, progress)
    if note:
        log.warning("%s: %s", source_key, note)
    return kept


def pairs_eval_plan(cfg: Config, tokenizer) -> EvalPlan | None:
    """The evaluation of a pair objective: eval.source's pairs (the first eval.num_prompts),
    val/dpo/loss ... or val/rm/accuracy ...; None without eval.source."""
    e = cfg.eval
    if e.source is None:
        return None
    records = load_checked_pairs(cfg, tokenizer, e.source, "eval.source")
    records = records[:e.num_prompts] if e.num_prompts else records
    return EvalPlan(source=e.source, records=records, greedy=False, n=0, ks=(), reward=None,
                    every_steps=e.every_steps, samples_logged=0, max_new_tokens=None, builtin=False)


def _loss(cfg: Config, chunk_tokens: int | None):
    if cfg.train.objective == "dpo":
        return DPOLoss(cfg.train.dpo, chunk_tokens)
    return RewardModelLoss(cfg.train.reward_model.center_rewards_coefficient)


class _Pairs:
    """Encoded pairs, their batches and the reference's log-probs of them."""

    def _setup(self, cfg: Config, pairs: list[dict[str, Any]], tokenizer, engine) -> None:
        self.cfg, self.engine = cfg, engine
        self.examples = encode_pairs(tokenizer, pairs, cfg.data.max_length)
        self.pad_id = pad_token_id(tokenizer)
        self.loss_fn = _loss(cfg, engine.chunk_tokens)
        self.reference = None
        """fn(batch on the device) -> ``(P, 2)`` reference log-probs (`build_reference`), or None."""

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The collated micro-batch of the pairs `indices`, on the device, with ``ref_logps``
        when there is a reference (collective when the reference is a model)."""
        mb = collate_pairs([self.examples[i] for i in indices], self.pad_id, indices)
        mb = {k: v.to(self.engine.runtime.device) for k, v in mb.items()}
        if self.reference is not None:
            mb["ref_logps"] = self.reference(mb)
        return mb


class PairsData(_Pairs):
    """The training pairs: per step this rank's micro-batches, the global batch's pairs
    (the loss's denominator) and tokens; the step's metrics (`step_metrics`)."""

    def __init__(self, cfg: Config, pairs: list[dict[str, Any]], tokenizer, engine):
        self._setup(cfg, pairs, tokenizer, engine)
        self.sampler = GlobalBatchSampler(len(self.examples), cfg.train.global_batch_size, cfg.run.seed)
        self._it = iter(self.sampler)

    def next_step(self) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        indices = next(self._it)
        tokens = sum(len(self.examples[i][k]["input_ids"]) for i in indices for k in ("chosen", "rejected"))
        mine = rank_share(indices, self.engine.dp_rank, self.engine.dp_size)
        return [self.batch(mb) for mb in micro_batches(mine, self.cfg.train.micro_batch_size)], len(indices), tokens

    def step_metrics(self) -> dict[str, float]:
        """The objective's metrics of the step just trained (collective)."""
        return self.loss_fn.metrics.take(self.engine.runtime.device, self.loss_fn.KEYS)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = iter(self.sampler)


class PairsValidation(_Pairs):
    """The validation pairs: each rank a contiguous share, padded with the first pair to
    the same number of micro-batches on every rank (the pads weigh 0)."""

    def __init__(self, cfg: Config, pairs: list[dict[str, Any]], tokenizer, engine):
        self._setup(cfg, pairs, tokenizer, engine)

    def evaluate(self, progress: bool = False) -> dict[str, float]:
        """``val/<metric>`` of every metric of the objective over all pairs (collective)."""
        del progress
        model = self.engine.model
        n, dp = len(self.examples), self.engine.dp_size
        per = -(-n // dp)
        mine = list(range(min(n, self.engine.dp_rank * per), min(n, (self.engine.dp_rank + 1) * per)))
        weights = [1.0] * len(mine) + [0.0] * (per - len(mine))
        mine += [0] * (per - len(mine))
        size = self.cfg.train.micro_batch_size
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                for start in range(0, per, size):
                    mb = self.batch(mine[start:start + size])
                    mb["pair_weight"] = torch.tensor(weights[start:start + size], device=mb["input_ids"].device)
                    self.loss_fn(model, mb)
        finally:
            model.train(was)
        out = self.loss_fn.metrics.take(self.engine.runtime.device, self.loss_fn.KEYS)
        return {f"val/{k}": v for k, v in out.items()}


# ---------------------------------------------------------------- the DPO reference


def build_reference(cfg: Config, runtime, engine, datasets: list[tuple[_Pairs, str]], run_dir: Path,
                    resumed: bool) -> None:
    """Give each of `datasets` (data, file name of its stored log-probs) the reference of a
    DPO run (module docstring); none for a reference-free loss or a reward model. Called
    before a resumed checkpoint is loaded (the policy is the initial one). Collective."""
    if cfg.train.objective != "dpo" or cfg.train.dpo.loss_type in REFERENCE_FREE:
        return
    chunk = engine.chunk_tokens
    live = None
    if cfg.model.lora.enabled:
        def live(mb):
            return reference_log_probs(engine.model, mb, chunk, context=lambda: lora.adapters_disabled(engine.model))
    elif not cfg.train.dpo.precompute_ref:
        ref_engine = InferEngine(cfg, runtime)  # the frozen copy, sharded like the policy

        def live(mb):
            return reference_log_probs(ref_engine.model, mb, chunk)
    for data, name in datasets:
        if not cfg.train.dpo.precompute_ref:
            data.reference = live
            continue
        table = _precomputed(cfg, runtime, engine, data, run_dir / name, live, resumed)
        data.reference = functools.partial(_stored, table)


def _stored(table: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return table[mb["pair_index"].cpu()].to(mb["input_ids"].device)


def _fingerprint(examples: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e["chosen"]["input_ids"], e["chosen"]["loss_mask"], e["rejected"]["input_ids"],
                             e["rejected"]["loss_mask"]]).encode())
    return h.hexdigest()


def _precomputed(cfg: Config, runtime, engine, data: _Pairs, path: Path, live, resumed: bool) -> torch.Tensor:
    """The reference log-probs of every pair of `data` ``(N, 2)`` fp32: read from `path`
    when it holds those of these very pairs, else computed now (the policy as it is before
    its first step; with LoRA, adapters off) and written there by rank 0."""

    fingerprint = _fingerprint(data.examples)
    box = [None]
    if runtime.is_main and path.is_file():
        with safe_open(str(path), "pt") as f:
            box = [(f.metadata() or {}).get("fingerprint")]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0] == fingerprint:
        return load_file(str(path))["ref_logps"]
    if resumed:
        what = "is missing" if box[0] is None else "holds the reference log-probs of other pairs"
        raise DataError(f"{path} {what}: a resumed run with train.dpo.precompute_ref needs those its first run "
                        "stored (of the data it started with); resume with that data, or start a new run.dir")
    model = engine.model
    fn = live if live is not None else (lambda mb: reference_log_probs(model, mb, engine.chunk_tokens))
    n, dp = len(data.examples), engine.dp_size
    per = -(-n // dp)
    mine = list(range(min(n, engine.dp_rank * per), min(n, (engine.dp_rank + 1) * per)))
    mine += [0] * (per - len(mine))
    size = cfg.train.micro_batch_size
    parts = [fn(data.batch(mine[s:s + size])) for s in range(0, per, size)]
    local = torch.cat(parts).float() if parts else torch.zeros((0, 2), device=runtime.device)
    gathered = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
    table = torch.cat(gathered)[:n].cpu()
    if runtime.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"ref_logps": table.contiguous()}, str(tmp), metadata={"fingerprint": fingerprint})
        tmp.replace(path)
        log.info("reference log-probs of %d pairs stored in %s", n, path)
    return table


# ---------------------------------------------------------------- a reward model in RL


def check_reward_model(path: str, policy_tokenizer, key: str = "rl.reward.model") -> None:
    """`path` is a one-label sequence classifier (what train.objective reward_model exports):
    ConfigError naming `key` otherwise (a folder without a classification head, several
    labels, or a tokenizer of its own, other than the policy's, without an eos token). A
    reward model with a tokenizer of its own reads the rows re-rendered for it
    (`shardwise.rl.workers.reward.RewardModelInputs`)."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"cannot read {path!r}/config.json: {e}") from None
    arch = [a for a in config.get("architectures") or [] if str(a).endswith("ForSequenceClassification")]
    if not arch:
        raise ConfigError(key, f"{path!r} is a {', '.join(config.get('architectures') or ['?'])} without a "
                          "classification head", "give a folder exported by `shardwise train` with "
                          "train.objective=reward_model (a *ForSequenceClassification model)")
    labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
    if labels != 1:
        raise ConfigError(key, f"{path!r} has {labels} labels; a reward model scores with one",
                          "train it with train.objective=reward_model (num_labels 1)")
    if has_tokenizer_files(path):  # its own tokenizer: the rows are re-rendered for it (RewardModelInputs)
        own = load_tokenizer(path, require_eos=False)
        if own.get_vocab() != policy_tokenizer.get_vocab() and own.eos_token_id is None:
            raise ConfigError(key, f"the tokenizer in {path!r} has no eos token; the rows re-rendered for this "
                              "reward model end with it, as its training pairs did", "save the reward model with "
                              "the tokenizer it was trained with")
