"""The `shardwise` command: plan | train | infer | rl | export.

Config and input errors exit with status 2 and one message on stderr (no traceback), on
every rank alike, before any process group exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from shardwise.errors import ShardwiseError

EXIT_USER_ERROR = 2


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
    head = ["#", "unit", "from", "param", "reduce", "output", "store", "reshard", "offload", "recompute",
            "prefetch fwd/bwd", "params"]
    rows = []
    for i, u in enumerate(plan.units):
        rows.append([
            str(i), u.path or "<root>", ",".join(u.sources), u.param_dtype, u.reduce_dtype,
            u.output_dtype or "-", u.storage_dtype, str(u.reshard_after_forward).lower(),
            "cpu" if u.offload else "-", "yes" if u.recompute else "-",
            f"{len(u.prefetch_forward)}/{len(u.prefetch_backward)}", f"{u.num_params:,}",
        ])
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
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
    if plan.buffer_casts:
        extra.append("layered precision: " + ", ".join(f"{p}={d}" for p, d in plan.buffer_casts.items()))
    if plan.frozen:
        extra.append(f"frozen parameters: {len(plan.frozen)}")
    if extra:
        lines += [""] + extra
    peak = {k: max(r[k] for r in plan.memory_per_rank_bytes) for k in plan.memory_per_rank_bytes[0]}
    lines += ["", "per-rank memory (largest rank; params + grads + AdamW state): "
              + "  ".join(f"{k} {_human_bytes(v)}" for k, v in peak.items())]
    for note in plan.warnings:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from shardwise.config import load_config
    from shardwise.distributed.mesh import mesh_spec
    from shardwise.fsdp.build import plan_for
    from shardwise.models.loading import local_files_only

    local_files_only()
    cfg = load_config(args.config, args.overrides)
    from shardwise.distributed.runtime import env_world

    world = args.world_size if args.world_size is not None else env_world()[1]
    spec = mesh_spec(cfg.parallel, world)
    from shardwise.engine.batching import check_batch_sizes

    check_batch_sizes(cfg.train, spec.dp_size)
    _, plan = plan_for(cfg, spec)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(format_plan(plan))
    return 0


def _launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Re-run this command under torchrun with `nproc` local processes."""
    import subprocess

    from shardwise.distributed.runtime import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "shardwise.cli", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_train(args: argparse.Namespace) -> int:
    from shardwise.config import load_config
    from shardwise.jobs import sft
    from shardwise.models.loading import local_files_only

    local_files_only()
    cfg = load_config(args.config, args.overrides)
    if args.nproc and not _under_torchrun():
        sft.prepare(cfg, world_size=args.nproc)  # config errors exit 2 here, before any process starts
        return _launch_torchrun(args.nproc, ["train", args.config, *args.overrides])
    sft.prepare(cfg)
    from shardwise.distributed.runtime import init_distributed, seed_everything, teardown

    runtime = init_distributed()
    try:
        seed_everything(cfg.run.seed)
        summary = sft.run(cfg, runtime)
        if runtime.is_main:
            final = summary["final"]
            print(f"done: {summary['steps']} steps, final loss {final.get('loss', float('nan')):.4f}")
            if "accuracy" in summary:
                print(f"  held-out accuracy (greedy, exported HF model): {summary['accuracy']:.1%}")
            for key in ("metrics", "checkpoint", "hf", "plot"):
                if summary.get(key):
                    print(f"  {key:<10} {summary[key]}")
    finally:
        teardown()
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    """Generation with the FSDP2 infer engine; see shardwise.jobs.infer."""
    from shardwise.config import load_config
    from shardwise.jobs import infer
    from shardwise.models.loading import local_files_only

    local_files_only()
    cfg = load_config(args.config, args.overrides)
    if args.nproc and not _under_torchrun():
        infer.prepare(cfg, world_size=args.nproc)  # config and data errors exit 2 here
        return _launch_torchrun(args.nproc, ["infer", args.config, *args.overrides])
    infer.prepare(cfg)
    from shardwise.distributed.runtime import init_distributed, seed_everything, teardown

    runtime = init_distributed()
    try:
        seed_everything(cfg.run.seed)
        s = infer.run(cfg, runtime)
        if runtime.is_main:
            mode = "greedy" if s["greedy"] else f"temperature {cfg.infer.temperature}, top_p {cfg.infer.top_p}"
            print(f"done: {s['prompts']} prompts x {s['samples_per_prompt']} ({mode}), {s['world_size']} ranks")
            if "accuracy" in s:
                print(f"  accuracy ({s['reward']}): {s['accuracy']:.1%}")
            elif "score_mean" in s:
                print(f"  mean score ({s['reward']}): {s['score_mean']:.4f}")
            print(f"  response length {s['response_length_mean']:.1f} tokens (mean), "
                  f"{s['ended_with_eos']:.0%} ended with eos; {s['tokens_per_s']:.0f} tokens/s over {s['seconds']:.1f} s")
            for key in ("output", "summary"):
                print(f"  {key:<10} {s[key]}")
    finally:
        teardown()
    return 0


def cmd_rl(args: argparse.Namespace) -> int:
    """RL post-training: this process is the single controller; `--nproc` Ray workers
    (default 1) form the FSDP process group."""
    from shardwise.config import load_config
    from shardwise.models.loading import local_files_only
    from shardwise.rl import trainer

    local_files_only()
    cfg = load_config(args.config, args.overrides)
    nproc = args.nproc or 1
    if nproc < 1:
        from shardwise.errors import ConfigError

        raise ConfigError("--nproc", f"{nproc} is not a positive number of processes", "e.g. --nproc 2")
    trainer.prepare(cfg, nproc)  # config errors exit 2 here, before Ray starts
    summary = trainer.run(cfg, nproc)
    last = summary["history"][-1] if summary.get("history") else {}
    print(f"done: {summary['steps']} {cfg.rl.algorithm} steps"
          + (f", final reward {last['reward/mean']:.3f}" if last else ""))
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if before is not None and after is not None:
        start = summary.get("resumed_from_step")
        label = "before RL" if not start else f"at step {start} (resumed)"
        print(f"  held-out accuracy (greedy): {label} {before:.1%}, after RL {after:.1%}")
    timing = summary.get("timing") or {}
    if timing.get("time/step"):
        step_s = timing["time/step"]
        phases = {k[5:]: v for k, v in timing.items() if k != "time/step"}
        print(f"  seconds per step {step_s:.2f} (mean; "
              + ", ".join(f"{k} {v / step_s:.0%}" for k, v in phases.items()) + ")")
    for key in ("metrics", "checkpoint", "hf", "plot"):
        if summary.get(key):
            print(f"  {key:<10} {summary[key]}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.hf_export import export_checkpoint
    from shardwise.models.loading import local_files_only

    local_files_only()
    out = export_checkpoint(args.checkpoint_dir, args.out_dir)
    print(f"exported {args.checkpoint_dir} -> {out}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": cmd_plan, "train": cmd_train, "infer": cmd_infer, "rl": cmd_rl, "export": cmd_export}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("plan", help="print the sharding plan of a config (no process group, no weights)")
    sp.add_argument("config")
    sp.add_argument("overrides", nargs="*", help="key.sub=value")
    sp.add_argument("--world-size", type=int, default=None)
    sp.add_argument("--json", action="store_true")
    tp = sub.add_parser("train", help="supervised fine-tuning (SFT) with the FSDP2 train engine")
    tp.add_argument("config")
    tp.add_argument("overrides", nargs="*", help="key.sub=value")
    tp.add_argument("--nproc", type=int, default=None, help="start N local processes through torchrun")
    ip = sub.add_parser("infer", help="generate (and score) responses to data.source's prompts with the FSDP2 "
                        "infer engine")
    ip.add_argument("config")
    ip.add_argument("overrides", nargs="*", help="key.sub=value")
    ip.add_argument("--nproc", type=int, default=None, help="start N local processes through torchrun")
    rp = sub.add_parser("rl", help="RL post-training (GRPO, PPO): a single controller over Ray workers")
    rp.add_argument("config")
    rp.add_argument("overrides", nargs="*", help="key.sub=value")
    rp.add_argument("--nproc", type=int, default=None, help="number of worker processes (Ray actors); default 1")
    ep = sub.add_parser("export", help="write an HF folder (config, safetensors, tokenizer) from a checkpoint")
    ep.add_argument("checkpoint_dir")
    ep.add_argument("out_dir")
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
    try:
        return COMMANDS[args.command](args)
    except ShardwiseError as e:
        print(f"shardwise: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
