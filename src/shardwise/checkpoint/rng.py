"""The generator states of one rank in a checkpoint folder: ``rng_rank<r>.safetensors``
(torch CPU and CUDA generator states, uint8) and ``rng_rank<r>.json`` (python `random` and
numpy). No pickle: safetensors and JSON only."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from shardwise.checkpoint.disk import short_error
from shardwise.errors import CheckpointError

__all__ = ["apply_rng", "read_rng", "write_rng"]


def write_rng(folder: Path, rank: int, device: torch.device) -> None:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)
    save_file(tensors, str(folder / f"rng_rank{rank}.safetensors"))
    version, py_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": list(py_state), "gauss_next": gauss},
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
    }
    (folder / f"rng_rank{rank}.json").write_text(json.dumps(state))


def read_rng(folder: Path, rank: int, saved_world: int | None) -> tuple[dict, dict] | None:
    """This rank's generator states (tensors, json) from a checkpoint; None when it was
    saved by fewer ranks (`saved_world` <= rank). CheckpointError naming the file when one
    that the checkpoint must hold is missing or unreadable."""
    tensors_path, json_path = folder / f"rng_rank{rank}.safetensors", folder / f"rng_rank{rank}.json"
    if saved_world is None:  # meta.json without world_size: take what is there
        if not (tensors_path.is_file() and json_path.is_file()):
            return None
    elif rank >= saved_world:
        return None
    for f in (tensors_path, json_path):
        if not f.is_file():
            raise CheckpointError(f"checkpoint {folder}: missing file {f.name} (the RNG state of rank "
                                  f"{rank}; the checkpoint was saved by {saved_world} ranks)")
    try:
        tensors = load_file(str(tensors_path))
        if "torch_cpu" not in tensors:
            raise KeyError("no 'torch_cpu' tensor")
    except Exception as exc:
        raise CheckpointError(f"checkpoint {folder}: {tensors_path.name} cannot be read ({short_error(exc)})") from None
    try:
        state = json.loads(json_path.read_text())
        if not isinstance(state, dict) or not {"python", "numpy"} <= state.keys():
            raise KeyError("no 'python' and 'numpy' states")
    except Exception as exc:
        raise CheckpointError(f"checkpoint {folder}: {json_path.name} cannot be read ({short_error(exc)})") from None
    return tensors, state


def apply_rng(tensors: dict[str, torch.Tensor], state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], device)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
