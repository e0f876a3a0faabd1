"""Per-token log-probs of a causal LM without its full logits: the output head runs over
chunks of the tokens (``train.chunked_loss``).

`per_token_log_probs` calls the whole model, as every other path does, with the output
embedding module's forward replaced for the duration of the call. FSDP2 gathers a unit's
parameters in the unit's forward hooks, which still run around the replaced forward, so
the head's weight is the gathered one, in the unit's compute dtype, whether the head sits
in the root unit, in a unit of its own (``fsdp.wrap.lm_head``) or is tied to the input
embeddings. The replaced forward receives the final hidden states ``(batch, seq, hidden)``
and returns, for each token, the log-prob of its target (and the entropy of its
predictive distribution), computed ``chunk_tokens`` tokens at a time: each chunk's
``linear -> fp32 -> logsumexp / gather (/ softmax)`` runs under non-reentrant activation
checkpointing, so one chunk's logits exist at a time in forward, and again in backward,
where the chunk is recomputed. Peak extra memory: about ``chunk_tokens x vocab`` fp32
values, a few times over (the logits, their gradient, the softmax for the entropy),
instead of ``batch x seq x vocab``.

A causal LM qualifies when its forward returns the head's output as ``.logits`` untouched
(Qwen2/3, Qwen3-MoE, Llama, Mistral, ...). Models that post-process the head's output
(Gemma 2/3 final-logit softcapping, Cohere's logit_scale, Granite's logits_scaling,
Falcon-H1's lm_head_multiplier, ...) are refused with a ConfigError: by `check_model` from
their config, and by `per_token_log_probs` itself when the forward changed what the head
returned, so no wrong number comes back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.data.collate import IGNORE_INDEX
from shardwise.errors import ConfigError

__all__ = ["check_model", "per_token_log_probs"]

KEY = "train.chunked_loss.enabled"
_HINT = "set train.chunked_loss.enabled=false"

_LOGIT_POST_PROCESSING = {
    "final_logit_softcapping": None,  # Gemma 2 / 3 / 3n / 4: tanh softcapping unless None
    "logit_scale": 1.0,  # Cohere: logits * logit_scale
    "logits_scaling": 1.0,  # Granite: logits / logits_scaling
    "lm_head_multiplier": 1.0,  # Falcon-H1: lm_head(h) * multiplier
}
"""Config attributes with which transformers' CausalLM forward transforms the head's
output, and the value (besides None) for which it does not."""


def check_model(model: nn.Module) -> None:
    """ConfigError unless `model` (an HF causal LM, sharded or not) can run the chunked
    head: its output embeddings are an `nn.Linear` and its config names no known logit
    post-processing. `per_token_log_probs` checks the rest at its call."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ConfigError(KEY, f"{type(model).__name__}'s output head is {type(head).__name__}, not a linear "
                          "layer the chunked loss can split", _HINT)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr, harmless in _LOGIT_POST_PROCESSING.items():
        value = getattr(text, attr, None)
        if value is not None and value != harmless:
            raise ConfigError(KEY, f"{type(model).__name__} post-processes its logits ({attr}={value}), which "
                              "the chunked loss does not reproduce", _HINT)


@dataclass
class _Installed:
    out: torch.Tensor | None = None
    """What the replaced forward returned: ``(batch * seq, k)`` fp32."""
    version: int = -1
    """Its version counter then (an in-place change afterwards is a post-processing)."""


def per_token_log_probs(model: nn.Module, targets: torch.Tensor, chunk_tokens: int, *,
                        temperature: float = 1.0, with_entropy: bool = False,
                        **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward of `model` (``model(**inputs, use_cache=False)``) returning, instead of
    logits, each token's target log-prob (and entropy) from chunks of `chunk_tokens` tokens.

    targets ``(batch, seq)`` int64: the token each position predicts (already shifted:
    position t is scored against ``targets[:, t]``), ``-100`` for none. `temperature`
    divides the logits, in the head's compute dtype and before the fp32 upcast, as the
    plain paths do (``out.logits / temperature``, then ``.float()``).

    Returns ``log_probs`` ``(batch, seq)`` fp32, ``log softmax(logits[:, t] /
    temperature)[targets[:, t]]``, exactly 0 where the target is -100; with
    `with_entropy`, ``entropy`` ``(batch, seq)`` fp32 in nats of ``softmax(logits[:, t] /
    temperature)`` at every position. Differentiable (the chunks are recomputed in
    backward); under ``torch.no_grad()`` nothing is kept.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    ids = inputs.get("input_ids")
    if ids is not None and targets.shape != ids.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must have the shape of input_ids {tuple(ids.shape)}")
    head = model.get_output_embeddings()
    with _chunked_head(head, targets, chunk_tokens, temperature, with_entropy) as installed:
        out = model(**inputs, use_cache=False)
    res = _checked_result(model, out.logits, installed)
    res = res.reshape(*targets.shape, res.shape[-1])
    result = {"log_probs": res[..., 0]}
    if with_entropy:
        result["entropy"] = res[..., 1]
    return result


@contextlib.contextmanager
def _chunked_head(head: nn.Module, targets: torch.Tensor, chunk_tokens: int, temperature: float,
                  with_entropy: bool) -> Iterator[_Installed]:
    """`head`'s forward replaced by the chunked per-token computation, restored on exit.

    Only the instance's ``forward`` attribute changes: the module's ``__call__`` and its
    hooks (FSDP's gather, reshard, casts) run as always. A forward set on the instance
    before (a compiled one, `shardwise.fsdp.apply.apply_compile`) comes back on exit."""
    if not isinstance(head, nn.Linear):
        raise ConfigError(KEY, f"the output head is {type(head).__name__}, not a linear layer the chunked "
                          "loss can split", _HINT)
    installed = _Installed()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"the head got hidden states {tuple(hidden.shape)} for targets "
                             f"{tuple(targets.shape)}: the model slices its tokens before the head")
        # head.weight / head.bias read here, inside the call: under FSDP2 they are the
        # gathered parameters now (and again when the chunks are recomputed in backward).
        out = _chunked(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias, targets.reshape(-1),
                       chunk_tokens, temperature, with_entropy)
        installed.out, installed.version = out, out._version
        return out

    missing = object()
    before = head.__dict__.get("forward", missing)
    head.forward = forward
    try:
        yield installed
    finally:
        if before is missing:
            del head.forward
        else:
            head.forward = before


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
             chunk_tokens: int, temperature: float, with_entropy: bool) -> torch.Tensor:
    """hidden ``(n, hidden)``, targets ``(n,)`` -> ``(n, 1 or 2)`` fp32, chunk by chunk.

    The result is a fresh tensor (a `torch.cat`), not a view: FSDP2 warns about views
    returned by a unit, since an in-place op on one would drop its backward hook."""
    n = hidden.shape[0]
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    pieces = []
    for start in range(0, max(n, 1), chunk_tokens):
        args = (hidden[start:start + chunk_tokens], weight, bias, targets[start:start + chunk_tokens],
                temperature, with_entropy)
        if keep:
            pieces.append(checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(_chunk(*args))
    return torch.cat(pieces)


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           temperature: float, with_entropy: bool) -> torch.Tensor:
    """One chunk: ``(m, hidden)`` -> ``(m, 1 or 2)`` fp32 [log-prob of the target, entropy].

    The per-row arithmetic of `shardwise.engine.infer.log_probs_from_logits`
    (logsumexp, gather; ``entr(softmax)`` summed) on the chunk's fp32 logits."""
    logits = F.linear(hidden, weight, bias)
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.float()
    valid = targets != IGNORE_INDEX
    target = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_probs = torch.where(valid, target - torch.logsumexp(logits, dim=-1), 0.0)
    if not with_entropy:
        return log_probs.unsqueeze(-1)
    # entr(p) = -p ln p, and 0 at p = 0 (a -inf logit gives no NaN).
    entropy = torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1)
    return torch.stack([log_probs, entropy], dim=-1)


def _checked_result(model: nn.Module, logits, installed: _Installed) -> torch.Tensor:
    """The per-token results, after checking the forward returned what the head computed.

    The one change allowed is a dtype cast by FSDP2 (a unit's or the root's
    ``output_dtype``, e.g. a fp32 head in a bf16 model hands bf16 on): then the values
    are the head's fp32 ones and the gradient takes the cast's path back, so every
    backward hook FSDP put on the way still fires. Anything else raises ConfigError."""
    out = installed.out
    if out is None:
        raise ConfigError(KEY, f"{type(model).__name__}'s forward did not call its output head", _HINT)
    if logits is out and out._version == installed.version:
        return out
    cast = (isinstance(logits, torch.Tensor) and logits.shape == out.shape and logits.dtype != out.dtype
            and torch.allclose(logits, out.detach().to(logits.dtype), rtol=0, atol=0, equal_nan=True))
    if not cast:
        raise ConfigError(KEY, f"{type(model).__name__} post-processes its output head's result (e.g. logit "
                          "softcapping or scaling), which the chunked loss does not reproduce", _HINT)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return out.detach()
    upcast = logits.float()
    return out.detach() + (upcast - upcast.detach())
