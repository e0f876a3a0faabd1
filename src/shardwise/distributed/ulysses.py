"""Ulysses sequence parallel (``parallel.ulysses_size``): the ``sp`` ranks of a group
share each sample, each holding a contiguous slice of its sequence.

Everything outside attention is per token, so it runs on the local slice as it is. In
attention, an all-to-all trades the sequence split for a head split: each rank gets the
whole sequence for ``heads / sp`` of the heads, runs causal attention, and a second
all-to-all trades back. Both all-to-alls are autograd functions (the backward of one is
the other), so gradients flow to every slice.

Groups are blocks of consecutive ranks (``[0, sp)``, ``[sp, 2 sp)``, ...); the
data-parallel rank of a rank is ``rank // sp``. FSDP still shards over all ranks and
averages gradients over all of them; `TrainEngine` scales each rank's loss sum by the world
size, so the slices' gradients add up to the unsharded gradient.

Limits (checked by `check_model`, errors name the config key): causal decoder models
whose attention goes through transformers' attention interface (Qwen3, Llama, ...);
``num_attention_heads`` divisible by sp (key/value heads that are not are repeated);
rows right-padded or unpadded (causal attention over the whole slice-gathered sequence
then equals the padded model's for every real token), no sliding window.

Packed rows (the RL roles under ``rl.packing``, `packed_forward`): several sequences per
row, positions restarting at each; each rank runs its slice of every row, and the attention
masks by the whole rows' sequence ids (`_SEGMENTS`, set for the forward) as well as
causally. The per-position results are gathered over the group (`gather_seq`: every rank
then computes the same loss from the whole rows, and its backward keeps the gradient of its
own slice), so the group's sp ranks hold the same rows and the RL roles count each once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from shardwise.data.collate import IGNORE_INDEX
from shardwise.errors import ConfigError
from shardwise.models import families
from shardwise.models.chunked_head import per_token_log_probs

ATTN_IMPLEMENTATION = "shardwise_ulysses"
_GROUP_ATTR = "_shardwise_sp_group"
_BEFORE_ATTR = "_shardwise_attn_before_ulysses"

__all__ = ["ATTN_IMPLEMENTATION", "check_model", "enable", "gather_seq", "packed_forward", "seq_all_to_all",
           "slice_batch", "sp_group", "train_only", "whole_sequences"]


def sp_group(sp: int, device_type: str) -> dist.ProcessGroup:
    """This rank's sequence-parallel group (collective: every rank calls it)."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("sp_dp", "sp"))
    return mesh.get_group("sp")


class _SeqAllToAll(torch.autograd.Function):
    """Split `x` into `sp` chunks along `scatter_dim`, send chunk i to rank i of `group`,
    concatenate what arrives along `gather_dim` (rank order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    sp = dist.get_world_size(group)
    inputs = [c.contiguous() for c in torch.tensor_split(x, sp, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(sp)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


def seq_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd-aware all-to-all (see `_SeqAllToAll`); `x.shape[scatter_dim]` must divide by sp."""
    return _SeqAllToAll.apply(x, scatter_dim, gather_dim, group)


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H * times, S, D), each head repeated `times` times in place."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs):
    """transformers attention interface: (B, H, s, D) slices in, (B, s, H, D) out."""
    group = getattr(module, _GROUP_ATTR, None)
    if group is None:
        raise RuntimeError(f"{type(module).__name__} runs Ulysses attention without a sequence-parallel group; "
                           "build the model through shardwise's engines")
    # attention_mask is ignored: it describes the local slice only (transformers builds it
    # from the slice's length); `slice_batch` admits only right-padded rows, for which plain
    # causal attention over the gathered sequence is exact for every real token. Packed rows
    # (`packed_log_probs`) attend within their own sequence: `_SEGMENTS` holds the whole
    # rows' sequence ids.
    del attention_mask
    segments = _SEGMENTS[0]
    if sliding_window is not None:
        raise RuntimeError("Ulysses attention does not support sliding-window attention")
    sp = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp:  # too few key/value heads to split: give each query head its own
        key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
    # sequence split -> head split: (B, H, s, D) -> (B, H/sp, S, D)
    q, k, v = (seq_all_to_all(t, 1, 2, group) for t in (query, key, value))
    k, v = _repeat_heads(k, q.shape[1] // k.shape[1]), _repeat_heads(v, q.shape[1] // v.shape[1])
    if segments is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if module.training else 0.0,
                                             is_causal=True, scale=scaling)
    else:
        n = segments.shape[1]
        if q.shape[2] != n:
            raise RuntimeError(f"Ulysses attention over {q.shape[2]} tokens, but the packed rows hold {n}")
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask = (segments[:, :, None] == segments[:, None, :]) & causal
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scaling,
                                             dropout_p=dropout if module.training else 0.0)
    # head split -> sequence split: (B, H/sp, S, D) -> (B, H, s, D) -> (B, s, H, D)
    out = seq_all_to_all(out, 2, 1, group)
    return out.transpose(1, 2).contiguous(), None


_SEGMENTS: list[torch.Tensor | None] = [None]
"""The sequence id of every token of the packed rows a forward runs on, ``(rows, S)``, the
whole rows (not this rank's slice): set by `packed_log_probs` for its forward."""


class _GatherSeq(torch.autograd.Function):
    """All-gather `x` ``(rows, s, ...)`` along dim 1 over `group` (rank order); backward
    gives each rank its own slice of the gradient. Every rank of the group then computes
    the same loss from the same gathered tensor, so the slice of that gradient is the
    gradient of the loss with respect to this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.s = group, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        r = dist.get_rank(ctx.group)
        return grad[:, r * ctx.s:(r + 1) * ctx.s].contiguous(), None


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`_GatherSeq`: this rank's slice ``(rows, s, ...)`` -> the whole ``(rows, s x sp, ...)``."""
    return _GatherSeq.apply(x, group)


def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Sequence ids of packed rows from their position ids (a new sequence wherever the
    position does not go up by one), as transformers' ``find_packed_sequence_indices``."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def packed_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   group: dist.ProcessGroup, fn):
    """One forward of `model` (its attention routed through Ulysses, `enable`) on packed rows
    ``(rows, S)`` split over the sequence-parallel `group`: each rank runs its slice of every
    row (the rows padded to a multiple of sp with a sequence of their own), attention within
    each packed sequence over the whole rows. ``fn(model, ids, pos, targets)`` runs the
    slice (targets: the token each position predicts, -100 past a row's end) and returns a
    dict of ``(rows, s, ...)`` per-position tensors; they come back gathered over the group
    and cut to ``(rows, S, ...)`` (differentiable, see `gather_seq`). Collective over the group."""
    sp = dist.get_world_size(group)
    rows, seq = input_ids.shape
    pad = -seq % sp
    ids = F.pad(input_ids, (0, pad), value=0)
    pos = torch.cat([position_ids, torch.arange(pad, device=position_ids.device).expand(rows, pad)], dim=1)
    targets = F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    s = (seq + pad) // sp
    cut = slice(dist.get_rank(group) * s, (dist.get_rank(group) + 1) * s)
    _SEGMENTS[0] = _segments(pos)
    try:
        out = fn(model, ids[:, cut], pos[:, cut], targets[:, cut])
    finally:
        _SEGMENTS[0] = None
    return {k: gather_seq(v, group)[:, :seq] for k, v in out.items()}


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def train_only(sp: int, what: str) -> None:
    """ConfigError naming `what` (a command or engine that does not split sequences yet)
    when sp > 1."""
    if sp > 1:
        raise ConfigError("parallel.ulysses_size", f"{what} does not split sequences yet "
                          "(Ulysses is implemented for `shardwise train`)", "set parallel.ulysses_size=1")


def check_model(hf_config, sp: int) -> None:
    """ConfigError unless the model can run Ulysses attention over `sp` ranks."""
    key = "parallel.ulysses_size"
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        raise ConfigError(key, f"{type(hf_config).__name__} has no num_attention_heads", "set it to 1")
    if heads % sp:
        options = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(key, f"{sp} does not divide the model's {heads} attention heads",
                          f"use one of {options}")
    if (state := families.sequence_state(hf_config)) is not None:
        raise ConfigError(key, f"the model keeps a state along the sequence ({state}), which Ulysses would split "
                          "between ranks", "set it to 1")
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise ConfigError(key, "the model uses sliding-window attention, which Ulysses does not support",
                          "set it to 1")


def enable(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Route `model`'s attention through Ulysses over `group`; returns the attention modules
    switched. Call on the sharded model (every rank)."""
    _register()
    n = 0
    for mod in model.modules():
        if hasattr(mod, "num_key_value_groups") and hasattr(mod, "layer_idx"):  # HF decoder attention
            setattr(mod, _GROUP_ATTR, group)
            n += 1
    if n == 0:
        raise ConfigError("parallel.ulysses_size", f"{type(model).__name__} has no attention module Ulysses "
                          "knows (HF decoder attention)", "set it to 1")
    setattr(model, _BEFORE_ATTR, model.config._attn_implementation)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return n


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """`model`'s attention back to what it was before `enable` for the block (generation
    runs whole sequences on every rank, with a KV cache); a no-op for a model without Ulysses."""
    before = getattr(model, _BEFORE_ATTR, None)
    if before is None or model.config._attn_implementation != ATTN_IMPLEMENTATION:
        yield
        return
    model.set_attn_implementation(before)
    try:
        yield
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def slice_batch(batch: dict[str, torch.Tensor], sp_rank: int, sp: int) -> dict[str, torch.Tensor]:
    """This rank's slice of a right-padded causal-LM micro-batch.

    Returns ``input_ids`` and ``position_ids`` ``(b, S/sp)`` and ``shift_labels`` (the label
    each position predicts: ``labels[t + 1]``, -100 past the end), the sequence padded to a
    multiple of sp first. The attention mask is dropped: rows must be right-padded (checked),
    so causal attention gives every real token the padded model's result.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    b, seq = ids.shape
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError("Ulysses sequence parallel needs padded rows (a 2-D attention mask), not packed "
                             "ones (data.packing=false)")
        if (mask[:, 1:] > mask[:, :-1]).any():
            raise ValueError("Ulysses sequence parallel needs right-padded rows: a row has a real token after "
                             "padding")
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=ids.device).expand(b, seq)
    shift = torch.full_like(labels, IGNORE_INDEX)
    shift[:, :-1] = labels[:, 1:]
    pad = -seq % sp
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        shift = F.pad(shift, (0, pad), value=IGNORE_INDEX)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
    s = (seq + pad) // sp
    cut = slice(sp_rank * s, (sp_rank + 1) * s)
    return {"input_ids": ids[:, cut], "position_ids": pos[:, cut], "shift_labels": shift[:, cut]}


def loss_sum(model: nn.Module, sliced: dict[str, torch.Tensor], chunk_tokens: int | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of this rank's slice (fp32 scalar).

    `chunk_tokens` (``train.chunked_loss``): the LM head and the cross-entropy run over
    chunks of that many of the slice's tokens, recomputed in backward
    (`shardwise.models.chunked_head`); the same sum without the slice's full logits.
    """
    if chunk_tokens is not None:
        return -per_token_log_probs(model, sliced["shift_labels"], chunk_tokens, input_ids=sliced["input_ids"],
                                    position_ids=sliced["position_ids"])["log_probs"].sum()
    out = model(input_ids=sliced["input_ids"], position_ids=sliced["position_ids"], use_cache=False)
    logits = out.logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), sliced["shift_labels"].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
