"""What a resume may change: one rule per config key (`RESUME_RULES`), and the check that
applies them before anything starts (`check_same_job`, called by
`shardwise.jobs.inputs.check_resume`).

A checkpoint is saved with the config of the run that wrote it (its meta.json). When a job
resumes it, each key whose value differs now is one of:

- ``applies``: the new value is used from the resumed step on (the learning rate,
  ``train.max_steps`` to train longer, the batch sizes, the sharding layout: DCP reshards);
- ``refused``: the checkpoint holds state made under the saved value, and the new one would
  mix the two without a word (an RL run resumed with another ``model.path`` kept the actor
  of the checkpoint and took its reference from the new folder): exit 2 before anything is
  written, naming the key, its saved value and the way out;
- ``cannot change``: the resumed job keeps the saved value whatever the config says; the
  note says so instead of claiming the new value applies.

A section's rule covers its keys unless a longer key has its own (`rule_for`); a test
holds that every key of the config has one. docs/failures.md ("Resuming")
lists the refused and kept keys.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.checkpoint.dcp import read_meta, saved_job
from shardwise.config.schema import Config
from shardwise.distributed.launch import ERROR_DIR_ENV
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.models.loading import load_hf_config

__all__ = ["APPLIES", "KEPT", "REFUSED", "RESUME_RULES", "Rule", "check_same_job", "rule_for"]

APPLIES, REFUSED, KEPT = "applies", "refused", "cannot change"


@dataclass(frozen=True)
class Rule:
    decision: str
    """`APPLIES`, `REFUSED` or `KEPT`."""
    why: str
    """What the checkpoint holds that decides it (the refusal and docs/failures.md say it)."""
    path: bool = False
    """The value is a path: compared as the folder it names (``./m`` is ``m``)."""
    listed: bool = True
    """Named in the resume note when it changed (not for where the run is: a run folder
    copied elsewhere, a checkpoint named explicitly)."""


MODEL_SHAPE = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
"""What makes two model configs hold the same tensors (the rest, e.g. dropout, may change)."""

_SAME_TENSORS = "the checkpoint holds the tensors of the saved setting"
_START = "the run's starting point: its weights are in the checkpoint"

RESUME_RULES: dict[str, Rule] = {
    "run": Rule(APPLIES, "read at each step (run.seed: the data order from the resumed position on)"),
    "run.dir": Rule(APPLIES, "where the run is, not a setting of it (a run folder copied elsewhere resumes)",
                    listed=False),
    "run.name": Rule(KEPT, "a resumed job continues the tracker run it started (its id in run.dir/trackers.json), "
                     "under that run's name"),
    "run.project": Rule(KEPT, "a resumed job continues the tracker run it started (its id in "
                        "run.dir/trackers.json), in that run's project"),
    "model": Rule(APPLIES, "read when the model is built (dtype, attention kernel)"),
    "model.path": Rule(REFUSED, _START + ", and it stays the RL reference and a LoRA run's frozen base, which are "
                       "read from it again on resume", path=True),
    "model.tokenizer": Rule(REFUSED, "the token ids the checkpoint's weights were trained on", path=True),
    "model.config": Rule(APPLIES, "keys that leave the tensors alone (dropout, rope settings) apply"),
    **{f"model.config.{k}": Rule(REFUSED, _SAME_TENSORS) for k in MODEL_SHAPE},
    "model.task": Rule(REFUSED, "the checkpoint holds the head of the saved task"),
    "model.freeze": Rule(REFUSED, "the checkpoint's optimizer state holds the parameters the run trained"),
    "model.lora": Rule(APPLIES, "scaling and dropout of the same adapters"),
    "model.lora.enabled": Rule(REFUSED, _SAME_TENSORS),
    "model.lora.r": Rule(REFUSED, _SAME_TENSORS),
    "model.lora.target_modules": Rule(REFUSED, _SAME_TENSORS),
    "model.lora.exclude_modules": Rule(REFUSED, _SAME_TENSORS),
    "model.lora.modules_to_save": Rule(REFUSED, _SAME_TENSORS),
    "model.lora.path": Rule(REFUSED, "the adapter the run started from: its weights are in the checkpoint, and "
                            "its adapter_config.json sets the adapters' shape", path=True),
    "parallel": Rule(APPLIES, "the checkpoint is resharded to the new layout"),
    "fsdp": Rule(APPLIES, "the checkpoint is resharded to the new layout and precision"),
    "train": Rule(APPLIES, "read at each step; the optimizer's hyperparameters and the schedule are the "
                  "config's after a load"),
    "data": Rule(APPLIES, "read at each step from the resumed position of the data order"),
    "checkpoint": Rule(APPLIES, "read at each save"),
    "checkpoint.keep_best": Rule(APPLIES, "read at each evaluation; another metric starts a new best record "
                                 "(run.dir/checkpoints/best.json)"),
    "checkpoint.resume": Rule(APPLIES, "which checkpoint to resume, not a setting of the run", listed=False),
    "train.objective": Rule(REFUSED, "the checkpoint holds a model trained for the saved objective (a reward "
                            "model's head, a DPO policy's reference)"),
    "train.dpo.precompute_ref": Rule(REFUSED, "the run's reference log-probs were computed one way (stored with the "
                                     "run, or by a frozen copy) and stay so"),
    "rl": Rule(APPLIES, "read at each step"),
    "rl.distill.teacher": Rule(REFUSED, "the teacher takes the reference's place: the run's signal came from it"),
    "rl.algorithm": Rule(REFUSED, "the checkpoint holds a critic's state or none (ppo trains one, grpo not)"),
    "rl.critic.enabled": Rule(REFUSED, "the checkpoint holds a critic's state or none"),
    "rl.kl_in_reward": Rule(APPLIES, "read at each step; a changed coef restarts the KL controller there"),
    "infer": Rule(APPLIES, "read at each generation"),
    "eval": Rule(APPLIES, "read at each evaluation (the resumed step's evaluation uses the new settings)"),
}
"""The rule of every config key on resume (see the module docstring): the longest entry
that is the key or a section above it decides (`rule_for`)."""


def rule_for(key: str) -> Rule:
    """The rule of a dotted config key (``train.optimizer.lr``, ``model.config.dropout``)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        rule = RESUME_RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    raise KeyError(f"no resume rule for {key!r}: add one to RESUME_RULES")


def check_same_job(cfg: Config, job: str, path: Path, key: str) -> None:
    """ConfigError on `key` when the checkpoint at `path` was written by another command
    (``shardwise rl`` resumed an SFT run's state and crashed; ``train`` on an RL run's
    folder mixed both) or for another model (another architecture or size, task, or LoRA
    adapters), and on the changed key when a `REFUSED` one differs from the saved run's;
    otherwise one note on stderr listing the settings that changed since it was saved
    (those that apply, and those kept from the checkpoint). A meta.json that cannot be read
    is left to the ranks' verification."""
    try:
        meta = read_meta(path)
        saved_cfg = meta["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    saved = saved_job(meta)
    if saved is not None and saved != job:
        raise ConfigError(key, f"{str(path)!r} is a checkpoint of `shardwise {saved}`, and this is `shardwise {job}`",
                          "give this job a run.dir of its own (an SFT model starts RL as model.path: <its run.dir>/hf)")
    try:
        before = Config.model_validate(saved_cfg)
    except (ValueError, TypeError):
        return
    mine, theirs = _model_identity(cfg), _model_identity(before)
    diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if diff:
        k = diff[0]
        raise ConfigError(key, f"{str(path)!r} holds another model's state ({k}: saved {theirs.get(k)!r}, "
                          f"now {mine.get(k)!r})", "give this model a run.dir of its own, or resume with the "
                          "saved model settings")
    changed = changed_settings(saved_cfg, cfg.model_dump(by_alias=True, mode="json"))
    for k, (a, b) in changed.items():
        if rule_for(k).decision == REFUSED:
            raise ConfigError(k, f"changed on resume of {str(path)!r} (saved {_brief(a, 200)}, now {_brief(b, 200)}): "
                              f"{rule_for(k).why}", f"resume with {k}={_brief(a, 200, quote=False)}, or give the new "
                              "setting a run.dir of its own (or checkpoint.resume=never to start over)")
    applied = [(k, a, b) for k, (a, b) in changed.items() if rule_for(k).decision == APPLIES]
    kept = [(k, a, b) for k, (a, b) in changed.items() if rule_for(k).decision == KEPT]
    # said once: by the launching process, or by rank 0 of a torchrun the user started
    if (applied or kept) and (os.environ.get("RANK") is None or (os.environ.get("RANK") == "0"
                                                                 and os.environ.get(ERROR_DIR_ENV) is None)):
        parts = []
        if applied:
            parts.append("the new values apply: " + _listed(applied))
        if kept:
            parts.append("kept from the checkpoint (cannot change on resume): " + _listed(kept))
        print(f"shardwise note: resuming {path} with changed settings, {'; '.join(parts)}", file=sys.stderr)


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved, now)}`` of the settings a resume compares: every key whose
    value differs, but those not `listed`, and paths that name the same folder."""
    out = {}
    for k, (a, b) in _changed(saved, now).items():
        rule = rule_for(k)
        if not rule.listed or (rule.path and _same_path(a, b)):
            continue
        out[k] = (a, b)
    return out


def _same_path(a: Any, b: Any) -> bool:
    if not (isinstance(a, str) and isinstance(b, str)):
        return a == b
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError):
        return a == b


def _listed(changed: list[tuple[str, Any, Any]], most: int = 8) -> str:
    shown = "; ".join(f"{k} {_brief(a)} -> {_brief(b)}" for k, a, b in changed[:most])
    return shown + (f" (and {len(changed) - most} more)" if len(changed) > most else "")


def _model_identity(cfg: Config) -> dict[str, Any]:
    """The settings that decide which tensors a checkpoint holds."""
    out: dict[str, Any] = {"model.task": cfg.model.task, "model.lora.enabled": cfg.model.lora.enabled}
    if cfg.model.lora.enabled:
        out |= {"model.lora.r": cfg.model.lora.r, "model.lora.target_modules": list(cfg.model.lora.target_modules)}
    try:
        hf = load_hf_config(cfg.model).get_text_config()
    except (ShardwiseError, OSError, ValueError):  # a folder since moved: nothing to compare
        return out
    return out | {f"model.config.{k}": getattr(hf, k, None) for k in MODEL_SHAPE}


def _changed(saved: Any, now: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved, now)}`` of the leaves that differ (iteratively, no recursion
    limit concerns for configs: they are shallow)."""
    out: dict[str, tuple[Any, Any]] = {}
    stack = [(prefix, saved, now)]
    while stack:
        where, a, b = stack.pop()
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(a.keys() | b.keys(), reverse=True):
                stack.append((f"{where}.{k}" if where else str(k), a.get(k), b.get(k)))
        elif a != b:
            out[where] = (a, b)
    return dict(sorted(out.items()))


def _brief(value: Any, limit: int = 60, quote: bool = True) -> str:
    """`value` shown short: its repr, or as an override's value (`quote` off: null, text bare)."""
    text = repr(value) if quote else "null" if value is None else value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
