"""Padding-free forwards for the RL roles (``rl.packing``) and micro-batches by a token budget.

An RL batch is laid out ``[pad* prompt response pad*]`` per row (left-padded prompts from
batched generation, right-padded responses), every row as wide as the longest prompt plus
the longest response. A forward over that layout computes every padding token too; with
answers of mixed length most of the batch can be padding. Two other layouts hold the same
real tokens:

- ``packed``: the sequences of all rows laid end to end in rows as wide as the longest
  sequence (`pack_rows`, first-fit by decreasing length), position ids restarting at 0 for
  each sequence, ``attention_mask=None``. transformers detects the restarts
  (``masking_utils.find_packed_sequence_indices``) and builds the block-diagonal causal
  mask for sdpa / eager / flex, or runs flash-attention's varlen kernel where installed, so
  no sequence attends to another. What padding remains is the few tokens at the end of a
  packed row (a sequence of their own, positions from 0). Not one row of all tokens: sdpa
  and eager form (row x row) scores, so a single row of N tokens would cost N^2 where rows
  of the longest sequence's width cost about N x longest.
- ``compact``: each row's real tokens moved to the left, right-padded to the longest real
  row of the micro-batch ``(rows, longest)`` with a 2-D mask. Padding remains, but only up to
  the micro-batch's own longest row (what a token budget counts for unpacked rows).

Both keep each sequence's positions (the count of real tokens before each token, the
convention of `shardwise.engine.infer`), so every real token gets the log-prob, entropy
or value the padded layout gives it, up to the order of fp32 sums. `Layout.unpack` scatters
a per-token result back to the batch's ``(B, T)`` layout, 0 on padding.

`micro_batch_rows` makes the row groups of a pass: fixed counts, or a token budget
(`shardwise.data.sampler.token_budget_micro_batches`: rows sorted by length and partitioned
so each micro-batch holds at most that many tokens, the work balanced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from shardwise.data.sampler import token_budget_micro_batches

__all__ = ["LAYOUTS", "Layout", "compact", "micro_batch_rows", "pack_rows", "padding_share"]

LayoutName = Literal["padded", "compact", "packed"]
LAYOUTS: tuple[str, ...] = ("padded", "compact", "packed")


@dataclass
class Layout:
    """A micro-batch's real tokens in another layout, and the way back."""

    input_ids: torch.Tensor
    """``(packed rows, longest)`` packed or ``(rows, longest)`` compact, int64."""
    attention_mask: torch.Tensor | None
    """None when packed (the position ids mark the sequences); ``(rows, longest)`` compact."""
    position_ids: torch.Tensor
    """The same shape as input_ids: each token's position in its own sequence."""
    shape: tuple[int, int]
    """The batch's ``(B, T)``."""
    src: tuple[torch.Tensor, torch.Tensor]
    """(row, column) of each real token in the batch, row-major."""
    dst: tuple[torch.Tensor, torch.Tensor]
    """Where that token sits in this layout."""

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token result in this layout (``input_ids``' shape, any dtype) -> ``(B, T)``
        aligned with the batch, 0 wherever the batch has padding. Differentiable."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.src[0], self.src[1]), values[self.dst[0], self.dst[1]])


def compact(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
            packed: bool = True) -> Layout:
    """`input_ids` ``(B, T)`` (padding where `attention_mask` is 0, on either side) in the
    packed or compact (right-padded, trimmed) layout, see the module docstring.

    position_ids ``(B, T)``: taken from the batch for each real token when given, else the
    count of real tokens before it in its row. Every row needs at least one real token.
    Pad positions of a compact layout get token 0, position 0 and mask 0.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"compact: input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be (batch, seq)")
    real = attention_mask.bool()
    lengths = real.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError("compact: a row without real tokens (attention_mask all 0)")
    rows, cols = real.nonzero(as_tuple=True)  # row-major: each row's tokens in order
    # index of each real token among its row's real tokens
    within = (real.long().cumsum(-1) - 1)[rows, cols]
    pos = within if position_ids is None else position_ids[rows, cols]
    device = input_ids.device
    if packed:
        bins = pack_rows(lengths.tolist())
        width = int(lengths.max())
        seq_row = torch.empty(len(lengths), dtype=torch.long)
        seq_start = torch.empty(len(lengths), dtype=torch.long)
        tails = []
        for b, members in enumerate(bins):
            used = 0
            for i in members:
                seq_row[i], seq_start[i] = b, used
                used += int(lengths[i])
            tails.append((b, used))
        seq_row, seq_start = seq_row.to(device), seq_start.to(device)
        dst = (seq_row[rows], seq_start[rows] + within)
        ids = input_ids.new_zeros((len(bins), width))
        ids[dst] = input_ids[rows, cols]
        positions = torch.zeros_like(ids)
        positions[dst] = pos
        for b, used in tails:  # the padding after a row's sequences: a sequence of its own
            positions[b, used:] = torch.arange(width - used, device=device)
        mask = None
    else:
        width = int(lengths.max())
        dst = (rows, within)
        ids = input_ids.new_zeros((input_ids.shape[0], width))
        ids[dst] = input_ids[rows, cols]
        positions = torch.zeros_like(ids)
        positions[dst] = pos
        mask = (torch.arange(width, device=device) < lengths[:, None]).to(attention_mask.dtype)
    return Layout(ids, mask, positions, tuple(input_ids.shape), (rows, cols), dst)


def pack_rows(lengths: list[int]) -> list[list[int]]:
    """Sequences of `lengths` tokens into rows as wide as the longest, first-fit by
    decreasing length (each row's sequences in their original order): a few rows with
    little padding, so attention over a packed row costs about the longest row's square
    per row (one row of all tokens would cost the square of the total)."""
    if not lengths:
        return []
    width = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                rows[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return [sorted(r) for r in rows]


def micro_batch_rows(lengths: list[int], micro_batch_size: int, budget: int | None, packed: bool,
                     key: str) -> list[list[int]]:
    """Row indices of each micro-batch of a pass over rows of `lengths` real tokens: runs
    of `micro_batch_size` rows in order when `budget` is None, else micro-batches of at
    most `budget` tokens (rows x longest row, or the sum when `packed`), longest first, rows
    in order within each. DataError naming `key` when a row is longer than `budget`."""
    rows = list(range(len(lengths)))
    if budget is None:
        return [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
    return token_budget_micro_batches(rows, lengths, budget, packed=packed, key=key)


def padding_share(lengths: list[list[int]], widths: list[int] | None = None) -> float:
    """Share of computed tokens that are padding over micro-batches of rows of `lengths`:
    padded to ``widths[k]`` columns each (the batch's layout), or, with `widths` None, the
    compact layout (each to its own longest row). 0 for packed micro-batches."""
    computed = real = 0
    for k, ls in enumerate(lengths):
        if not ls:
            continue
        width = max(ls) if widths is None else widths[k]
        computed += width * len(ls)
        real += sum(ls)
    return 1.0 - real / computed if computed else 0.0
