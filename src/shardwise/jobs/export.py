"""The export recipe behind `shardwise export`: a DCP checkpoint folder -> an HF folder, in
one process and without a process group (`shardwise.checkpoint.hf_export.export_checkpoint`);
a LoRA run's checkpoint -> a PEFT adapter folder, or the merged model with ``--merged``.

`prepare` checks the checkpoint folder (complete, and its files match the sizes and
checksums its commit marker records) and the out folder (new or empty; a folder holding
anything, another model say, only with ``--force``; never a file) before anything is
written. An out folder with a ``..`` part is resolved first (`shardwise.config.paths`):
``runs/new/../other_model`` is checked, and written, as ``runs/other_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardwise.checkpoint.dcp import (
    COMMITTED,
    incomplete_reason,
    is_complete,
    read_meta,
    verify_checkpoint,
)
from shardwise.checkpoint.hf_export import ExportReport, export_checkpoint
from shardwise.config.load import config_from_dict
from shardwise.config.paths import resolve_dots
from shardwise.config.schema import Config
from shardwise.errors import ConfigError
from shardwise.models.hub import resolve_inputs

__all__ = ["Prepared", "prepare", "run"]


@dataclass
class Prepared:
    checkpoint_dir: Path
    out_dir: Path
    merged: bool = False
    """A LoRA checkpoint: the merged model instead of the adapter folder."""
    config: Config | None = None
    """The run's config with its inputs resolved here (`shardwise.models.hub`: a Hub
    snapshot it names, from another machine's cache, found in this one's); None: meta.json's
    as it is (the export reports what it cannot read)."""


def prepare(checkpoint_dir: str, out_dir: str, merged: bool = False, force: bool = False) -> Prepared:
    """The folder is a complete, intact checkpoint and `out_dir` may be written (see the
    module docstring; `force`: a non-empty folder too); ConfigError on the argument otherwise."""
    out = Path(resolve_dots(Path(out_dir).expanduser()))
    check_out_dir(out, force, given=out_dir)
    ckpt = Path(checkpoint_dir).expanduser()
    if not is_complete(ckpt):
        inner = sorted(p for p in ckpt.glob("step_*") if is_complete(p)) if ckpt.is_dir() else []
        hint = f"did you mean {inner[-1]}?" if inner else "name a folder like <run.dir>/checkpoints/step_00000100"
        raise ConfigError("CHECKPOINT_DIR", f"{str(ckpt)!r} {incomplete_reason(ckpt)}", hint)
    problems = verify_checkpoint(ckpt) if (ckpt / COMMITTED).is_file() else []
    if problems:
        raise ConfigError("CHECKPOINT_DIR", f"{str(ckpt)!r} failed verification: {problems[0]}",
                          "export an intact checkpoint (an older step)")
    return Prepared(ckpt, out, merged, _run_config(ckpt))


def _run_config(ckpt: Path) -> Config | None:
    """The checkpoint's run config with its model, tokenizer and data inputs resolved
    (`resolve_inputs`: a failure is one line before anything is written); None when
    meta.json holds none the schema reads."""
    try:
        cfg = config_from_dict(read_meta(ckpt)["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return resolve_inputs(cfg, data=False)


def check_out_dir(out: Path, force: bool, given: str | None = None) -> None:
    """ConfigError on OUT_DIR when it is a file (or anything but a folder), or a folder that
    holds anything and `force` is off: an export writes config.json, weights and tokenizer
    files there and removes weight files it did not write, so another model's folder
    would be overwritten without a word. `out`: the folder as resolved (`resolve_dots`);
    `given`: as the user wrote it, also named when it differs."""
    name = repr(str(out))
    if given is not None and str(Path(given).expanduser()) != str(out):
        name = f"{given!r} (that is {name})"
    if out.is_dir():
        try:
            held = sorted(p.name for p in out.iterdir())
        except OSError as e:
            raise ConfigError("OUT_DIR", f"{name} cannot be read: {e.strerror or e}") from None
        if held and not force:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise ConfigError("OUT_DIR", f"{name} is not empty (it holds {shown})",
                              "name a new or empty folder, or add --force to write over it")
    elif out.exists() or out.is_symlink():
        raise ConfigError("OUT_DIR", f"{name} is a file, not a folder",
                          f"name a new folder, e.g. {out.with_name(out.name + '_hf')}")


def run(prepared: Prepared) -> ExportReport | Path:
    return export_checkpoint(prepared.checkpoint_dir, prepared.out_dir, merged=prepared.merged,
                             config=prepared.config)
