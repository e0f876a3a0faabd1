"""Document boundaries for the sequence-state layers of hybrid models in packed rows.

Why: in a packed row (several documents end to end, position ids restarting at 0 at each,
no 2-D padding mask) transformers keeps the documents apart in attention layers, but the
layers that carry a state along the sequence (Gated DeltaNet linear attention, Mamba2
SSMs, short convolutions) take the row as one sequence: every document after the first
starts from the state the previous one left. Their CUDA kernels accept boundaries
(``cu_seqlens``, ``seq_idx``); their torch code in transformers 5.19 does not (the argument
is swallowed by ``**kwargs``), and no boundaries reach them from a forward called with
``position_ids`` alone.

How: a forward pre-hook on the model reads each call's ``position_ids`` and
``attention_mask`` and, exactly where transformers treats a row as packed (no 2-D mask,
position ids restarting: ``masking_utils.find_packed_sequence_indices``'s rule, a new
document wherever the position does not grow by 1), works out the documents
(`Documents.of`). Each sequence-state layer then runs its documents as rows of a batch
of their own, right-padded (`Documents.run`): these layers are causal, so padding after a
document's last token changes none of its outputs, and each document starts from a zero
state as it would alone. The outputs go back to their places in the packed row. Attention
and MLP layers still see the packed row.

Cost: documents are grouped by length (powers of two), one call of the layer per group,
so the padding is under the documents' own tokens (at most twice the row's tokens) and
the calls at most log2(longest document) + 1 per layer. Rows that are not packed, calls
with a cache (generation) and single-document rows run the layer unchanged.

The documents are worked out again at every model forward, so a layer recomputed in the
backward (activation checkpointing) reads those of its own forward as long as backward
follows its forward before the next forward, as in every shardwise pass.

Supported: the layer classes of `shardwise.models.families.BOUNDED`. Checked on
transformers 5.19.0 (the layers' call signatures: hidden states first or as
``hidden_states=``, the cache as ``cache_params`` or ``past_key_values``, a tensor out).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.models.families import bounded_mixers

__all__ = ["Documents", "keep_documents_apart"]

_CACHE_KWARGS = ("cache_params", "past_key_values")
_BOUNDARY_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")
"""Per-token arguments that describe the packed row, not the per-document batch."""


@dataclass
class Documents:
    """The documents of a packed ``(B, T)`` batch and how to run a layer on them apart."""

    shape: tuple[int, int]
    """The packed batch's ``(B, T)``."""
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]]
    """Per length group: (flat token indices, their document row in the group, their offset
    in the document, documents in the group, longest document of the group)."""
    order: torch.Tensor
    """Permutation that puts the groups' concatenated tokens back in flat ``B*T`` order."""

    @staticmethod
    def of(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> Documents | None:
        """The documents of a batch, or None when no row is packed: no position ids, a 2-D
        attention mask (rows are padded sequences, as transformers takes them), or every row
        one sequence. position_ids ``(B, T)`` (or ``(k, B, T)`` multimodal rotary positions,
        of which the first is the text's)."""
        if position_ids is None or (attention_mask is not None and attention_mask.dim() == 2):
            return None
        pos = position_ids[0] if position_ids.dim() == 3 else position_ids
        if pos.dim() != 2 or pos.shape[1] < 2:
            return None
        start = torch.ones_like(pos, dtype=torch.bool)
        start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        if not bool(start[:, 1:].any()):
            return None
        flat = start.flatten()
        doc = flat.long().cumsum(0) - 1  # document of each token, in flat order
        first = flat.nonzero().squeeze(1)  # flat index of each document's first token
        length = torch.diff(first, append=first.new_tensor([flat.numel()]))
        offset = torch.arange(flat.numel(), device=pos.device) - first[doc]
        bucket = torch.ceil(torch.log2(length.double())).long()  # length 1 -> 0, 2 -> 1, 3..4 -> 2, ...
        groups, toks = [], []
        for b in bucket.unique().tolist():
            members = (bucket == b).nonzero().squeeze(1)
            row_of = torch.full_like(length, -1)
            row_of[members] = torch.arange(len(members), device=pos.device)
            tok = (row_of[doc] >= 0).nonzero().squeeze(1)
            groups.append((tok, row_of[doc[tok]], offset[tok], len(members), int(length[members].max())))
            toks.append(tok)
        order = torch.argsort(torch.cat(toks))
        return Documents((pos.shape[0], pos.shape[1]), groups, order)

    def run(self, forward, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """``forward(hidden_states, *args, **kwargs)`` (a causal sequence layer, ``(B, T, H)``
        -> ``(B, T, H')``) run on each document alone: the documents as right-padded rows,
        by length group; the result in the packed layout. Differentiable."""
        b, t = self.shape
        assert hidden_states.shape[:2] == (b, t), (
            f"documents of {self.shape} met hidden states {tuple(hidden_states.shape)}")
        flat = hidden_states.reshape(b * t, *hidden_states.shape[2:])
        dev = flat.device
        outs = []
        for tok, row, offset, docs, width in self.groups:
            tok, row, offset = tok.to(dev), row.to(dev), offset.to(dev)
            rows = flat.new_zeros((docs, width, *flat.shape[1:]))
            rows = rows.index_put((row, offset), flat[tok])
            out = forward(rows, *args, **kwargs)
            assert isinstance(out, torch.Tensor), f"a sequence layer returned {type(out).__name__}, not a tensor"
            outs.append(out[row, offset])
        return torch.cat(outs)[self.order.to(dev)].reshape(b, t, *outs[0].shape[1:])


class _Current:
    """The documents of the model's forward in progress (None: nothing is packed)."""

    documents: Documents | None = None


def _read_batch(current: _Current, module: nn.Module, args: tuple, kwargs: dict) -> None:
    current.documents = Documents.of(kwargs.get("position_ids"), kwargs.get("attention_mask"))


def _apart(original, current: _Current, *args, **kwargs):
    docs = current.documents
    if docs is None or any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
        return original(*args, **kwargs)  # a cache: generation, which transformers does not pack either
    if args:
        hidden, args = args[0], args[1:]
    else:
        hidden = kwargs.pop("hidden_states")
    for k in _BOUNDARY_KWARGS:
        kwargs.pop(k, None)
    kwargs["attention_mask"] = None  # the rows are right-padded; causal layers need no mask for that
    return docs.run(original, hidden, *args, **kwargs)


def keep_documents_apart(model: nn.Module) -> int:
    """Give `model`'s sequence-state layers (classes of `shardwise.models.families.BOUNDED`)
    the document boundaries of packed rows; returns how many layers were patched (0 leaves
    the model as it was). Idempotent."""
    classes = bounded_mixers()
    mixers = [m for m in model.modules() if type(m).__name__ in classes and not hasattr(m, "_shardwise_docs")]
    if not mixers:
        return 0
    current = getattr(model, "_shardwise_docs", None)
    if current is None:
        current = _Current()
        model._shardwise_docs = current
        model.register_forward_pre_hook(functools.partial(_read_batch, current), with_kwargs=True)
    for m in mixers:
        m._shardwise_docs = current
        m.forward = functools.partial(_apart, m.forward, current)
    return len(mixers)
