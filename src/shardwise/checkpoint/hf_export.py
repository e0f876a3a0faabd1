"""HF export: the model's weights as a folder `transformers.from_pretrained` loads.

Two sources, one writer:

- `export_model`: a live FSDP2-sharded model. Collective (every rank calls it): state-dict
  entries are gathered one at a time (`DTensor.full_tensor()`, all ranks take part); rank 0
  moves each full tensor to CPU and appends it to the current safetensors shard, writing
  and freeing the shard as soon as it is complete. Every rank holds at most one full
  tensor at a time; rank 0 also holds at most one shard of host memory
  (``max_shard_bytes``, or one tensor larger than that).
- `export_checkpoint`: a DCP checkpoint directory, offline, one process, no process group.
  Tensors are read from DCP in small batches and written the same streaming way.

The folder: ``model.safetensors`` (or ``model-0000k-of-0000N.safetensors`` and
``model.safetensors.index.json``), ``config.json``, ``generation_config.json`` for
generative models, and the tokenizer files when a tokenizer folder is known.

Layout decisions, matched to `PreTrainedModel.save_pretrained`:

- Tied weights (one parameter under several names) are written once, under the name
  transformers keeps: names matching a ``_tied_weights_keys`` entry of the model are
  dropped while another name remains (tied Llama: ``model.embed_tokens.weight`` is written,
  ``lm_head.weight`` is not); `from_pretrained` re-ties from ``tie_word_embeddings``.
- Non-persistent buffers (rotary ``inv_freq``) are not in any state dict and not written.
- Names are the model's state-dict names, except fused MoE experts (transformers 5 keeps
  a layer's experts as 3-D ``gate_up_proj`` / ``down_proj``): they are cut into the
  original checkpoint layout, ``experts.{e}.gate_proj.weight`` ..., as `save_pretrained`
  writes them and transformers fuses them again on load
  (`shardwise.models.patches.moe.checkpoint_layout`).
- Shards are planned up front from shapes and dtypes, so each file gets its final
  ``-of-0000N`` name; a tensor never spans files and a file exceeds ``max_shard_bytes``
  only when one tensor alone does.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise.checkpoint.disk import free_bytes, human_bytes, nearly_full, out_of_space, short_error
from shardwise.checkpoint.integrity import verify_checkpoint
from shardwise.checkpoint.layout import COMMITTED, DCP_METADATA
from shardwise.checkpoint.safe_load import SafeFileSystemReader
from shardwise.config.dtypes import to_torch_dtype
from shardwise.config.load import config_from_dict
from shardwise.config.schema import Config
from shardwise.data.tokenizer import (
    TOKENIZER_PATTERNS,
    has_tokenizer_files,
    locate_tokenizer,
)
from shardwise.errors import DiskFullError, ShardwiseError
from shardwise.fsdp.build import build_full
from shardwise.fsdp.gather import full_tensor
from shardwise.models import lora
from shardwise.models.layout import TensorEntry, checkpoint_entries, tied_aliases
from shardwise.models.loading import build_meta_model, load_hf_config
from shardwise.models.patches import patch_model

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "ExportError",
    "ExportReport",
    "export_checkpoint",
    "export_model",
    "find_tokenizer_dir",
    "plan_shards",
    "shard_file_names",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""Bytes per safetensors file (transformers' classic "5GB"); also rank 0's host buffer."""

READ_BATCH_BYTES = 256 * 1024**2
"""`export_checkpoint` reads DCP tensors in batches of about this many bytes."""

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class ExportError(ShardwiseError, ValueError):
    """An export input a user can fix: a checkpoint folder without meta.json or model
    tensors, a tokenizer folder without tokenizer files, shapes that disagree."""


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote; ``os.PathLike`` (and ``str()``) as its folder. On ranks other
    than 0 of `export_model`, `files` is empty and the counts are 0 (they write nothing)."""

    out_dir: Path
    files: list[str]
    """Weight files written, in order (names relative to out_dir)."""
    num_tensors: int
    total_bytes: int
    """Sum of the written tensors' bytes."""
    max_buffered_bytes: int
    """Peak bytes of tensors this process held for writing at once (the shard buffer)."""
    tokenizer_dir: Path | None
    """Where the tokenizer files came from, or None if none were copied."""

    def __fspath__(self) -> str:  # usable wherever the folder's path is
        return str(self.out_dir)

    def __str__(self) -> str:
        return str(self.out_dir)


# --------------------------------------------------------------------- pure helpers


def plan_shards(entries: Iterable[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Split entries, in order, into files of at most `max_shard_bytes` each (a single
    larger tensor gets a file of its own). Always at least one (possibly empty) file."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_file_names(n: int) -> list[str]:
    """``["model.safetensors"]`` for one file, else ``model-00001-of-0000n.safetensors``..."""
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _out_dtype(src: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and src.is_floating_point else src


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return to_torch_dtype(dtype)


def _copy_tokenizer(src: Path, out_dir: Path) -> None:
    if not has_tokenizer_files(src):
        raise ExportError(f"tokenizer folder {str(src)!r} holds no tokenizer files "
                          f"(looked for {', '.join(TOKENIZER_PATTERNS)})")
    for pat in TOKENIZER_PATTERNS:
        for f in sorted(src.glob(pat)):
            if f.is_file():
                shutil.copy2(f, out_dir / f.name)


def _hf_class(model: nn.Module) -> type:
    """The model's transformers class (fully_shard swaps in a subclass named FSDP<cls>)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


# --------------------------------------------------------------------- the writer


class _ShardWriter:
    """Receives tensors in plan order and writes each file as soon as its last tensor
    arrives; holds at most one file's tensors."""

    def __init__(self, out_dir: Path, shards: list[list[TensorEntry]]):
        self.out_dir = out_dir
        self.shards = shards
        self.files = shard_file_names(len(shards))
        self._order = [e for shard in shards for e in shard]
        self._next = 0
        self._shard = 0
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered = 0
        self.max_buffered = 0
        self.total_bytes = sum(e.nbytes for e in self._order)
        out_dir.mkdir(parents=True, exist_ok=True)
        # Weight files of an earlier export into the same folder would confuse from_pretrained.
        for f in out_dir.iterdir():
            if f.is_file() and (f.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(f.name)):
                f.unlink()
        if not self._order:
            self._flush()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        assert self._next < len(self._order), f"unexpected tensor {name}"
        e = self._order[self._next]
        assert name == e.name and tuple(tensor.shape) == e.shape and tensor.dtype == e.dtype, \
            (name, tuple(tensor.shape), tensor.dtype, e)
        assert tensor.device.type == "cpu"
        self._buffer[name] = tensor.contiguous()
        self._buffered += e.nbytes
        self.max_buffered = max(self.max_buffered, self._buffered)
        self._next += 1
        if len(self._buffer) == len(self.shards[self._shard]):
            self._flush()

    def _flush(self) -> None:
        save_file(self._buffer, str(self.out_dir / self.files[self._shard]), metadata={"format": "pt"})
        self._buffer = {}
        self._buffered = 0
        self._shard += 1

    def finish(self) -> list[str]:
        assert self._next == len(self._order) and self._shard == len(self.shards), "export incomplete"
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {e.name: f for f, shard in zip(self.files, self.shards) for e in shard},
            }
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return list(self.files)


def _write_config(out_dir: Path, hf_config, arch: str | None, entries: list[TensorEntry],
                  generation_config) -> None:
    cfg = copy.deepcopy(hf_config)
    if arch is not None:
        cfg.architectures = [arch]
    floating = [e.dtype for e in entries if e.dtype.is_floating_point]
    if floating:
        cfg.dtype = max(set(floating), key=floating.count)
    cfg.save_pretrained(str(out_dir))
    if generation_config is not None:
        generation_config.save_pretrained(str(out_dir))


def _generation_config(model: nn.Module):
    can = getattr(model, "can_generate", None)
    return getattr(model, "generation_config", None) if callable(can) and can() else None


# --------------------------------------------------------------------- live export


def _shares_storage(t: torch.Tensor, value: torch.Tensor) -> bool:
    local = value.to_local() if isinstance(value, DTensor) else value
    return t.device == local.device and t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def export_model(model: nn.Module, out_dir: str | Path, hf_config, tokenizer_dir: str | Path | None = None,
                 dtype: torch.dtype | str | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, checkpoint: Path | None = None) -> ExportReport:
    """Write a live (FSDP2-sharded or plain) HF model as an HF folder at `out_dir`.

    Collective: every rank calls it with the same arguments; rank 0 writes, and every rank
    returns once the folder is complete. `hf_config` is the model's PretrainedConfig
    (written as config.json with `architectures` and `dtype` set to what was written);
    `dtype` (torch dtype or name) casts floating tensors, default: as stored (the master
    dtype). `tokenizer_dir`: its tokenizer files are copied. Returns an `ExportReport`.

    A failure on rank 0 is raised on every rank as rank 0's own error line (a peer used to
    report "failed on rank 0 (see its error)", and the launcher showed that one). A full
    disk is a `DiskFullError` (exit status 74) naming the folder, the free space and the
    export's size, and `checkpoint` (the run's last committed checkpoint, which the
    export can be written from later); the partial folder is removed.
    """
    out = Path(out_dir)
    dtype = _resolve_dtype(dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd = model.state_dict()  # sharded DTensors (FSDP's pre-save hook reshards): no copy
    aliases = tied_aliases(model)
    merges = lora.merge_sources(model)  # LoRA: the base weights are written merged, the adapters folded in
    entries = checkpoint_entries(model, [(lora.hf_name(k), k, tuple(v.shape), _out_dtype(v.dtype, dtype))
                                         for k, v in sd.items() if k not in aliases and not lora.is_lora_key(k)])

    writer, error = None, None
    if rank == 0:
        try:
            writer = _ShardWriter(out, plan_shards(entries, max_shard_bytes))
        except Exception as e:  # keep taking part in the collectives, report at the end
            error = e
    full, gathered = None, None
    for e in entries:
        value = sd[e.source]
        if gathered != e.source:  # one gather per source (the cuts of fused experts follow it)
            full = None  # drop the previous full tensor before gathering the next
            full, gathered = full_tensor(value), e.source
            if e.source in merges:  # one layer gathered, merged, written, dropped
                a, b, scale = merges[e.source]
                full = lora.merge(full, full_tensor(sd[a]), full_tensor(sd[b]), scale)
        if writer is not None:
            try:
                t = e.take(full).to(device="cpu", dtype=e.dtype)
                if e.part is not None or _shares_storage(t, value):
                    t = t.clone()  # a view, or a replicated / plain tensor: do not buffer live storage
                writer.add(e.name, t)
            except Exception as exc:
                writer, error = None, exc
    del full
    files: list[str] = []
    if writer is not None:
        try:
            files = writer.finish()
            _write_config(out, hf_config, _hf_class(model).__name__, entries, _generation_config(model))
            if tokenizer_dir is not None:
                _copy_tokenizer(Path(tokenizer_dir), out)
        except Exception as exc:
            error = exc
    full_line = None
    if error is not None and rank == 0 and (out_of_space(error) or nearly_full(out)):
        need = sum(e.nbytes for e in entries)
        shutil.rmtree(out, ignore_errors=True)
        kept = (f"the last committed checkpoint {checkpoint} is intact (free space, then `shardwise export "
                f"{checkpoint} {out}` writes the export from it)" if checkpoint is not None
                else "checkpoints already committed are intact (free space, or move run.dir to a larger disk)")
        full_line = (f"HF export to {str(out)!r} could not be written: the disk holding it is full "
                     f"({human_bytes(free_bytes(out))} free, the export needs about {human_bytes(need)}); the partial "
                     f"folder was removed; {kept}")
    if dist.is_initialized():
        box = [None if error is None else (full_line, short_error(error))] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0, group=None, device=_collective_device())
        if box[0] is not None and error is None:
            full_line, reason = box[0]
            if full_line is None:
                raise RuntimeError(f"HF export to {str(out)!r} failed on rank 0: {reason}")
    if full_line is not None:
        raise DiskFullError(full_line) from None
    if error is not None:
        raise error
    return ExportReport(out_dir=out, files=files, num_tensors=len(entries) if rank == 0 else 0,
                        total_bytes=writer.total_bytes if writer is not None else 0,
                        max_buffered_bytes=writer.max_buffered if writer is not None else 0,
                        tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir is not None and rank == 0 else None)


def export_adapter(model: nn.Module, out_dir: str | Path, base: str | None = None) -> Path:
    """Write the LoRA adapters (and modules to save) of a live model as a PEFT adapter
    folder: ``adapter_config.json`` + ``adapter_model.safetensors``, what
    ``PeftModel.from_pretrained(base_model, out_dir)`` loads. `base`: the base model's
    folder, recorded as ``base_model_name_or_path``. Collective like `export_model`: every
    rank gathers, rank 0 writes."""
    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = model.peft_config[lora.ADAPTER]
    sd = model.state_dict()
    names = lora.adapter_state(sd, lora.saved_modules(model))
    tensors = {}
    for key, name in names.items():
        t = full_tensor(sd[key])
        if rank == 0:
            tensors[name] = t.to("cpu").contiguous().clone()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.copy(config)
        config.base_model_name_or_path = str(Path(base).resolve()) if base else None
        config.inference_mode = True
        config.save_pretrained(str(out))
    if dist.is_initialized():
        dist.barrier()
    return out


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------- offline export


def find_tokenizer_dir(model_cfg, checkpoint_dir: str | Path) -> Path | None:
    """Where a checkpoint's tokenizer lives: `model.tokenizer`; else `model.path` if it
    holds tokenizer files; else ``<checkpoint_dir>/../../tokenizer`` (the run folder's);
    else None. A configured folder that no longer exists is skipped with a warning."""
    if model_cfg.tokenizer is not None and not has_tokenizer_files(model_cfg.tokenizer):
        log.warning("model.tokenizer %r holds no tokenizer files; looking elsewhere", str(model_cfg.tokenizer))
    return locate_tokenizer(model_cfg.tokenizer, model_cfg.path, Path(checkpoint_dir).resolve().parent.parent)


def export_lora_checkpoint(ckpt: Path, cfg, out_dir: str | Path, merged: bool = False,
                           tokenizer_dir: str | Path | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                           dtype: torch.dtype | str | None = None) -> ExportReport | Path:
    """A LoRA checkpoint (the trainable tensors: adapters and modules to save) as a PEFT
    adapter folder, or with `merged` as the merged HF model. The base comes from the run's
    ``model.path`` (or its seeded init), built as the run built it; the checkpoint's
    tensors replace the adapters'. One process, no process group."""
    model = build_full(cfg)
    state = model.state_dict()
    wanted = {k for k, p in model.named_parameters() if p.requires_grad}
    md = SafeFileSystemReader(str(ckpt)).read_metadata()
    missing = sorted(k for k in wanted if f"model.{k}" not in md.state_dict_metadata)
    if missing:
        raise ExportError(f"the LoRA checkpoint in {str(ckpt)!r} lacks {missing[0]!r} (DCP key 'model.{missing[0]}')")
    buf = {"model": {k: torch.empty_like(state[k]) for k in sorted(wanted)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(buf, storage_reader=SafeFileSystemReader(str(ckpt)), no_dist=True)
    with torch.no_grad():
        for k, t in buf["model"].items():
            state[k].copy_(t)
    if not merged:
        return export_adapter(model, out_dir, base=cfg.model.path)
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else find_tokenizer_dir(cfg.model, ckpt)
    return export_model(model, out_dir, load_hf_config(cfg.model), tokenizer_dir=tok, dtype=dtype,
                        max_shard_bytes=max_shard_bytes)


def _read_batches(entries: list[TensorEntry], stored: Mapping[str, torch.dtype],
                  batch_bytes: int) -> Iterator[list[TensorEntry]]:
    batch: list[TensorEntry] = []
    size = 0
    for e in entries:
        n = e.nbytes // e.dtype.itemsize * stored[e.source].itemsize
        if batch and size + n > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += n
    if batch:
        yield batch


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *,
                      dtype: torch.dtype | str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      tokenizer_dir: str | Path | None = None,
                      task: str | None = None, merged: bool = False,
                      config: Config | None = None) -> ExportReport | Path:
    """Write the model of a DCP checkpoint directory as an HF folder; one process, no
    process group.

    The directory holds DCP files of ``{"model": <HF-named model state dict>, "optimizer":
    ...}`` (weights are the DCP keys ``model.<hf name>``) and ``meta.json`` with the run's
    Config under ``"config"``. The HF config comes from that Config's `model` section; the
    tokenizer from `tokenizer_dir` or `find_tokenizer_dir`. `task` defaults to
    ``meta["task"]`` or the run's ``model.task``. Tensors are read a batch (~`READ_BATCH_BYTES`) at a time,
    through the checkpoint module's `SafeFileSystemReader` (no arbitrary unpickling).
    A folder with COMMITTED is verified first (`verify_checkpoint`: sizes and SHA-256
    digests); a damaged one is an ExportError naming the folder and the first problem.

    A LoRA run's checkpoint (adapters only): `export_lora_checkpoint`, a PEFT adapter folder
    or, with `merged`, the merged HF model. `config`: the run's Config as the caller
    resolved it (`shardwise.jobs.export`: its inputs in this machine's Hub cache) instead of
    meta.json's.
    """
    # DCP's .metadata is a pickle: read it with the checkpoint module's restricted unpickler.
    ckpt = Path(checkpoint_dir)
    meta_path = ckpt / "meta.json"
    if not meta_path.is_file():
        raise ExportError(f"{str(ckpt)!r} is not a checkpoint directory: it holds no meta.json")
    if not (ckpt / DCP_METADATA).is_file():
        raise ExportError(f"{str(ckpt)!r} holds no DCP {DCP_METADATA} file: the save did not finish")
    if not (ckpt / COMMITTED).is_file():
        log.warning("%s has no %s marker (an interrupted save?); exporting what is there", ckpt, COMMITTED)
    else:  # sizes and checksums against COMMITTED: damaged bytes must not reach the HF folder
        problems = verify_checkpoint(ckpt)
        if problems:
            raise ExportError(f"checkpoint {ckpt} failed verification: {problems[0]}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{str(meta_path)!r} cannot be read: {exc}") from None
    if "config" not in meta:
        raise ExportError(f"{str(meta_path)!r} has no 'config' entry (the run's config)")
    cfg = config if config is not None else config_from_dict(meta["config"])
    if cfg.model.lora.enabled:
        return export_lora_checkpoint(ckpt, cfg, out_dir, merged, tokenizer_dir, max_shard_bytes, dtype)
    hf_config = load_hf_config(cfg.model)
    # names only, no memory; patched like the run's model so the names match its checkpoint
    model = patch_model(build_meta_model(cfg.model, task or meta.get("task", cfg.model.task)), cfg)
    dtype = _resolve_dtype(dtype)

    md = SafeFileSystemReader(str(ckpt)).read_metadata()
    stored = {k: v for k, v in md.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not stored:
        raise ExportError(f"the DCP checkpoint in {str(ckpt)!r} holds no 'model.*' tensors")
    aliases = tied_aliases(model)
    expected = model.state_dict(keep_vars=True)
    rows: list[tuple[str, str, tuple[int, ...], torch.dtype]] = []
    for name, ref in expected.items():
        if name in aliases:
            continue
        names = [name] + [a for a, kept in aliases.items() if kept == name]
        source = next((f"model.{n}" for n in names if f"model.{n}" in stored), None)
        if source is None:
            raise ExportError(f"the checkpoint in {str(ckpt)!r} lacks the weight {name!r} "
                              f"(DCP key 'model.{name}')")
        shape = tuple(stored[source].size)
        if shape != tuple(ref.shape):
            raise ExportError(f"{source} has shape {shape} in the checkpoint but {tuple(ref.shape)} "
                              "in the model its config describes")
        rows.append((name, source, shape, _out_dtype(stored[source].properties.dtype, dtype)))
    entries = checkpoint_entries(model, rows)
    used = {e.source for e in entries} | {f"model.{a}" for a in aliases}
    extra = sorted(k for k in stored if k not in used)
    if extra:
        log.warning("not exported: %d checkpoint tensors the model has no place for: %s",
                    len(extra), ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else ""))

    out = Path(out_dir)
    writer = _ShardWriter(out, plan_shards(entries, max_shard_bytes))
    stored_dtypes = {k: v.properties.dtype for k, v in stored.items()}
    for batch in _read_batches(entries, stored_dtypes, READ_BATCH_BYTES):
        buf = {e.source: torch.empty(tuple(stored[e.source].size), dtype=stored_dtypes[e.source]) for e in batch}
        with warnings.catch_warnings():  # single-process loading is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(buf, storage_reader=SafeFileSystemReader(str(ckpt)), no_dist=True)
        for e in batch:
            t = e.take(buf[e.source]).to(e.dtype)
            writer.add(e.name, t.clone() if e.part is not None else t)  # a cut: not a view of buf
        del buf
    files = writer.finish()
    _write_config(out, hf_config, _hf_class(model).__name__, entries, _generation_config(model))
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else find_tokenizer_dir(cfg.model, ckpt)
    if tok is not None:
        _copy_tokenizer(tok, out)
    else:
        log.warning("no tokenizer found for %s; the export holds weights and config only", ckpt)
    return ExportReport(out_dir=out, files=files, num_tensors=len(entries), total_bytes=writer.total_bytes,
                        max_buffered_bytes=writer.max_buffered, tokenizer_dir=tok)
