"""The `shardwise` command: plan | train | infer | rl | export | convert | data | config.

Each command is a recipe of `shardwise.jobs`: ``prepare`` (every check the config and its
files allow; exit status 2 and one line on stderr, before any process group, Ray worker or
file of the run exists) and ``run``. The CLI parses arguments, takes the run folder's
lock, launches torchrun for ``--nproc`` (`shardwise.distributed.launch`; with ``--nnodes``
this node's ranks of a multi-node job) and prints the summary; the `Prepared` object goes on
to ``run`` in the same process.

``--dialect roll|mindspeed|rlinf`` reads CONFIG as another system's config
(`shardwise.config.dialects`): converted first, then the overrides; a device count in it
is the default of ``--nproc`` / ``--world-size``. ``convert`` writes the converted YAML.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch.distributed as dist

from shardwise.checkpoint.dcp import CHECKPOINTS_DIR, CheckpointManager
from shardwise.config import describe, load_config
from shardwise.config.dialects import DIALECTS, check_out_file, load_dialect_config, read_dialect
from shardwise.config.schema import CheckpointConfig, Config
from shardwise.config.validate import check_rl_rows, check_sft_batch, mesh_spec
from shardwise.distributed import launch
from shardwise.distributed.capacity import check_nproc, check_plan
from shardwise.distributed.runtime import (
    Runtime,
    env_world,
    init_distributed,
    seed_everything,
    teardown,
)
from shardwise.errors import EXIT_DISK_FULL, ConfigError, ShardwiseError, as_disk_full
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.comm import step_comm
from shardwise.fsdp.projection import load_hardware, profiles, project
from shardwise.jobs import export, infer, preview, rl, sft
from shardwise.jobs.rundir import RunDirLock, check_run_dir, command_line, write_error_file
from shardwise.jobs.supervisor import record_run_dir, record_said, supervise
from shardwise.models.loading import local_files_only
from shardwise.rl.cluster import WorkerError, shutdown_ray
from shardwise.rl.workers.hybrid import CRITIC_DIR

EXIT_USER_ERROR = launch.EXIT_USER_ERROR


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_plan(plan) -> str:
    """The plan as a readable table."""
    m = plan.mesh
    lines = [
        f"world size {plan.world_size}  mesh {dict(zip(m.dim_names, m.shape))}  "
        f"strategy {m.strategy}  data-parallel {m.dp_size}  master dtype {plan.model_dtype}",
        "",
    ]
    head = ["#", "unit", "from", "param", "reduce", "output", "cast in", "store", "reshard", "offload", "recompute",
            "prefetch fwd/bwd", "params", "trainable"]
    rows = []
    for i, u in enumerate(plan.units):
        rows.append([
            str(i), u.path or "<root>", ",".join(u.sources), u.param_dtype, u.reduce_dtype,
            u.output_dtype or "-", "yes" if u.cast_forward_inputs else "no", u.storage_dtype, str(u.reshard_after_forward).lower(),
            "cpu" if u.offload else "-", "yes" if u.recompute else "-",
            f"{len(u.prefetch_forward)}/{len(u.prefetch_backward)}", f"{u.num_params:,}",
            f"{u.trainable_params:,}" if u.trainable_params else "-",
        ])
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*head))
    lines.append(fmt.format(*["-" * w for w in widths]))
    lines += [fmt.format(*r) for r in rows]
    extra = []
    if plan.ignored:
        extra.append("ignored (not sharded): " + ", ".join(plan.ignored))
    recompute_only = [p for p in plan.recompute if p not in {u.path for u in plan.units}]
    if recompute_only:
        extra.append("recompute (inside units): " + ", ".join(recompute_only))
    if plan.tiled_mlp:
        extra.append(f"tiled MLP ({plan.tiled_mlp_shards} slices of the sequence): " + ", ".join(plan.tiled_mlp))
    if plan.compiled:
        extra.append("compiled (torch.compile, one per unit): " + ", ".join(plan.compiled))
    if plan.buffer_casts:
        extra.append("layered precision: " + ", ".join(f"{p}={d}" for p, d in plan.buffer_casts.items()))
    if plan.frozen:
        extra.append(f"frozen parameters: {len(plan.frozen)}"
                     + (f" ({', '.join(plan.frozen[:3])}{', ...' if len(plan.frozen) > 3 else ''})"))
    if extra:
        lines += [""] + extra
    peak = {k: max(r[k] for r in plan.memory_per_rank_bytes) for k in plan.memory_per_rank_bytes[0]}
    lines += ["", "per-rank memory (largest rank; params + grads + AdamW state): "
              + "  ".join(f"{k} {_human_bytes(v)}" for k, v in peak.items())]
    if plan.lora is not None:
        lo = plan.lora
        with_, without = peak["total"], max(r["total"] for r in lo.memory_per_rank_bytes_without_lora)
        change = f"saves {1 - with_ / without:.0%}" if with_ <= without else f"adds {with_ / without - 1:.0%}"
        lines.append(f"LoRA (r={lo.r}, {len(lo.targets)} adapters on {len(lo.units)} units): trainable "
                     f"{lo.trainable_params:,} of {lo.total_params:,} parameters "
                     f"({lo.trainable_params / lo.total_params:.1%}); per-rank memory with LoRA "
                     f"{_human_bytes(with_)} vs {_human_bytes(without)} without ({change})")
    if plan.comm is not None:
        lines += _comm_lines(plan)
    for note in plan.warnings:
        lines.append(f"note: {note}")
    return "\n".join(lines)


_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A"}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _comm_lines(plan) -> list[str]:
    """Per unit: MiB each rank moves per optimizer step by collective, what it sends, and
    which collectives cross nodes."""
    c = plan.comm
    head = ["unit", "AG MiB", "RS MiB", "AR MiB", "A2A MiB", "sent MiB", "network"]
    rows = []
    for uc in c.units:
        by = uc.bytes_by_kind()
        inter = sorted({_SHORT[x.kind] + {"forward": " fwd", "backward": " bwd"}.get(x.phase, "")
                        if x.kind == "all_gather" else _SHORT[x.kind] for x in uc.collectives if x.inter_node})
        net = "-" if not uc.collectives else ("inside nodes" if not inter else "between nodes: " + ", ".join(inter))
        rows.append([uc.path or "<root>", *[_mib(by[k]) for k in _SHORT], _mib(uc.wire_bytes()), net])
    total = c.bytes_per_step()
    rows.append(["total", *[_mib(total[k]) for k in _SHORT], _mib(sum(c.wire_bytes_per_step().values())), ""])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(("{:<%d}" if i in (0, 6) else "{:>%d}") % w for i, w in enumerate(widths))
    return ["", f"communication per optimizer step, per rank ({c.accumulation} micro-batch(es) of "
            f"{c.micro_batch_size} x {c.seq_len} tokens; {c.gpus_per_node} GPUs per node; buffer sizes, "
            "sent = ring wire bytes):",
            fmt.format(*head), fmt.format(*["-" * w for w in widths]), *[fmt.format(*r) for r in rows]]


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def format_projection(proj, hw) -> str:
    """The projected step in two lines."""
    fits = "fits" if proj.fits else "does NOT fit"
    return (f"projected on {hw.name} ({hw.description}), MFU {proj.mfu:.3f}: "
            f"{proj.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, step {_seconds(proj.step_s)} "
            f"(compute {_seconds(proj.compute_s)}, exposed communication {_seconds(proj.exposed_comm_s)}, "
            f"optimizer {_seconds(proj.optimizer_s)}; all communication {_seconds(proj.comm_s)})\n"
            f"memory per rank {_human_bytes(proj.memory_bytes)} (activations {_human_bytes(proj.activation_bytes)}) "
            f"of {_human_bytes(int(hw.memory_bytes))}: {fits}")


def _load(args: argparse.Namespace) -> tuple[Config, int | None]:
    """The command's config, and the rank count its file names (a dialect's device list)."""
    if args.dialect is None:
        return load_config(args.config, args.overrides), None
    cfg, conv = load_dialect_config(args.config, args.dialect, args.overrides)
    if not _under_torchrun():  # said once, by the launching process
        for note in conv.notes:
            print(f"shardwise: note: not converted: {note}", file=sys.stderr)
    return cfg, conv.world_size


def cmd_plan(args: argparse.Namespace) -> int:
    local_files_only()
    cfg, ranks = _load(args)
    hw = load_hardware(args.hardware) if args.hardware is not None else None
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError("--mfu", f"{args.mfu} is not a fraction in (0, 1]", "e.g. --mfu 0.35")
    if (args.mfu is not None or args.scan is not None) and hw is None:
        raise ConfigError("--hardware", "--mfu and --scan project a step time and need a hardware profile",
                          f"add --hardware {' | '.join(profiles())} or a profile file")
    gpus_per_node = args.gpus_per_node if args.gpus_per_node is not None else hw.gpus_per_node if hw else 8
    if gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"{gpus_per_node} is not a positive number of GPUs", "e.g. 8")
    if args.scan is not None:
        return _plan_scan(args, cfg, hw, gpus_per_node)
    world = args.world_size if args.world_size is not None else ranks or env_world()[1]
    model, plan, projection = _plan_at(args, cfg, world, hw, gpus_per_node)
    if args.json:
        out = plan.to_json()
        if projection is not None:
            out["projection"] = projection.to_json()
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan))
        if projection is not None:
            print("\n" + format_projection(projection, hw))
        if args.rl and cfg.model.lora.enabled and cfg.rl.reference.enabled:
            print("rl: the reference policy is the actor with its LoRA adapters disabled (no reference model "
                  "in memory)")
    return 0


def _plan_at(args: argparse.Namespace, cfg: Config, world: int, hw, gpus_per_node: int,
             accumulation: int | None = None):
    """(meta model, plan with its step's communication, projection or None) at `world`
    ranks. `accumulation`: micro-batches per step to keep (a --scan keeps each rank's
    step), instead of the config's global batch."""
    spec = mesh_spec(cfg.parallel, world)
    if hw is not None and world > gpus_per_node and world % gpus_per_node:
        raise ConfigError("--world-size", f"{world} ranks do not fill whole nodes of {gpus_per_node} GPUs",
                          f"use a multiple of {gpus_per_node}, or set --gpus-per-node")
    if args.rl:  # an RL config: global_batch_size counts prompts, micro_batch_size rows per forward
        check_rl_rows(cfg, spec.dp_size)
    elif accumulation is None:
        accumulation = check_sft_batch(cfg.train, spec.dp_size)
    model, plan = plan_for(cfg, spec, cfg.model.task)
    if args.rl:  # an RL step's micro-batches follow its rollouts: no step shape to count
        if hw is not None:
            raise ConfigError("--hardware", "the step-time projection covers SFT configs, not --rl ones")
        return model, plan, None
    plan.comm = step_comm(model, plan, spec, accumulation=accumulation, micro_batch_size=cfg.train.micro_batch_size,
                          max_length=cfg.data.max_length, gpus_per_node=gpus_per_node)
    return model, plan, (project(model, plan, plan.comm, hw, args.mfu) if hw is not None else None)


def _scan_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise ConfigError("--scan", f"{text!r} is not a comma-separated list of world sizes", "e.g. --scan 8,64,512")
    return sizes


def _plan_scan(args: argparse.Namespace, cfg: Config, hw, gpus_per_node: int) -> int:
    """One projected row per world size; each rank keeps the step of the first size
    (micro-batches per step), so the global batch grows with the data-parallel size."""
    sizes = _scan_sizes(args.scan)
    accumulation = check_sft_batch(cfg.train, mesh_spec(cfg.parallel, sizes[0]).dp_size)
    rows = []
    for world in sizes:
        _, plan, proj = _plan_at(args, cfg, world, hw, gpus_per_node, accumulation)
        rows.append((world, plan, proj))
    if args.json:
        print(json.dumps({"hardware": hw.name, "scan": [
            {"world_size": w, "mesh": p.mesh.to_json(), "comm_bytes_per_step": p.comm.bytes_per_step(),
             "projection": pr.to_json()} for w, p, pr in rows]}, indent=2))
        return 0
    head = ["world", "mesh", "tokens/s/GPU", "step", "compute", "exposed comm", "comm MiB/rank",
            "memory/rank", "fits"]
    table = [[str(w), "x".join(map(str, p.mesh.shape)), f"{pr.tokens_per_s_per_gpu:,.0f}", _seconds(pr.step_s),
              _seconds(pr.compute_s), _seconds(pr.exposed_comm_s), _mib(sum(p.comm.bytes_per_step().values())),
              _human_bytes(pr.memory_bytes), "yes" if pr.fits else "NO"] for w, p, pr in rows]
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    mfu = rows[0][2].mfu
    print(f"projected on {hw.name} ({hw.description}); MFU {mfu:.3f}; {accumulation} micro-batch(es) of "
          f"{cfg.train.micro_batch_size} x {rows[0][1].comm.seq_len} tokens per rank and step")
    print(fmt.format(*head))
    print(fmt.format(*["-" * w for w in widths]))
    for r in table:
        print(fmt.format(*r))
    return 0


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _last_checkpoint_line(cfg: Config) -> str:
    """Where a stopped run can resume from, in words."""
    return _checkpoint_line_at(cfg.run.dir)


def _checkpoint_line_at(run_dir: str) -> str:
    latest = CheckpointManager(run_dir, CheckpointConfig(), None).latest()
    if latest is None:
        return "no checkpoint was committed yet"
    return f"the last committed checkpoint is {latest} (the same command resumes from it)"


def _disk_full_line(cfg: Config, line: str) -> str:
    """After the ranks of a job stopped on a full disk: the partial checkpoint folders are
    removed (no save is in flight any more), and a line that does not come from the
    checkpoint itself gets the free space and the last committed checkpoint."""
    removed = []
    for folder in (Path(cfg.run.dir) / CHECKPOINTS_DIR, Path(cfg.run.dir) / CRITIC_DIR / CHECKPOINTS_DIR):
        for p in sorted(folder.glob("*.tmp-*")) if folder.is_dir() else []:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if "checkpoint of step" in line or line.startswith("HF export to "):  # it says both already
        return line
    free = shutil.disk_usage(cfg.run.dir).free if Path(cfg.run.dir).is_dir() else None
    extra = [f"{free / 2**20:.1f} MiB free in {cfg.run.dir}" if free is not None else None,
             _last_checkpoint_line(cfg),
             f"partial checkpoint folder {', '.join(removed)} removed" if removed else None]
    return "; ".join([line, *(e for e in extra if e)])


def _torchrun_job(args: argparse.Namespace, job, report: Callable[[Config, dict], None]) -> int:
    """A job's `prepare` (input errors exit 2 here, before any process starts), then
    `--nproc` processes through torchrun (this node's, with ``--nnodes``), or this process
    under an outer torchrun (or alone): `run` on every rank with what `prepare` built,
    `report` on rank 0."""
    check_nproc(args.nproc)
    nodes = launch.nodes_from_args(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                                   args.rdzv_endpoint, args.rdzv_timeout)
    local_files_only()
    cfg, ranks = _load(args)
    check_run_dir(cfg.run.dir)  # also for a run in this process
    nproc = _ranks_per_node(args.nproc, ranks, nodes)
    if nproc and not _under_torchrun():
        job_key = nodes.job if nodes else None
        RunDirLock(cfg.run.dir, command_line(), job_key).check_free()
        planned = job.prepare(cfg, world_size=nproc * (nodes.count if nodes else 1)).planned
        print(check_plan(nproc, planned and planned[1], cfg.fsdp.offload.enabled).line(), file=sys.stderr)
        dialect = ["--dialect", args.dialect] if args.dialect else []
        with RunDirLock(cfg.run.dir, command_line(), job_key) as lock:
            res = launch.launch_torchrun(nproc, [args.command, args.config, *dialect, *args.overrides],
                                         env=lock.child_env(), nodes=nodes)
        # Messages start on a line of their own: rank 0's progress bar may hold the last one.
        if res.interrupted is not None:
            print(f"\nshardwise: interrupted by {res.interrupted.name}; {_last_checkpoint_line(cfg)}", file=sys.stderr)
            return launch.EXIT_INTERRUPTED.get(res.interrupted, 1)
        if res.failure is not None:
            line = res.failure.line()
            if res.failure.user and res.failure.exit_status == EXIT_DISK_FULL:
                line = _disk_full_line(cfg, line)
            elif not res.failure.user:  # a bug: its traceback is kept (a user's error is its line)
                where = f"rank {res.failure.rank}" + (f" on node {res.failure.node}" if res.failure.node is not None
                                                       else "")
                kept = write_error_file(cfg.run.dir, where, res.failure.traceback)
                if kept is not None:
                    line += f" (traceback in {kept})"
            print(f"\nshardwise: {line}", file=sys.stderr)
            if launch.debug_enabled() and not res.failure.user:
                print(res.failure.traceback, file=sys.stderr, end="")
            return res.failure.exit_status if res.failure.user else (res.returncode or 1)
        if res.returncode != 0:
            print(f"\nshardwise: torchrun {launch.describe_exit(res.returncode)}; {_last_checkpoint_line(cfg)}",
                  file=sys.stderr)
            return res.returncode if res.returncode > 0 else 128 - res.returncode
        return 0
    if _under_torchrun():
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


def _ranks_per_node(nproc: int | None, dialect_ranks: int | None, nodes: launch.Nodes | None) -> int | None:
    """``--nproc``; without it, a dialect config's device count (over all nodes)."""
    if nodes is None or nproc is not None:
        return nproc or dialect_ranks
    if dialect_ranks and dialect_ranks % nodes.count == 0:
        return dialect_ranks // nodes.count
    raise ConfigError("--nproc", f"is needed with --nnodes {nodes.count}: the number of ranks on each node",
                      "e.g. --nproc 8 on a node of 8 GPUs")


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


def _print_paths(summary: dict, keys: Sequence[str]) -> None:
    for key in keys:
        if summary.get(key):
            print(f"  {key:<10} {summary[key]}")


def _report_train(cfg: Config, summary: dict) -> None:
    final = summary["final"]
    print(f"done: {summary['steps']} steps, final loss {final.get('loss', float('nan')):.4f}")
    if "accuracy" in summary:
        print(f"  held-out accuracy (greedy): {summary['accuracy']:.1%}")
    _print_paths(summary, ("metrics", "checkpoint", "adapter", "hf", "plot"))


def _report_infer(cfg: Config, s: dict) -> None:
    mode = "greedy" if s["greedy"] else f"temperature {cfg.infer.temperature}, top_p {cfg.infer.top_p}"
    print(f"done: {s['prompts']} prompts x {s['samples_per_prompt']} ({mode}), {s['world_size']} ranks")
    if "accuracy" in s:
        print(f"  accuracy ({s['reward']}): {s['accuracy']:.1%}")
    elif "score_mean" in s:
        print(f"  mean score ({s['reward']}): {s['score_mean']:.4f}")
    print(f"  response length {s['response_length_mean']:.1f} tokens (mean), "
          f"{s['ended_with_eos']:.0%} ended with eos; {s['tokens_per_s']:.0f} tokens/s over {s['seconds']:.1f} s")
    _print_paths(s, ("output", "summary"))


def _report_rl(cfg: Config, summary: dict) -> None:
    last = summary["history"][-1] if summary.get("history") else {}
    print(f"done: {summary['steps']} {cfg.rl.algorithm} steps"
          + (f", final reward {last['reward/mean']:.3f}" if last else ""))
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if before is not None and after is not None:
        start = summary.get("resumed_from_step")
        label = "before RL" if not start else f"at step {start} (resumed)"
        print(f"  held-out accuracy (greedy): {label} {before:.1%}, after RL {after:.1%}")
        sb, sa = summary.get("sampled_before"), summary.get("sampled_after")
        if sb and sa:
            print(f"  held-out sampled (T={cfg.rl.rollout.temperature:g}): "
                  + ", ".join(f"{k} {sb[k]:.1%} -> {sa[k]:.1%}" for k in sb))
    timing = summary.get("timing") or {}
    if timing.get("time/step"):
        step_s = timing["time/step"]
        phases = {k[5:]: v for k, v in timing.items() if k != "time/step"}
        print(f"  seconds per step {step_s:.2f} (mean; "
              + ", ".join(f"{k} {v / step_s:.0%}" for k, v in phases.items()) + ")")
    _print_paths(summary, ("metrics", "checkpoint", "adapter", "hf", "plot"))


def cmd_train(args: argparse.Namespace) -> int:
    """Supervised fine-tuning; see shardwise.jobs.sft."""
    return _torchrun_job(args, sft, _report_train)


def cmd_infer(args: argparse.Namespace) -> int:
    """Generation with the FSDP2 infer engine; see shardwise.jobs.infer."""
    return _torchrun_job(args, infer, _report_infer)


def cmd_rl(args: argparse.Namespace) -> int:
    """RL post-training: this process is the single controller; `--nproc` Ray workers
    (default 1) form the FSDP process group. See shardwise.jobs.rl."""
    check_nproc(args.nproc)
    local_files_only()
    cfg, ranks = _load(args)
    nproc = args.nproc or ranks or 1
    check_run_dir(cfg.run.dir)
    RunDirLock(cfg.run.dir, command_line()).check_free()
    record_run_dir(cfg.run.dir)  # for a supervising parent's line, should this process end abruptly
    prepared = rl.prepare(cfg, nproc)  # input errors exit 2 here, before Ray starts
    print(check_plan(nproc, prepared.plan, cfg.fsdp.offload.enabled).line(), file=sys.stderr)
    interrupts: list[str] = []
    with RunDirLock(cfg.run.dir, command_line()), _signals_as_interrupt(interrupts), _ray_stopped(interrupts):
        try:
            summary = rl.run(prepared)
        except KeyboardInterrupt:
            sig = interrupts[-1] if interrupts else "SIGINT"
            status = 143 if sig == "SIGTERM" else 130
            print(f"\nshardwise: interrupted by {sig}; {_last_checkpoint_line(cfg)}", file=sys.stderr, flush=True)
            record_said(status)  # a signal during Ray's shutdown below ends it with this status, no other line
            return status
        except Exception as e:
            if not isinstance(e, ShardwiseError):  # a bug or a worker's: its traceback is kept
                e.error_file = write_error_file(cfg.run.dir, "the controller" if not isinstance(e, WorkerError)
                                                else "a worker", "".join(traceback.format_exception(e)))
            if isinstance(e, WorkerError):  # a worker failed or was lost with its node: where to resume from
                resume = WorkerError(f"{e}; {_last_checkpoint_line(cfg)}")
                resume.error_file = e.error_file
                raise resume from e
            raise
    _report_rl(cfg, summary)
    return 0


@contextlib.contextmanager
def _ray_stopped(interrupts: list[str]) -> Iterator[None]:
    """Ray is stopped on the way out of the block however it ends (`shutdown_ray`: more
    signals during the shutdown do not interrupt it, a third kills what is left; after an
    interrupt, signals until the process ends only say it is ending)."""
    try:
        yield
    finally:
        shutdown_ray(restore_signals=not interrupts)


@contextlib.contextmanager
def _signals_as_interrupt(seen: list[str]) -> Iterator[None]:
    """SIGTERM ends the controller like Ctrl-C: the worker groups are stopped on the way out.
    The names of the signals received are appended to `seen`."""
    def handler(signum, _frame):
        seen.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            if not seen:
                signal.signal(sig, h)
            elif signal.getsignal(sig) is handler:  # interrupted and ending: more signals change nothing
                signal.signal(sig, signal.SIG_IGN)


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint folder as an HF folder; see shardwise.jobs.export."""
    local_files_only()
    out = export.run(export.prepare(args.checkpoint_dir, args.out_dir, merged=args.merged, force=args.force))
    print(f"exported {args.checkpoint_dir} -> {out}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Another system's config as a shardwise YAML; see shardwise.config.dialects."""
    if args.out is not None:
        check_out_file(args.out, args.file)
    conv = read_dialect(args.file, args.dialect)
    text = conv.to_yaml()
    for note in conv.notes:
        print(f"shardwise: note: not converted: {note}", file=sys.stderr)
    if args.out is None:
        print(text, end="")
    else:
        try:
            with open(args.out, "w") as f:
                f.write(text)
        except OSError as e:
            raise ConfigError("--out", f"{args.out!r} cannot be written: {e.strerror or e}") from None
        print(f"converted {args.file} ({args.dialect}) -> {args.out}", file=sys.stderr)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """The first examples (or prompts) of a config's data as its job feeds them; see
    shardwise.jobs.preview."""
    local_files_only()
    cfg, _ = _load(args)
    shown, tokenizer, total = preview.preview(cfg, args.n, args.prompts)
    if args.json:
        print(preview.format_json(shown, tokenizer))
    else:
        print(preview.format_text(shown, tokenizer, cfg.data.max_length, total))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """The resolved config, each value with its origin (default, file, dialect, override),
    or with --defaults every key with its type, default and doc; see
    shardwise.config.describe."""
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not os.path.exists(path):  # overrides alone, no file
        path, overrides = None, [path, *overrides]
    if path is None and not overrides and not args.defaults:
        raise ConfigError("CONFIG", "name the config file to resolve",
                          "or --defaults: every key with its type, default and doc")
    resolved = None
    if path is not None or overrides or args.dialect is not None:
        resolved = describe.resolve(path, overrides, args.dialect)
        for note in resolved.notes:
            print(f"shardwise: note: not converted: {note}", file=sys.stderr)
    keep = describe.keys_under(args.only) if args.only is not None else None
    if args.defaults:
        table = {k: v for k, v in describe.defaults(resolved).items() if keep is None or k in keep}
        print(json.dumps(table, indent=2) if args.json else describe.format_defaults(table))
        return 0
    if keep is not None:
        resolved.entries = [e for e in resolved.entries if e.key in keep]
    print(json.dumps(resolved.to_json(), indent=2) if args.json else describe.format_resolved(resolved))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": cmd_plan, "train": cmd_train, "infer": cmd_infer, "rl": cmd_rl, "export": cmd_export,
    "convert": cmd_convert, "data": cmd_data, "config": cmd_config}


NODES_EPILOG = """several machines: on each of N nodes of K ranks,
  shardwise train CONFIG --nproc K --nnodes N --node-rank I --master-addr NODE0 --master-port PORT
(or --rdzv-endpoint HOST:PORT instead of the last three). A rank that fails ends the job on
every node; run.dir is locked once per job (its nodes share it by naming the same rendezvous).
parallel.fsdp_size=K shards within nodes and replicates across them (HSDP)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="print full tracebacks (of every rank and worker) instead of one line per error")
    dialect = argparse.ArgumentParser(add_help=False)
    dialect.add_argument("--dialect", choices=DIALECTS, default=None,
                         help="CONFIG is a ROLL, MindSpeed or RLinf config: converted first, then the overrides "
                              "(see `shardwise convert`)")
    nodes = argparse.ArgumentParser(add_help=False)
    g = nodes.add_argument_group("several machines", "the same command on every node (see the end of this help)")
    g.add_argument("--nnodes", type=int, default=None, help="number of nodes (machines) of the job (default 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank in [0, nnodes); node 0 hosts the "
                   "rendezvous at --master-addr")
    g.add_argument("--master-addr", default=None, help="address of node 0, where the nodes meet (static rendezvous)")
    g.add_argument("--master-port", type=int, default=None, help=f"its port (default {launch.MASTER_PORT})")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of a c10d rendezvous instead (nodes are "
                   "numbered as they arrive; --node-rank is not needed)")
    g.add_argument("--rdzv-timeout", type=int, default=None, help="seconds a node waits for the others at the "
                   f"rendezvous before the job fails (default {launch.RDZV_TIMEOUT_S})")
    sp = sub.add_parser("plan", parents=[common, dialect], help="print the sharding plan of a config (no process group, no weights)")
    sp.add_argument("config")
    sp.add_argument("overrides", nargs="*", help="key.sub=value")
    sp.add_argument("--world-size", type=int, default=None)
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--rl", action="store_true", help="CONFIG is for `shardwise rl` (its batch rules: "
                    "global_batch_size counts prompts)")
    sp.add_argument("--hardware", default=None, help="project the step time on this GPU: h100, h200, a100-80gb, "
                    "or a profile file (fields of shardwise/fsdp/hardware.yaml)")
    sp.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node, for which collectives cross "
                    "nodes (default: the hardware profile's, else 8)")
    sp.add_argument("--mfu", type=float, default=None, help="assumed model FLOPs utilisation (torchtitan's: "
                    "recompute not counted); default: the profile's for the config's recompute")
    sp.add_argument("--scan", default=None, help="comma-separated world sizes, one projected row each "
                    "(each rank keeps the step of the first size), e.g. 8,64,512")
    tp = sub.add_parser("train", parents=[common, dialect, nodes], help="supervised fine-tuning (SFT) with the FSDP2 train engine",
                        epilog=NODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_argument("config")
    tp.add_argument("overrides", nargs="*", help="key.sub=value")
    tp.add_argument("--nproc", type=int, default=None, help="start N local processes through torchrun (with "
                    "--nnodes: this node's ranks)")
    ip = sub.add_parser("infer", parents=[common, dialect, nodes], help="generate (and score) responses to data.source's prompts with the FSDP2 "
                        "infer engine", epilog=NODES_EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ip.add_argument("config")
    ip.add_argument("overrides", nargs="*", help="key.sub=value")
    ip.add_argument("--nproc", type=int, default=None, help="start N local processes through torchrun (with "
                    "--nnodes: this node's ranks)")
    rp = sub.add_parser("rl", parents=[common, dialect], help="RL post-training (GRPO, PPO): a single controller over Ray workers")
    rp.add_argument("config")
    rp.add_argument("overrides", nargs="*", help="key.sub=value")
    rp.add_argument("--nproc", type=int, default=None, help="number of worker processes (Ray actors); default 1")
    ep = sub.add_parser("export", parents=[common], help="write an HF folder (config, safetensors, tokenizer) from a checkpoint")
    ep.add_argument("checkpoint_dir")
    ep.add_argument("out_dir")
    ep.add_argument("--merged", action="store_true", help="a LoRA checkpoint: write the merged model (base + "
                    "adapters) instead of the PEFT adapter folder")
    ep.add_argument("--force", action="store_true", help="write into OUT_DIR even if it holds files (another "
                    "model's config and weights are replaced)")
    dp = sub.add_parser("data", parents=[common, dialect], help="show the first examples of a config's data as the "
                        "job feeds them: chat template applied, trained tokens marked, truncation said")
    dp.add_argument("config")
    dp.add_argument("overrides", nargs="*", help="key.sub=value")
    dp.add_argument("--n", type=int, default=3, help="how many examples (default 3)")
    dp.add_argument("--json", action="store_true", help='one JSON object per example: {"input_ids", "loss_mask", '
                    '"text"} ({"prompt_ids", "prompt_text"} with --prompts)')
    dp.add_argument("--prompts", action="store_true", help="the RL / infer prompts instead of SFT examples")
    cp = sub.add_parser("convert", parents=[common], help="write a ROLL, MindSpeed or RLinf config as a shardwise "
                        "YAML (a comment on each key names its source key)")
    cp.add_argument("--from", dest="dialect", choices=DIALECTS, required=True, help="the file's dialect")
    cp.add_argument("file")
    cp.add_argument("--out", default=None, help="write here (default: stdout)")
    gp = sub.add_parser("config", parents=[common, dialect], help="print the resolved config, each value with its "
                        "origin (default, file:line, dialect key, override); --defaults: every key with its type, "
                        "default and doc")
    gp.add_argument("config", nargs="?", default=None, help="the config file (optional with --defaults)")
    gp.add_argument("overrides", nargs="*", help="key.sub=value")
    gp.add_argument("--defaults", action="store_true", help="every key of the schema: type, default and doc (with "
                    "CONFIG: also its value there, where something set it)")
    gp.add_argument("--json", action="store_true", help='resolved: {key: {"value", "origin", "where"}}; with '
                    '--defaults: {key: {"type", "default", "doc"}}')
    gp.add_argument("--only", default=None, metavar="KEY", help="only this key or section and the keys under it, "
                    "e.g. rl.rollout.vllm")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may sit before or after options: collect the leftovers ourselves.
    args, rest = parser.parse_known_args(argv)
    unknown = [r for r in rest if r.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "debug", False):
        os.environ[launch.DEBUG_ENV] = "1"  # the ranks and Ray workers inherit it
    if args.command == "rl" and argv is None:
        # The command itself (not a call from code): the controller runs user code (reward
        # functions), which may end it without a word; a parent process says what happened.
        return supervise(lambda: _run(args), "the RL controller", _checkpoint_line_at)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](args)
    except BaseException as e:  # noqa: BLE001 - sorted below; what is not ours is re-raised
        return _exit_status(e)


def _exit_status(e: BaseException) -> int:
    """How an error ends the command. User errors: one line, status 2. In a rank under
    torchrun: the error goes to the launcher's error folder (which prints one line for the
    whole job) and the rank leaves at once, without waiting for its peers. A failed Ray
    worker: one line (status 2 for a user error). Anything else in this process is a bug:
    Python's traceback."""
    if _under_torchrun() and not isinstance(e, SystemExit):
        launch.rank_failed(e)
    e = as_disk_full(e)
    if isinstance(e, ShardwiseError):
        print(f"shardwise: {' '.join(str(e).split())}", file=sys.stderr)
        if launch.debug_enabled():
            traceback.print_exception(e)
        return e.exit_status
    if isinstance(e, WorkerError):
        kept = getattr(e, "error_file", None)
        print(f"shardwise: {' '.join(str(e).split())}" + (f" (traceback in {kept})" if kept else ""), file=sys.stderr)
        if launch.debug_enabled():
            traceback.print_exception(e)
        return 1
    raise e


if __name__ == "__main__":
    status = main()
    if _under_torchrun():
        # A rank that finished (its group destroyed, its files closed) leaves without the
        # interpreter's shutdown: there, C++ threads of torch's process-group machinery were
        # seen to abort a rank that had completed its work ("terminate called without an
        # active exception", SIGABRT), failing a job that had succeeded.
        launch.leave(status)
    sys.exit(status)
