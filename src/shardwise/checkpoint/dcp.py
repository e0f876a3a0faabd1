"""Training checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

One checkpoint is one folder, ``<run.dir>/checkpoints/step_00000004/``::

    .metadata, __<r>_<n>.distcp     DCP files of {"model": ..., "optimizer": ...} as given by
                                    `get_state_dict(model, optimizer)`: FQN keys, so a weight
                                    is stored under ``model.<hf parameter name>``
    meta.json                       {"step", "world_size", "config", "scheduler", "extra"} (rank 0)
    rng_rank<r>.safetensors         torch CPU (and CUDA) generator states of rank r, uint8
    rng_rank<r>.json                python `random` and numpy generator states of rank r
    COMMITTED                       written last, by rank 0, once every rank has finished:
                                    {"step", "world_size", "files": {name: {"bytes", "sha256"}}}
                                    for every other file of the folder

Every rank writes into ``step_00000004.tmp-<token>`` (the token is drawn on rank 0 and
broadcast), then hashes the files it wrote (its ``__<rank>_*.distcp`` and RNG files; rank 0
also ``.metadata`` and meta.json). The ranks agree that all succeeded, the digests are
gathered on rank 0, and rank 0 writes COMMITTED and renames the folder. So a folder named
``step_<8 digits>`` holding COMMITTED is complete, and nothing else is ever resumed from: an
interrupted save leaves a ``.tmp-`` folder, which `prune` removes later.

Resuming verifies sizes and SHA-256 digests against COMMITTED (`verify_checkpoint`; the
files are split over the ranks). ``resume: auto`` skips a damaged checkpoint with one
warning and takes the newest one that verifies; an explicit path that fails is a
ConfigError. A COMMITTED without "files" (empty, or written before checksums existed) is
trusted after the structural check `is_complete`.

An async save is committed by a background thread as soon as DCP has written its files
(agreement and digests over the save's own gloo group), not at the next `save` or `wait`.

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
        .async_in_flight -> bool                          same on every rank
        .wait() -> Path | None                            joins the async commit, re-raises its error
        .latest() -> Path | None                          structural check only (is_complete)
        .resolve_resume() -> Path | None                  collective when a group exists; verifies;
                                                          ConfigError('checkpoint.resume')
        .check_resumable() -> Path | None                 before launch: quick checks, same ConfigError
        .load(engine, path) -> dict                       collective; returns `extra`; CheckpointError
        .prune() -> list[Path]                            rank 0
        .close()                                          collective
    step_dir_name(step) -> str
    is_complete(path) -> bool
    verify_checkpoint(path, ranks=(0, 1), digests=True) -> list[str]   problems (empty: intact); no process group
    metadata_problem(path) -> str | None                .metadata refused by the restricted unpickler
    file_digest(path) -> {"bytes": int, "sha256": str}
    read_meta(path) -> dict
    SafeFileSystemReader(path), SafeLoadPlanner()   for any dcp.load of these folders

This module holds the manager (save, commit, find, resume, load, prune); its parts live in
sibling modules and are re-exported here: `checkpoint.integrity` (digests, COMMITTED,
`verify_checkpoint`, `read_meta`), `checkpoint.safe_load` (the restricted unpickler and
planner), `checkpoint.rng` (each rank's generator states) and `checkpoint.disk` (free space,
a full disk, `short_error`; shared with the HF export).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import (
    CheckpointException,  # a BaseException: caught by name
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import best
from shardwise.checkpoint.disk import folder_bytes, free_bytes, human_bytes, nearly_full, out_of_space, short_error
from shardwise.checkpoint.integrity import (
    file_digest,
    folder_files,
    incomplete_reason,
    own_files,
    read_meta,
    verify_checkpoint,
)
from shardwise.checkpoint.layout import (
    CHECKPOINTS_DIR,
    COMMITTED,
    META_FILE,
    STEP_DIR,
    complete_steps,
    is_complete,
    resume_line,
    step_dir_name,
)
from shardwise.checkpoint.rng import apply_rng, read_rng, write_rng
from shardwise.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, metadata_problem
from shardwise.config.schema import CheckpointConfig
from shardwise.distributed.runtime import Runtime
from shardwise.errors import CheckpointError, ConfigError, DiskFullError

if TYPE_CHECKING:
    from shardwise.engine.train import TrainEngine

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINTS_DIR", "COMMITTED", "META_FILE", "CheckpointManager", "SafeFileSystemReader",
           "SafeLoadPlanner", "apply_optimizer_settings", "file_digest", "incomplete_reason", "is_complete",
           "metadata_problem", "read_meta", "resume_line", "saved_job", "step_dir_name", "verify_checkpoint",
           # the disk-space helpers, shared with the HF export (checkpoint.hf_export)
           "free_bytes", "human_bytes", "nearly_full", "out_of_space", "short_error"]

FORMAT = "shardwise-dcp/1"

_TMP_DIR = re.compile(r"^step_(\d{8,})\.tmp-")


def saved_job(meta: dict[str, Any]) -> str | None:
    """The command that wrote a checkpoint: meta.json's ``job``, or for a checkpoint from
    before it was recorded, what its ``extra`` holds (`shardwise rl`'s controller state has
    a ``step``; `shardwise train`'s only its sampler)."""
    if meta.get("job"):
        return str(meta["job"])
    extra = meta.get("extra")
    if isinstance(extra, dict):
        if "step" in extra and "kl_coef" in extra:
            return "rl"
        if "sampler" in extra:
            return "train"
    return None


def apply_optimizer_settings(engine: TrainEngine) -> None:
    """After a load: the optimizer's hyperparameters are the config's, not the
    checkpoint's (a resume with a new ``train.optimizer.lr`` used to keep the old one): each
    group's betas, eps and weight decay, the scheduler's base LR, and the current LR as the
    schedule gives it at the restored step."""
    opt_cfg = engine.cfg.train.optimizer
    for group in engine.optimizer.param_groups:
        group.update(betas=tuple(opt_cfg.betas), eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay,
                     initial_lr=opt_cfg.lr)
    sched = engine.scheduler
    sched.base_lrs = [opt_cfg.lr] * len(engine.optimizer.param_groups)
    factors = [fn(sched.last_epoch) for fn in sched.lr_lambdas]
    for group, base, factor in zip(engine.optimizer.param_groups, sched.base_lrs, factors, strict=True):
        group["lr"] = base * factor


def _read_meta_checked(path: Path) -> dict[str, Any]:
    """meta.json, or a one-line CheckpointError naming the folder."""
    try:
        meta = read_meta(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} cannot be read ({short_error(exc)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: {META_FILE} is not a JSON object")
    return meta


# ------------------------------------------------------------------------ manager


@dataclass
class _PendingSave:
    """An async save in flight: DCP's upload future and the thread that commits after it."""

    future: Future
    tmp: Path
    final: Path
    step: int
    thread: threading.Thread | None = None
    error: BaseException | None = None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class CheckpointManager:
    """Saves, commits, finds, verifies, prunes and loads the checkpoints of one run.

    `save`, `wait`, `load` and `close` are collective: every rank calls them in the same
    order; so is `resolve_resume` when a process group exists. The rest touch only the
    file system (`prune` acts on rank 0 alone). All ranks must see the same `run_dir` (a
    shared file system across nodes).
    """

    def __init__(self, run_dir: str | os.PathLike[str], ckpt_cfg: CheckpointConfig, runtime: Runtime,
                 job: str | None = None):
        self.dir = Path(run_dir) / CHECKPOINTS_DIR
        self.cfg = ckpt_cfg
        self.runtime = runtime
        self.job = job
        self._state_bytes = 0
        self._warned_short = False
        """The command whose state this is (``train``, ``rl``), recorded in meta.json: a
        checkpoint of another job is refused on resume (`saved_job`)."""
        self._async_group: dist.ProcessGroup | None = None
        self._pending: _PendingSave | None = None

    # -- policy
    def should_save(self, step: int, max_steps: int) -> bool:
        """Every `every_steps` optimizer steps (0: never periodically), and the final step."""
        every = self.cfg.every_steps
        return (every > 0 and step % every == 0) or step == max_steps

    @property
    def async_in_flight(self) -> bool:
        """An async save was started and `wait` has not collected it yet. Its background
        commit may already be done (`latest()` shows it); `wait` joins it and re-raises a
        failure. Depends only on the calls made, so it is the same on every rank."""
        return self._pending is not None

    # -- saving
    def save(self, engine: TrainEngine, step: int, extra: dict[str, Any] | None = None,
             final: bool = False) -> None:
        """Checkpoint model, optimizer, scheduler, step, RNG and `extra` as of `step`.

        Collective. Waits for the previous async save first (so two commits never overlap).
        Synchronous unless `checkpoint.async` is set and `final` is False; an async save
        returns once the state has been copied to CPU memory (training may change the live
        tensors from then on), and a background thread commits it as soon as DCP has written
        its files. `final` saves synchronously: the checkpoint is committed when the call
        returns. `extra` must be JSON-able (e.g. ``{"sampler": sampler.state_dict()}``);
        `load` returns it.
        """
        self.wait()
        try:  # on every rank, so a bad `extra` fails everywhere rather than hang the others
            extra = json.loads(json.dumps(dict(extra or {})))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"CheckpointManager.save: `extra` must be JSON-able: {exc}") from None
        final_dir = self.dir / step_dir_name(step)
        tmp = self.dir / f"{final_dir.name}.tmp-{self._agreed_token()}"
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=_options(engine))
        app_state = {"model": model_sd, "optimizer": optim_sd}
        self._state_bytes = _local_bytes(app_state)
        self._warn_if_short(step)
        first_error: BaseException | None = None
        try:  # this rank's small files; a full disk can stop them already
            tmp.mkdir(parents=True, exist_ok=True)
            write_rng(tmp, self.runtime.rank, self.runtime.device)
            if self.runtime.is_main:
                meta = {
                    "format": FORMAT,
                    "job": self.job,
                    "step": step,
                    "world_size": self.runtime.world_size,
                    "config": engine.cfg.model_dump(by_alias=True, mode="json"),
                    "scheduler": engine.scheduler.state_dict(),
                    "extra": extra,
                }
                (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        except OSError as exc:
            first_error = exc
        if self._any_rank(first_error is not None):  # every rank skips DCP's collectives together
            self._commit(tmp, final_dir, step, None, first_error or RuntimeError("another rank could not write"))
            return
        writer = FileSystemWriter(tmp)
        if self.cfg.async_save and not final:
            # The writer stages (FileSystemWriter is a BlockingAsyncStager): every tensor,
            # CPU ones included, is copied into fresh CPU memory before async_save returns,
            # so later optimizer steps cannot leak into the files. The upload thread runs
            # DCP's planning collectives on a gloo group of its own: on the default group
            # they would interleave with the training collectives of the main thread.
            group = self._group()
            response = dcp.async_save(app_state, storage_writer=writer, process_group=group)
            staging = getattr(response, "staging_completion", None)
            if staging is not None:  # a stager that copies in the background: wait for the copy
                staging.result()
            future = getattr(response, "upload_completion", response)
            pending = _PendingSave(future, tmp, final_dir, step)
            pending.thread = threading.Thread(target=self._commit_async, args=(pending, group),
                                              name=f"shardwise-commit-{step}", daemon=True)
            self._pending = pending
            pending.thread.start()
        else:
            error, files = None, None
            try:
                dcp.save(app_state, storage_writer=writer)
                files = self._digests(tmp)
            except (Exception, CheckpointException) as exc:  # reported collectively by _commit
                error = exc
            self._commit(tmp, final_dir, step, files, error)

    def _commit_async(self, pending: _PendingSave, group: dist.ProcessGroup) -> None:
        """Body of the commit thread of one async save: wait for DCP's files, hash them,
        commit on the save's gloo group (never the default group, which the main thread
        trains on). Its error is kept for `wait`."""
        error, files = None, None
        try:
            pending.future.result()
            files = self._digests(pending.tmp)
        except (Exception, CheckpointException) as exc:  # reported collectively by _commit
            error = exc
        try:
            self._commit(pending.tmp, pending.final, pending.step, files, error, group=group)
        except BaseException as exc:
            pending.error = exc

    def wait(self) -> Path | None:
        """Block until the in-flight async save is committed (or has failed). Every rank
        calls it.

        Returns the committed folder, or None when nothing was pending. Raises
        RuntimeError on every rank if the save failed on any rank (the ranks agreed on it
        before committing; its .tmp- folder is left behind, never resumed from, and
        removed by a later `prune`).
        """
        pending = self._pending
        if pending is None:
            return None
        assert pending.thread is not None
        pending.thread.join()
        self._pending = None
        if pending.error is not None:
            raise pending.error
        return pending.final

    def close(self) -> None:
        """Wait for a pending save and release the async group. Collective."""
        try:
            self.wait()
        finally:
            if self._async_group is not None:
                dist.destroy_process_group(self._async_group)
                self._async_group = None

    def _group(self) -> dist.ProcessGroup:
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any (a MAX all-reduce)."""
        if not _distributed():
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.runtime.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _agreed_token(self) -> str:
        """A random token drawn on rank 0 and broadcast: the same tmp folder on every rank."""
        value = secrets.randbits(62) if self.runtime.is_main else 0
        t = torch.tensor([value], dtype=torch.int64, device=self.runtime.device)
        dist.broadcast(t, src=0)
        return f"{int(t.item()):016x}"

    def _digests(self, folder: Path) -> dict[str, dict[str, Any]]:
        """Size and SHA-256 of each file this rank wrote into `folder`."""
        return {f.relative_to(folder).as_posix(): file_digest(f)
                for f in own_files(folder, self.runtime.rank, self.runtime.is_main)}

    def _commit(self, tmp: Path, final: Path, step: int, files: dict[str, dict[str, Any]] | None,
                error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
        """Agree that every rank wrote (and hashed) its files, then rank 0 writes COMMITTED
        with all digests, renames the folder and prunes; its outcome is broadcast, so every
        rank returns or every rank raises. Collective over `group`."""
        ok = error is None
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        mine = (ok, files if ok else None, None if ok else _dcp_cause(error), self._state_bytes,
                not ok and out_of_space(error))
        gathered: list[Any] = [None] * world if self.runtime.is_main else []
        if world > 1:
            dist.gather_object(mine, gathered if self.runtime.is_main else None, dst=0, group=group)
        else:
            gathered = [mine]
        outcome: str | None = None
        full: str | None = None
        if self.runtime.is_main:
            failed = [f"rank {r}: {why}" for r, (good, _, why, _, _) in enumerate(gathered) if not good]
            if failed and (any(g[4] for g in gathered) or nearly_full(self.dir)):
                full = self._disk_full_line(step, tmp, sum(g[3] for g in gathered))
            if failed:
                outcome = "writing failed on " + "; ".join(failed)
            else:
                try:
                    merged: dict[str, dict[str, Any]] = {}
                    for _, digests, _, _, _ in gathered:
                        merged.update(digests)
                    for name in folder_files(tmp):  # anything no rank claimed
                        if name not in merged:
                            merged[name] = file_digest(tmp / name)
                    self._write_committed(tmp, final, step, merged)
                except Exception as exc:
                    outcome = f"committing failed on rank 0: {short_error(exc)}"
                    if out_of_space(exc) or nearly_full(self.dir):
                        full = self._disk_full_line(step, tmp, sum(g[3] for g in gathered))
        box = [outcome, full]
        if world > 1:
            dist.broadcast_object_list(box, src=0, group=group)
        if box[1] is not None:  # rank 0 removed the partial folder
            raise DiskFullError(box[1]) from None
        if box[0] is not None:
            raise RuntimeError(f"checkpoint of step {step} failed ({box[0]}); "
                               f"{tmp} is left uncommitted") from error

    def _disk_full_line(self, step: int, tmp: Path, state_bytes: int) -> str:
        """Rank 0, after a save failed for want of space: remove the partial folder and say
        what was lost and what is intact."""
        shutil.rmtree(tmp, ignore_errors=True)
        free = free_bytes(self.dir)
        need = max(folder_bytes(self.latest()), state_bytes)
        latest = self.latest()
        kept = f"the last committed checkpoint {latest} is intact" if latest else "no checkpoint was committed before"
        return (f"checkpoint of step {step} could not be written: the disk holding {self.dir} is full "
                f"({human_bytes(free)} free, a checkpoint needs about {human_bytes(need)}); {kept}; the partial folder "
                f"{tmp.name} was removed (free space, or move run.dir to a larger disk, and run the same command "
                "to resume)")

    def _warn_if_short(self, step: int) -> None:
        """Rank 0, before a save: warn when the free space is less than the last checkpoint
        took (or the state's size), once per shortage."""
        if not self.runtime.is_main or self._warned_short:
            return
        latest = self.latest()
        need = folder_bytes(latest) if latest is not None else 0
        free = free_bytes(self.dir)
        if need and free is not None and free < need:
            self._warned_short = True
            log.warning("checkpoint of step %d may not fit: %s free in %s, the last checkpoint took %s",
                        step, human_bytes(free), self.dir, human_bytes(need))

    def _write_committed(self, tmp: Path, final: Path, step: int, files: dict[str, dict[str, Any]]) -> None:
        marker = {"step": step, "world_size": self.runtime.world_size, "files": dict(sorted(files.items()))}
        with open(tmp / COMMITTED, "w") as f:
            json.dump(marker, f, indent=1)
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

    # -- finding
    def _complete_steps(self) -> list[tuple[int, Path]]:
        return complete_steps(self.dir)

    def latest(self) -> Path | None:
        """The complete checkpoint of the highest step in this run, or None (structure
        only; `resolve_resume` also verifies the checksums)."""
        found = self._complete_steps()
        return found[-1][1] if found else None

    def _collective(self) -> bool:
        return self.runtime.world_size > 1 and _distributed()

    def _verify_agreed(self, path: Path) -> list[str]:
        """`verify_checkpoint` split over the ranks (file i by rank i % world); every rank
        gets the same problems, rank 0's first."""
        if not self._collective():
            return verify_checkpoint(path)
        mine = verify_checkpoint(path, ranks=(self.runtime.rank, self.runtime.world_size))
        everyone: list[Any] = [None] * self.runtime.world_size
        dist.all_gather_object(everyone, mine)
        return [problem for problems in everyone for problem in problems]

    def _rank0_value(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (itself without a process group)."""
        if not self._collective():
            return value
        box = [value if self.runtime.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def resolve_resume(self) -> Path | None:
        """Where to resume from, per `checkpoint.resume`. Collective when a process group
        exists (every rank returns the same path or raises the same error).

        never -> None. auto -> the newest complete checkpoint that passes
        `verify_checkpoint` (None in a fresh run); each damaged newer one is skipped with one
        warning on rank 0; ConfigError when checkpoints exist but none verifies. A path ->
        that folder if it is a complete checkpoint that verifies, else ConfigError naming it.
        """
        resume = self.cfg.resume
        if resume == "never":
            return None
        if resume == "auto":
            # rank 0's listing, so every rank walks the same candidates
            candidates = self._rank0_value([str(p) for _, p in reversed(self._complete_steps())])
            return self._first_intact(map(Path, candidates), self._verify_agreed, warn=self.runtime.is_main)
        path = Path(resume).expanduser()
        if is_complete(path):
            problems = self._verify_agreed(path)
            if not problems:
                return path
            _failed_verification(path, problems)
        hint = "use auto, never, or a folder like <run.dir>/checkpoints/step_00000100"
        inner = CheckpointManager(path, self.cfg, self.runtime).latest() if path.is_dir() else None
        if inner is not None:
            hint = f"did you mean {inner}?"
        raise ConfigError("checkpoint.resume", f"{resume!r} {incomplete_reason(path)}", hint)

    def check_resumable(self) -> Path | None:
        """Before launch, in the launching process (no process group): what
        `resolve_resume` will take, by the quick checks (structure, sizes, a `.metadata` the
        restricted unpickler reads; the ranks hash the files when they load). The same
        ConfigError as `resolve_resume` when no checkpoint passes: found before launch, no
        rank ever starts (every checkpoint damaged, or crafted, used to be found by the
        ranks, with DCP's tracebacks and the job's processes still ending seconds later)."""
        resume = self.cfg.resume
        if resume == "never":
            return None
        if resume == "auto":
            return self._first_intact((p for _, p in reversed(self._complete_steps())),
                                      lambda p: verify_checkpoint(p, digests=False), warn=False)
        path = Path(resume).expanduser()
        if is_complete(path):
            problems = verify_checkpoint(path, digests=False)
            if problems:
                _failed_verification(path, problems)
            return path
        return None

    def _first_intact(self, candidates, verify, warn: bool) -> Path | None:
        """The first of `candidates` (newest first) without problems by `verify`; with
        `warn`, a warning naming each damaged one skipped. None, or `_none_intact`'s
        ConfigError, when there is none."""
        damaged: list[tuple[str, str]] = []
        for candidate in candidates:
            problems = verify(candidate)
            if not problems:
                if warn:
                    for bad, problem in damaged:
                        log.warning("checkpoint %s is damaged (%s); resuming from %s instead", bad, problem, candidate)
                return candidate
            damaged.append((str(candidate), problems[0]))
        self._none_intact(damaged)
        return None

    def _none_intact(self, damaged: list[tuple[str, str]]) -> None:
        """ConfigError when every checkpoint of the run is damaged (`damaged`: newest
        first, (folder, its first problem))."""
        if damaged:
            bad, problem = damaged[0]
            raise ConfigError("checkpoint.resume",
                              f"no intact checkpoint in {self.dir}: {bad} is damaged ({problem})"
                              + (f", and so are the {len(damaged) - 1} older" if len(damaged) > 1 else ""),
                              "set checkpoint.resume=never to start over, or name a checkpoint folder")

    # -- pruning
    def prune(self) -> list[Path]:
        """Delete complete checkpoints beyond the `keep_last` newest (never the best one of
        `shardwise.checkpoint.best`, recorded in best.json with ``checkpoint.keep_best``),
        and the debris of interrupted saves (.tmp- folders, folders without COMMITTED) of
        steps up to the newest complete one, never the folder of an async save in flight.
        Acts on rank 0 only; returns what it deleted."""
        if not self.runtime.is_main:
            return []
        pending = self._pending  # its .tmp- folder is being written or committed
        complete = self._complete_steps()
        best_step = best.best_step(self.dir.parent) if self.cfg.keep_best else None
        doomed = [p for step, p in complete[:-self.cfg.keep_last] if step != best_step] \
            if len(complete) > self.cfg.keep_last else []
        if complete:
            newest = complete[-1][0]
            for p in self.dir.iterdir():
                m = _TMP_DIR.match(p.name) or STEP_DIR.match(p.name)
                if m and p.is_dir() and int(m.group(1)) <= newest and not is_complete(p) \
                        and (pending is None or p != pending.tmp):
                    doomed.append(p)
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return doomed

    # -- loading
    def load(self, engine: TrainEngine, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, `engine.step` and this rank's RNG from a
        complete checkpoint, at any world size or mesh (DCP reshards). Collective.

        Ranks for which the checkpoint has no RNG file (it was saved by fewer ranks) keep
        their generators. Returns the `extra` dict given to `save`. A file that cannot be
        read (meta.json, DCP's files, a missing or broken RNG file of a rank that saved one)
        is a one-line CheckpointError naming the folder, on every rank.
        """
        self.wait()
        path = Path(path)
        if not is_complete(path):
            raise ConfigError("checkpoint.resume", f"{str(path)!r} {incomplete_reason(path)}")
        problem, meta, rng = None, None, None
        try:
            meta = _read_meta_checked(path)
            bad_metadata = metadata_problem(path)
            if bad_metadata is not None:
                raise CheckpointError(f"checkpoint {path}: {bad_metadata}")
            saved_world = meta.get("world_size")
            rng = read_rng(path, self.runtime.rank, int(saved_world) if saved_world is not None else None)
        except CheckpointError as exc:
            problem = str(exc)
        if self._collective():  # a rank missing its RNG file fails every rank, not just itself
            problems: list[Any] = [None] * self.runtime.world_size
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise CheckpointError(problem)
        assert meta is not None
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=_options(engine))
        app_state = {"model": model_sd, "optimizer": optim_sd}
        try:
            dcp.load(app_state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as exc:  # DCP gathers every rank's errors: all ranks get here
            raise CheckpointError(f"checkpoint {path} cannot be loaded ({_dcp_cause(exc)})") from None
        set_state_dict(engine.model, engine.optimizer,
                       model_state_dict=app_state["model"], optim_state_dict=app_state["optimizer"],
                       options=_options(engine))
        engine.scheduler.load_state_dict(meta["scheduler"])
        apply_optimizer_settings(engine)
        engine.step = int(meta["step"])
        if rng is not None:
            apply_rng(*rng, self.runtime.device)
        if self.runtime.is_main:
            log.info("resumed from %s (step %d, saved by %d ranks, loaded by %d)", path,
                     engine.step, meta["world_size"], self.runtime.world_size)
        return meta["extra"]


def _failed_verification(path: Path, problems: list[str]) -> None:
    raise ConfigError("checkpoint.resume", f"{path} failed verification: {problems[0]}",
                      "resume from another checkpoint folder, or use auto to take the newest one that verifies")


def _local_bytes(state: Any) -> int:
    """Bytes of the tensors of this rank's share of a state dict (what it writes)."""
    total, stack = 0, [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if isinstance(item, DTensor) else item
            total += local.numel() * local.element_size()
    return total


def _options(engine: TrainEngine) -> StateDictOptions:
    """A LoRA run's checkpoint holds the trainable parameters (adapters, modules to save)
    and their optimizer state only: the frozen base is `model.path`'s, read again on resume
    (a 7B adapter checkpoint is megabytes)."""
    lora = engine.cfg.model.lora.enabled
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _dcp_cause(exc: BaseException) -> str:
    """The first underlying error of a DCP failure, in one line. DCP wraps the errors of
    the ranks in a CheckpointException whose `failures` maps rank -> (error, traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return f"rank {rank}: {short_error(inner)}"
    return short_error(exc)


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
