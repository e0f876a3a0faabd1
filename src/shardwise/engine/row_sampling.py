"""The HF engine's per-row hooks into HF ``generate`` (`shardwise.engine.generate.HFGenerator`):
`RowSampler` samples every row from a generator of its own (the per-row seeds of the
generate module's docstring), `RowEnds` reports each row as it writes its EOS (``on_row_end``)
and stops nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import LogitsProcessor, StoppingCriteria

if TYPE_CHECKING:
    from shardwise.engine.generate import RowEnd

__all__ = ["RowEnds", "RowSampler"]


class RowEnds(StoppingCriteria):
    """HF stopping criterion that stops nothing: after each decoding step it calls
    `on_row_end(i, tokens)` for every row i whose new token is its first EOS, `tokens` the
    row's generated ids through it (`prompt_width`: the prompt columns of ``input_ids``).
    HF pads a finished row (with a pad id that may be the EOS), so each row is reported once."""

    def __init__(self, on_row_end: RowEnd, eos_id: int, prompt_width: int, rows: int):
        self.on_row_end = on_row_end
        self.eos_id = int(eos_id)
        self.prompt_width = int(prompt_width)
        self.reported = torch.zeros(rows, dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        ended = (input_ids[:, -1] == self.eos_id).cpu() & ~self.reported
        if input_ids.shape[1] > self.prompt_width and ended.any():
            self.reported |= ended
            for i in ended.nonzero().flatten().tolist():
                self.on_row_end(i, input_ids[i, self.prompt_width:].tolist())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class RowSampler(LogitsProcessor):
    """HF logits processor that samples every row with a generator of its own.

    `seeds` (one per row) seed CPU generators that draw each row's uniforms for all
    `max_new_tokens` steps up front; at step t row i takes the token where its uniform
    falls in the cumulative distribution of ``softmax(logits / temperature)`` (cut to the
    top-p nucleus, renormalised), computed in float64. Every other token's score becomes
    -inf, so HF ``generate`` run greedy (``do_sample=False``) picks exactly that token. A
    row's draws depend on its seed and its own logits alone (step t's uniform is the t-th
    number of the row's stream whatever `max_new_tokens` is: a multi-turn call, whose
    limit depends on the other rows' room, draws the same). `prompt_width`: the prompt
    columns of ``input_ids`` (HF appends one column per step).
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, prompt_width: int,
                 max_new_tokens: int):
        # one spare step: a generate that checks its stop one step late (HF's DeferredStopCheck)
        # runs one forward more and undoes its token
        width = max_new_tokens + 1
        self.uniforms = torch.stack([torch.rand(width, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(int(s)))
                                     for s in seeds]) if len(seeds) else torch.empty((0, width), dtype=torch.float64)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.prompt_width = int(prompt_width)
        self._on: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._on is None or self._on.device != scores.device:
            self._on = self.uniforms.to(scores.device)
        step = input_ids.shape[1] - self.prompt_width
        tokens = self.draw(scores, self._on[:, step])
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tokens[:, None], 0.0)

    def draw(self, scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """``(B,)`` token ids: row i's token for its uniform ``uniforms[i]`` in [0, 1)."""
        probs = torch.softmax(scores.double() / self.temperature, dim=-1)
        order = None
        if self.top_p < 1.0:  # HF's TopPLogitsWarper: keep the smallest set with mass >= top_p
            probs, order = probs.sort(dim=-1, descending=True)
            before = probs.cumsum(-1) - probs
            probs = probs.masked_fill(before >= self.top_p, 0.0)
        cdf = probs.cumsum(-1)
        x = (uniforms * cdf[:, -1])[:, None]
        index = torch.searchsorted(cdf, x, right=True).clamp_(max=probs.shape[-1] - 1)
        return (order.gather(-1, index) if order is not None else index).squeeze(-1)
