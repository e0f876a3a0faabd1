"""On-policy distillation (``rl.distill``): the teacher is the run's reference with other
weights, so its log-probs of the student's sampled tokens arrive as ``ref_log_probs``
(built, sharded and offloaded as the reference is: `teacher_config` is the config its
`shardwise.rl.workers.actor.ReferenceWorker` is built from).

The signal is the per-token reverse KL on the sampled tokens,
``rkl_t = log p_student(y_t) - log p_teacher(y_t)`` (the student's log-probs: the old
log-probs, or the rollout's under rl.actor.on_policy_shortcut), on the response mask only
(a multi-turn row's tool output is not the student's and is not distilled):

- mode reward: ``-coef x rkl_t`` is added to each token's reward (`reward_term`); with a
  rule-based reward the two add, without one the teacher is the whole reward;
- mode loss: the actor's KL loss to the reference, which is the teacher here, with
  ``coef`` (`loss_config`).

Metrics: ``distill/reverse_kl`` (token mean of rkl), ``distill/teacher_logp`` (token mean
of the teacher's log-probs), ``time/teacher`` (the reference pass).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardwise.config.schema import Config
from shardwise.data.tokenizer import has_tokenizer_files, load_tokenizer
from shardwise.errors import ConfigError
from shardwise.models.loading import check_weights_folder, load_hf_config

__all__ = ["check_teacher", "loss_config", "metrics", "reward_term", "student_log_probs", "teacher_config"]


def teacher_config(cfg: Config) -> Config:
    """The config the teacher's ReferenceWorker is built from: the run's with model.path
    the teacher (its own config.json; no model.config, LoRA or freezing of the student)."""
    model = cfg.model.model_copy(update={"path": cfg.rl.distill.teacher, "config": None, "freeze": [],
                                         "lora": cfg.model.lora.model_copy(update={"enabled": False})})
    return cfg.model_copy(update={"model": model})


def loss_config(cfg: Config) -> Config:
    """mode loss: `cfg` with the actor's KL loss on, at rl.distill.coef (the reference
    being the teacher, the loss is the KL to it); otherwise `cfg` as it is."""
    d = cfg.rl.distill
    if d.teacher is None or d.mode != "loss":
        return cfg
    actor = cfg.rl.actor.model_copy(update={"kl_loss": cfg.rl.actor.kl_loss.model_copy(
        update={"enabled": True, "coef": d.coef, "type": "k2"})})
    return cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"actor": actor})})


def check_teacher(cfg: Config, student_vocab: int, student_tokenizer) -> None:
    """The teacher folder is a causal LM with the student's vocabulary (and tokenizer, when
    it has one): ConfigError naming rl.distill.teacher otherwise, before launch."""
    d = cfg.rl.distill
    key = "rl.distill.teacher"
    check_weights_folder(d.teacher, key)
    if cfg.rl.async_.enabled:
        raise ConfigError(key, "on-policy distillation does not run with rl.async yet", "set rl.async.enabled=false")
    arch = json.loads((Path(d.teacher).expanduser() / "config.json").read_text()).get("architectures") or []
    if arch and not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in arch):
        raise ConfigError(key, f"{d.teacher!r} is a {', '.join(arch)}, not a causal LM",
                          "give a causal LM's folder (the teacher scores the student's tokens)")
    vocab = load_hf_config(teacher_config(cfg).model).get_text_config().vocab_size
    if vocab != student_vocab:
        raise ConfigError(key, f"{d.teacher!r} has a vocabulary of {vocab} tokens, the student {student_vocab}; "
                          "distillation here scores the student's own token ids",
                          "use a teacher of the student's family (same tokenizer)")
    if has_tokenizer_files(d.teacher) and load_tokenizer(d.teacher).get_vocab() != student_tokenizer.get_vocab():
        raise ConfigError(key, f"{d.teacher!r} has another tokenizer than the student's; cross-tokenizer "
                          "distillation is not supported", "use a teacher of the student's family")


def student_log_probs(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The student's log-probs of its sampled tokens ``(B, T)``: the old log-probs, else
    (rl.actor.on_policy_shortcut) the rollout's."""
    return tensors["old_log_probs"] if "old_log_probs" in tensors else tensors["rollout_log_probs"]


def reward_term(tensors: dict[str, torch.Tensor], coef: float) -> torch.Tensor:
    """``-coef x (log p_student - log p_teacher)`` per token ``(B, T)`` fp32, 0 off the
    response mask."""
    mask = tensors["response_mask"].float()
    rkl = student_log_probs(tensors).float() - tensors["ref_log_probs"].float()
    return -coef * rkl * mask


def metrics(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """``distill/reverse_kl`` and ``distill/teacher_logp``: token means over the response mask."""
    mask = tensors["response_mask"].float()
    n = max(float(mask.sum()), 1.0)
    rkl = (student_log_probs(tensors).float() - tensors["ref_log_probs"].float()) * mask
    return {"distill/reverse_kl": float(rkl.sum()) / n,
            "distill/teacher_logp": float((tensors["ref_log_probs"].float() * mask).sum()) / n}

