"""A job on torchrun's ranks (`shardwise train`, `shardwise infer`): the launching side and
the rank side of one command.

The launching `shardwise` (``--nproc`` N, with ``--nnodes`` this node's ranks of a
multi-node job) runs the job's ``prepare`` (every input error exits 2 here, before any
process starts), prints the capacity line, takes the run folder's lock and starts N ranks
through torchrun (`shardwise.distributed.launch`), each running the same command; when
they are gone it prints one line for how the job ended: interrupted, a rank's failure
(after a full disk: the free space, the partial checkpoint folders removed; a bug's
traceback kept in the run folder), torchrun's own exit, each with the last committed
checkpoint. A rank (or a process alone) runs ``prepare``, then ``run`` with what it built,
and rank 0 prints the summary.

Here rather than in `shardwise.distributed`, which starts the processes: the loop runs a
job's recipe (`shardwise.jobs`), holds the run folder's lock (`shardwise.jobs.rundir`) and
names checkpoints (`shardwise.checkpoint`, and the critic's folder of `shardwise.rl`),
all layers above `distributed`.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch.distributed as dist

from shardwise.checkpoint.dcp import CHECKPOINTS_DIR, resume_line
from shardwise.config.schema import Config
from shardwise.distributed import launch, torchrun
from shardwise.distributed.capacity import check_plan
from shardwise.distributed.nodes import Nodes, ranks_per_node
from shardwise.distributed.runtime import Runtime, init_distributed, seed_everything, teardown
from shardwise.errors import EXIT_DISK_FULL, ConfigError
from shardwise.jobs.rundir import RunDirLock, check_run_dir, command_line, write_error_file
from shardwise.rl.workers.hybrid import CRITIC_DIR

__all__ = ["run_job"]


def run_job(job: ModuleType, cfg: Config, report: Callable[[Config, dict], None], *, nproc: int | None,
            config_ranks: int | None, nodes: Nodes | None, argv: Sequence[str]) -> int:
    """Run `job` (a recipe of `shardwise.jobs`: ``prepare(cfg, world_size=...)``, ``run(prepared,
    runtime)``) and return the exit status. With ranks to start (`nproc`, else the
    `config_ranks` of a dialect's file; `nodes`: the other nodes of a multi-node job) and
    outside torchrun, this process launches them, each running ``shardwise <argv>``;
    otherwise (a rank under torchrun, or a process alone) it runs the job here, and rank 0
    prints `report(cfg, summary)`."""
    check_run_dir(cfg.run.dir)  # also for a run in this process
    nproc = ranks_per_node(nproc, config_ranks, nodes)
    if nproc and not launch.under_torchrun():
        return _launch(job, cfg, nproc, nodes, argv)
    if launch.under_torchrun():
        launch.die_with_parent()
        launch.record_activity()
    prepared = job.prepare(cfg)
    runtime = init_distributed()
    lock = RunDirLock(cfg.run.dir, command_line())
    ok = False
    try:
        _lock_on_rank0(lock, runtime)
        seed_everything(cfg.run.seed)
        summary = job.run(prepared, runtime)
        if runtime.is_main:
            report(cfg, summary)
        ok = True
    finally:
        lock.release()
        teardown(graceful=ok)
    return 0


def _launch(job: ModuleType, cfg: Config, nproc: int, nodes: Nodes | None, argv: Sequence[str]) -> int:
    """The launching side: prepare, start the ranks, say how they ended."""
    job_key = nodes.job if nodes else None
    RunDirLock(cfg.run.dir, command_line(), job_key).check_free()
    zygote = launch.Zygote.fork(nodes, torchrun.become)  # before the checks: nothing of the job has run yet
    try:
        planned = job.prepare(cfg, world_size=nproc * (nodes.count if nodes else 1)).planned
        print(check_plan(nproc, planned and planned[1], cfg.fsdp.offload.enabled).line(), file=sys.stderr)
        with RunDirLock(cfg.run.dir, command_line(), job_key) as lock:
            res = launch.launch_torchrun(nproc, argv, env=lock.child_env(), nodes=nodes, zygote=zygote)
    finally:
        if zygote is not None:
            zygote.close()
    words = getattr(job, "resume_words", None)  # a job without checkpoints (infer) says what it keeps
    line = res.line(lambda: words(cfg) if words is not None else resume_line(cfg.run.dir))
    if line is None:
        return 0
    failure = res.failure if res.interrupted is None else None
    if failure is not None and failure.user and failure.exit_status == EXIT_DISK_FULL:
        line = _disk_full_line(cfg.run.dir, line)
    elif failure is not None and not failure.user:  # a bug: its traceback is kept (a user's error is its line)
        where = f"rank {failure.rank}" + (f" on node {failure.node}" if failure.node is not None else "")
        kept = write_error_file(cfg.run.dir, where, failure.traceback)
        if kept is not None:
            line += f" (traceback in {kept})"
    # The line starts on a line of its own: rank 0's progress bar may hold the last one.
    print(f"\nshardwise: {line}", file=sys.stderr)
    if launch.debug_enabled() and failure is not None and not failure.user:
        print(failure.traceback, file=sys.stderr, end="")
    return res.exit_status


def _disk_full_line(run_dir: str, line: str) -> str:
    """After the ranks of a job stopped on a full disk: the partial checkpoint folders are
    removed (no save is in flight any more), and a line that does not come from the
    checkpoint itself gets the free space and the last committed checkpoint."""
    removed = []
    for folder in (Path(run_dir) / CHECKPOINTS_DIR, Path(run_dir) / CRITIC_DIR / CHECKPOINTS_DIR):
        for p in sorted(folder.glob("*.tmp-*")) if folder.is_dir() else []:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if "checkpoint of step" in line or line.startswith(("HF export to ", "evaluation samples ")):  # it says both already
        return line
    free = shutil.disk_usage(run_dir).free if Path(run_dir).is_dir() else None
    extra = [f"{free / 2**20:.1f} MiB free in {run_dir}" if free is not None else None,
             resume_line(run_dir),
             f"partial checkpoint folder {', '.join(removed)} removed" if removed else None]
    return "; ".join([line, *(e for e in extra if e)])


def _lock_on_rank0(lock: RunDirLock, runtime: Runtime) -> None:
    """Rank 0 takes the run folder's lock (unless the launching `shardwise` holds it); every
    rank raises the same ConfigError when another job holds it."""
    problem: list[ConfigError | None] = [None]
    if runtime.is_main:
        try:
            lock.acquire()
        except ConfigError as e:
            problem[0] = e
    if runtime.world_size > 1:
        dist.broadcast_object_list(problem, src=0)  # None or the error, from our own rank 0
    if problem[0] is not None:
        raise problem[0]
