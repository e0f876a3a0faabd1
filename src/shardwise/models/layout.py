"""The names a model's tensors have in an HF checkpoint (what `save_pretrained` writes and
`from_pretrained` reads), for the live export, the offline export and the weight sync.

- Tied weights (one tensor under several names) are written once, under the name
  transformers keeps (`tied_aliases`).
- Fused MoE experts (transformers 5 keeps a layer's experts as 3-D tensors) are cut into
  the per-expert tensors of the original checkpoints (`checkpoint_entries`, from
  `shardwise.models.patches.moe.checkpoint_layout`).

Everything here reads names and shapes only, so it works on a meta-device model.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.models.patches.moe import checkpoint_layout

log = logging.getLogger(__name__)

__all__ = ["TensorEntry", "checkpoint_entries", "tied_aliases"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its HF name, where it comes from, and what is written."""

    name: str
    """Name in the safetensors file (the HF state-dict key)."""
    source: str
    """Key in the source: the live state dict's key, or the DCP key."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """dtype written (the export dtype for floating tensors, else the source's)."""
    part: tuple[int, int, int] | None = None
    """``(i, a, b)``: the tensor is ``source[i, a:b]`` (one expert cut from fused experts)."""

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This entry's tensor out of its source's full tensor."""
        if self.part is None:
            return full
        i, a, b = self.part
        return full[i, a:b]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def checkpoint_entries(model: nn.Module, names: Iterable[tuple[str, str, tuple[int, ...], torch.dtype]]
                       ) -> list[TensorEntry]:
    """Entries for ``(name, source, shape, dtype)`` rows, fused expert parameters cut into
    their per-expert tensors (see the module docstring); an entry's cuts follow it."""
    layout = checkpoint_layout(model)
    out = []
    for name, source, shape, dtype in names:
        if name in layout:
            out += [TensorEntry(n, source, cut_shape, dtype, part) for n, part, cut_shape in layout[name]]
        else:
            out.append(TensorEntry(name, source, shape, dtype))
    return out


def _tied_key_patterns(model: nn.Module) -> list[str]:
    """transformers' `_tied_weights_keys` of every submodule, prefixed with its path (a dict
    target -> source in transformers 5, a list of names in 4.x)."""
    pats: list[str] = []
    for path, mod in model.named_modules():
        keys = getattr(mod, "_tied_weights_keys", None) or ()
        keys = keys.keys() if isinstance(keys, Mapping) else keys
        pats.extend(f"{path}.{k}" if path else k for k in keys)
    return pats


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{dropped name: kept name} for parameters and buffers registered under several names.

    The kept name follows `save_pretrained` (transformers' remove_tied_weights_from_state_dict):
    in sorted order, names matching a `_tied_weights_keys` pattern are dropped while another
    name remains. Works on a meta-device model (nothing is read).
    """
    groups: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(t), []).append(name)
    for name, t in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(t), []).append(name)
    patterns = _tied_key_patterns(model)
    aliases: dict[str, str] = {}
    for names in groups.values():
        names = sorted(set(names))
        if len(names) < 2:
            continue
        drop = [n for n in names if any(re.search(p, n) for p in patterns)]
        keep = [n for n in names if n not in drop]
        if not keep:  # every name is a declared tied key: keep the last, as transformers does
            keep = [drop.pop()]
        if len(keep) > 1:
            log.warning("%s share one tensor but the model declares no tie between them; "
                        "writing it once as %s", names, keep[0])
            drop += keep[1:]
        for n in drop:
            aliases[n] = keep[0]
    return aliases
