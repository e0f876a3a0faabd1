"""Training checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

One checkpoint is one folder, ``<run.dir>/checkpoints/step_00000004/``::

    .metadata, __<r>_<n>.distcp     DCP files of {"model": ..., "optimizer": ...} as given by
                                    `get_state_dict(model, optimizer)`: FQN keys, so a weight
                                    is stored under ``model.<hf parameter name>``
    meta.json                       {"step", "world_size", "config", "scheduler", "extra"} (rank 0)
    rng_rank<r>.safetensors         torch CPU (and CUDA) generator states of rank r, uint8
    rng_rank<r>.json                python `random` and numpy generator states of rank r
    COMMITTED                       written last, by rank 0, once every rank has finished

Every rank writes into ``step_00000004.tmp-<token>`` (the token is drawn on rank 0 and
broadcast); after all ranks are done rank 0 writes COMMITTED and renames the folder. So a
folder named ``step_<8 digits>`` holding COMMITTED is complete, and nothing else is ever
resumed from: an interrupted save leaves a ``.tmp-`` folder, which `prune` removes later.

DCP reshards on load (the target model's state dict says which shard each rank wants), so
a checkpoint saved by N ranks loads at any world size and mesh (FSDP or HSDP).

No file of ours is a pickle. DCP's own `.metadata` is one, and DCP reads its non-tensor
entries (the optimizer's param_groups) with ``torch.load(weights_only=False)``; loading
here goes through `SafeFileSystemReader` (an unpickler that admits only DCP's metadata
classes) and `SafeLoadPlanner` (``weights_only=True``), so a checkpoint cannot run code on load.

Public interface::

    CheckpointManager(run_dir, ckpt_cfg, runtime)
        .dir -> Path                          <run_dir>/checkpoints
        .should_save(step, max_steps) -> bool
        .save(engine, step, extra=None, final=False)     collective
        .async_in_flight -> bool
        .wait() -> Path | None                            collective; commits a pending save
        .latest() -> Path | None
        .resolve_resume() -> Path | None                  ConfigError('checkpoint.resume')
        .load(engine, path) -> dict                       collective; returns `extra`
        .prune() -> list[Path]                            rank 0
        .close()                                          collective
    step_dir_name(step) -> str
    is_complete(path) -> bool
    read_meta(path) -> dict
    SafeFileSystemReader(path), SafeLoadPlanner()   for any dcp.load of these folders
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardwise.config.schema import CheckpointConfig
from shardwise.distributed.runtime import Runtime
from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.engine.train import TrainEngine

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINTS_DIR", "COMMITTED", "META_FILE", "CheckpointManager", "SafeFileSystemReader",
           "SafeLoadPlanner", "is_complete", "read_meta", "step_dir_name"]

CHECKPOINTS_DIR = "checkpoints"
COMMITTED = "COMMITTED"
META_FILE = "meta.json"
DCP_METADATA = ".metadata"
FORMAT = "shardwise-dcp/1"

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_DIR = re.compile(r"^step_(\d{8,})\.tmp-")


def step_dir_name(step: int) -> str:
    """``step_00000004``: zero-padded so that names sort like steps."""
    assert step >= 0, step
    return f"step_{step:08d}"


def is_complete(path: str | os.PathLike[str]) -> bool:
    """A committed checkpoint folder: COMMITTED, meta.json and DCP's .metadata all present."""
    p = Path(path)
    return p.is_dir() and all((p / name).is_file() for name in (COMMITTED, META_FILE, DCP_METADATA))


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """meta.json of a checkpoint folder."""
    return json.loads((Path(path) / META_FILE).read_text())


def _incomplete_reason(p: Path) -> str:
    if not p.exists():
        return "does not exist"
    if not p.is_dir():
        return "is not a folder"
    missing = [n for n in (DCP_METADATA, META_FILE, COMMITTED) if not (p / n).is_file()]
    if missing == [COMMITTED]:
        return "has no COMMITTED marker (a save that did not finish)"
    return "is not a shardwise checkpoint (missing " + ", ".join(missing) + ")"


# ----------------------------------------------------------------------------- RNG


def _write_rng(folder: Path, rank: int, device: torch.device) -> None:
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


def _load_rng(folder: Path, rank: int, device: torch.device) -> bool:
    """Restore this rank's generators; False (and nothing changed) if the checkpoint has no
    file for this rank (it was saved by fewer ranks)."""
    tensors_path, json_path = folder / f"rng_rank{rank}.safetensors", folder / f"rng_rank{rank}.json"
    if not (tensors_path.is_file() and json_path.is_file()):
        return False
    tensors = load_file(str(tensors_path))
    state = json.loads(json_path.read_text())
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], device)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    return True


# ------------------------------------------------------------------- safe DCP loading

# What DCP's .metadata pickle refers to (torch 2.13): its dataclasses, torch.Size, dtypes,
# a layout helper and paths. Anything else is refused rather than imported and called.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # DCP's dataclasses and enums, never a function
                return obj
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose .metadata is read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        assert isinstance(metadata, Metadata), type(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer param_groups: numbers, strings, tuples) with weights_only."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ------------------------------------------------------------------------ manager


@dataclass
class _PendingSave:
    future: Future
    tmp: Path
    final: Path
    step: int


class CheckpointManager:
    """Saves, commits, finds, prunes and loads the checkpoints of one run.

    `save`, `wait`, `load` and `close` are collective: every rank calls them in the same
    order. The rest touch only the file system (`prune` acts on rank 0 alone). All ranks
    must see the same `run_dir` (a shared file system across nodes).
    """

    def __init__(self, run_dir: str | os.PathLike[str], ckpt_cfg: CheckpointConfig, runtime: Runtime):
        self.dir = Path(run_dir) / CHECKPOINTS_DIR
        self.cfg = ckpt_cfg
        self.runtime = runtime
        self._async_group: dist.ProcessGroup | None = None
        self._pending: _PendingSave | None = None

    # -- policy
    def should_save(self, step: int, max_steps: int) -> bool:
        """Every `every_steps` optimizer steps (0: never periodically), and the final step."""
        every = self.cfg.every_steps
        return (every > 0 and step % every == 0) or step == max_steps

    @property
    def async_in_flight(self) -> bool:
        """An async save was started and is not committed yet (`wait` commits it)."""
        return self._pending is not None

    # -- saving
    def save(self, engine: TrainEngine, step: int, extra: dict[str, Any] | None = None,
             final: bool = False) -> None:
        """Checkpoint model, optimizer, scheduler, step, RNG and `extra` as of `step`.

        Collective. A pending async save is committed first. Synchronous unless
        `checkpoint.async` is set and `final` is False; an async save returns once the
        state has been copied to CPU memory (training may change the live tensors from
        then on) and is committed by the next `save` or `wait`. `final` saves synchronously:
        the checkpoint is committed when the call returns. `extra` must be JSON-able
        (e.g. ``{"sampler": sampler.state_dict()}``); `load` returns it.
        """
        self.wait()
        try:  # on every rank, so a bad `extra` fails everywhere rather than hang the others
            extra = json.loads(json.dumps(dict(extra or {})))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"CheckpointManager.save: `extra` must be JSON-able: {exc}") from None
        final_dir = self.dir / step_dir_name(step)
        tmp = self.dir / f"{final_dir.name}.tmp-{self._agreed_token()}"
        tmp.mkdir(parents=True, exist_ok=True)
        _write_rng(tmp, self.runtime.rank, self.runtime.device)
        if self.runtime.is_main:
            meta = {
                "format": FORMAT,
                "step": step,
                "world_size": self.runtime.world_size,
                "config": engine.cfg.model_dump(by_alias=True, mode="json"),
                "scheduler": engine.scheduler.state_dict(),
                "extra": extra,
            }
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))

        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        app_state = {"model": model_sd, "optimizer": optim_sd}
        writer = FileSystemWriter(tmp)
        if self.cfg.async_save and not final:
            # The writer stages (FileSystemWriter is a BlockingAsyncStager): every tensor,
            # CPU ones included, is copied into fresh CPU memory before async_save returns,
            # so later optimizer steps cannot leak into the files. The upload thread runs
            # DCP's planning collectives on a gloo group of its own: on the default group
            # they would interleave with the training collectives of the main thread.
            response = dcp.async_save(app_state, storage_writer=writer, process_group=self._group())
            staging = getattr(response, "staging_completion", None)
            if staging is not None:  # a stager that copies in the background: wait for the copy
                staging.result()
            future = getattr(response, "upload_completion", response)
            self._pending = _PendingSave(future, tmp, final_dir, step)
        else:
            dcp.save(app_state, storage_writer=writer)
            self._commit(tmp, final_dir, step, ok=True)

    def wait(self) -> Path | None:
        """Block until the in-flight async save is written, then commit it. Collective.

        Returns the committed folder, or None when nothing was pending. Raises
        RuntimeError on every rank if the save failed on any rank (its .tmp- folder is
        left behind, never resumed from, and removed by a later `prune`).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error: BaseException | None = None
        try:
            pending.future.result()
        except Exception as exc:  # reported collectively below
            error = exc
        self._commit(pending.tmp, pending.final, pending.step, ok=error is None, error=error)
        return pending.final

    def close(self) -> None:
        """Commit a pending save and release the async group. Collective."""
        self.wait()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None

    def _group(self) -> dist.ProcessGroup:
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _agreed_token(self) -> str:
        """A random token drawn on rank 0 and broadcast: the same tmp folder on every rank."""
        value = secrets.randbits(62) if self.runtime.is_main else 0
        t = torch.tensor([value], dtype=torch.int64, device=self.runtime.device)
        dist.broadcast(t, src=0)
        return f"{int(t.item()):016x}"

    def _all_ok(self, ok: bool) -> bool:
        """Doubles as the barrier: returns once every rank has reached it."""
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.runtime.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _commit(self, tmp: Path, final: Path, step: int, ok: bool,
                error: BaseException | None = None) -> None:
        if not self._all_ok(ok):
            raise RuntimeError(f"checkpoint of step {step} failed on at least one rank; "
                               f"{tmp} is left uncommitted") from error
        if self.runtime.is_main:
            with open(tmp / COMMITTED, "w") as f:
                json.dump({"step": step, "world_size": self.runtime.world_size}, f)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():  # a leftover folder of the same step (uncommitted, or re-saved)
                aside = final.with_name(f"{final.name}.tmp-replaced-{secrets.token_hex(4)}")
                os.rename(final, aside)
                os.rename(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.dir)
            log.info("checkpoint committed: %s", final)
            self.prune()
        self._all_ok(True)

    # -- finding
    def _complete_steps(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and is_complete(p):
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The complete checkpoint of the highest step in this run, or None."""
        found = self._complete_steps()
        return found[-1][1] if found else None

    def resolve_resume(self) -> Path | None:
        """Where to resume from, per `checkpoint.resume`: auto -> `latest()` (None in a
        fresh run), never -> None, a path -> that folder if it is a complete checkpoint."""
        resume = self.cfg.resume
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume).expanduser()
        if is_complete(path):
            return path
        hint = "use auto, never, or a folder like <run.dir>/checkpoints/step_00000100"
        inner = CheckpointManager(path, self.cfg, self.runtime).latest() if path.is_dir() else None
        if inner is not None:
            hint = f"did you mean {inner}?"
        raise ConfigError("checkpoint.resume", f"{resume!r} {_incomplete_reason(path)}", hint)

    # -- pruning
    def prune(self) -> list[Path]:
        """Delete complete checkpoints beyond the `keep_last` newest, and the debris of
        interrupted saves (.tmp- folders, folders without COMMITTED) of steps up to the
        newest complete one. Acts on rank 0 only; returns what it deleted."""
        if not self.runtime.is_main:
            return []
        complete = self._complete_steps()
        doomed = [p for _, p in complete[:-self.cfg.keep_last]] if len(complete) > self.cfg.keep_last else []
        if complete:
            newest = complete[-1][0]
            for p in self.dir.iterdir():
                m = _TMP_DIR.match(p.name) or _STEP_DIR.match(p.name)
                if m and p.is_dir() and int(m.group(1)) <= newest and not is_complete(p) \
                        and (self._pending is None or p != self._pending.tmp):
                    doomed.append(p)
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return doomed

    # -- loading
    def load(self, engine: TrainEngine, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, `engine.step` and this rank's RNG from a
        complete checkpoint, at any world size or mesh (DCP reshards). Collective.

        Ranks for which the checkpoint has no RNG file (it was saved by fewer ranks) keep
        their generators. Returns the `extra` dict given to `save`.
        """
        self.wait()
        path = Path(path)
        if not is_complete(path):
            raise ConfigError("checkpoint.resume", f"{str(path)!r} {_incomplete_reason(path)}")
        meta = read_meta(path)
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        app_state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(app_state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        set_state_dict(engine.model, engine.optimizer,
                       model_state_dict=app_state["model"], optim_state_dict=app_state["optimizer"])
        engine.scheduler.load_state_dict(meta["scheduler"])
        engine.step = int(meta["step"])
        _load_rng(path, self.runtime.rank, self.runtime.device)
        if self.runtime.is_main:
            log.info("resumed from %s (step %d, saved by %d ranks, loaded by %d)", path,
                     engine.step, meta["world_size"], self.runtime.world_size)
        return meta["extra"]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
