"""Checks of the files a config names, run by every job's `prepare` in the launching
process: before any process group, Ray worker or file of the run exists.

Each check raises one `ShardwiseError` (exit status 2, one line) naming the key and what
to change. What they cover: the model folder (config.json and readable safetensors, no
pickles), the tokenizer folder, the data source (readable, parseable, not empty, with the
keys), and an explicit ``checkpoint.resume`` folder (a complete checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.checkpoint.dcp import CheckpointManager, incomplete_reason, is_complete
from shardwise.config.schema import Config
from shardwise.data.sources import load_records
from shardwise.data.tokenizer import has_tokenizer_files
from shardwise.errors import ConfigError
from shardwise.models.loading import check_weights_folder


def check_model(cfg: Config) -> None:
    """``model.path`` (when set) holds config.json and readable safetensors weights."""
    if cfg.model.path is not None:
        check_weights_folder(cfg.model.path, "model.path")


def check_tokenizer(cfg: Config) -> None:
    """An explicit ``model.tokenizer`` folder holds tokenizer files."""
    if cfg.model.tokenizer is not None and not has_tokenizer_files(cfg.model.tokenizer):
        raise ConfigError("model.tokenizer", f"{cfg.model.tokenizer!r} holds no tokenizer files",
                          "point it at a folder with tokenizer.json (or vocab files), or leave it unset")


def check_resume(cfg: Config) -> None:
    """An explicit ``checkpoint.resume`` folder is a complete checkpoint (auto and never
    need nothing; the checksums are verified by the ranks when they load)."""
    resume = cfg.checkpoint.resume
    if resume in ("auto", "never"):
        return
    path = Path(resume).expanduser()
    if is_complete(path):
        return
    hint = "use auto, never, or a folder like <run.dir>/checkpoints/step_00000100"
    inner = CheckpointManager(path, cfg.checkpoint, None).latest() if path.is_dir() else None
    if inner is not None:
        hint = f"did you mean {inner}?"
    raise ConfigError("checkpoint.resume", f"{resume!r} {incomplete_reason(path)}", hint)


def check_data(cfg: Config, response_key: str | None, seed: int | None = None,
               num_builtin: int | None = None, heldout: bool = False) -> list[dict[str, Any]]:
    """The records of ``data.source`` (every read, parse and key problem raised here).
    A built-in task makes `num_builtin` examples (default: ``data.num_examples``) from `seed`
    (default ``run.seed``); `heldout`: its held-out examples (true answers)."""
    d = cfg.data
    return load_records(d.source, d.prompt_key, response_key, seed=cfg.run.seed if seed is None else seed,
                        num_builtin=d.num_examples if num_builtin is None else num_builtin, heldout=heldout)
