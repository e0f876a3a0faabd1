"""dtype names users may type, resolved by one pure function."""

from __future__ import annotations

import torch

from shardwise.errors import nearest

# Every accepted spelling -> canonical short name.
_ALIASES: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
}

_TORCH: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

DTYPE_NAMES = tuple(_ALIASES)


def canonical_dtype(name: object) -> str:
    """'bfloat16' -> 'bf16'. Raises ValueError (with the nearest name) for anything else."""
    if isinstance(name, torch.dtype):
        for short, dt in _TORCH.items():
            if dt == name:
                return short
        raise ValueError(f"unsupported dtype {name}; use one of fp32, bf16, fp16")
    if not isinstance(name, str):
        raise ValueError(f"a dtype name is a string, got {type(name).__name__} {name!r}")
    key = name.strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    near = nearest(key, DTYPE_NAMES, n=1)
    hint = f"did you mean {near[0]}?" if near else "use fp32, bf16 or fp16"
    raise ValueError(f"unknown dtype {name!r} ({hint})")


def to_torch_dtype(name: str | None) -> torch.dtype | None:
    """Canonical or alias name -> torch.dtype; None stays None."""
    if name is None:
        return None
    return _TORCH[canonical_dtype(name)]


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name."""
    return _TORCH[canonical_dtype(name)].itemsize
