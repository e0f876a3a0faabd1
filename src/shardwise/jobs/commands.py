"""What each `shardwise` command does once its arguments are parsed (`shardwise.cli` parses
them and imports this module when a command runs: it pulls torch, transformers and the
jobs, seconds of imports the parser and ``--help`` do not need, and that `shardwise rl`
spends while Ray's head starts: `shardwise.cli.cmd_rl`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from shardwise.config.schema import Config
from shardwise.distributed.capacity import check_nproc
from shardwise.distributed.nodes import nodes_from_args
from shardwise.jobs import configs, export, infer, plan, preview, report, sft
from shardwise.jobs.launcher import run_job
from shardwise.models.hub import resolve_inputs

__all__ = ["cmd_config", "cmd_convert", "cmd_data", "cmd_export", "cmd_infer", "cmd_plan", "cmd_train"]


def cmd_plan(args: argparse.Namespace) -> int:
    """The sharding plan of a config; see shardwise.jobs.plan."""
    cfg, ranks = _load(args)
    plan.show(cfg, args.world_size, ranks, hardware=args.hardware, gpus_per_node=args.gpus_per_node, mfu=args.mfu,
              scan=args.scan, rl=args.rl, as_json=args.json)
    return 0


def _load(args: argparse.Namespace) -> tuple[Config, int | None]:
    """The command's config (`configs.load`) with its inputs named by Hub id or GGUF file
    resolved, once, into local paths (`shardwise.models.hub.resolve_inputs`: a download; one
    line and exit 2 when that fails), and the rank count its file names."""
    cfg, ranks = configs.load(args.config, args.overrides, args.dialect)
    return resolve_inputs(cfg), ranks


def cmd_train(args: argparse.Namespace) -> int:
    """Supervised fine-tuning; see shardwise.jobs.sft."""
    return _on_ranks(args, sft, report.train)


def cmd_infer(args: argparse.Namespace) -> int:
    """Generation with the FSDP2 infer engine; see shardwise.jobs.infer."""
    return _on_ranks(args, infer, report.infer)


def _on_ranks(args: argparse.Namespace, job, summary: Callable[[Config, dict], None]) -> int:
    """`job` on `--nproc` ranks through torchrun, or in this process; see shardwise.jobs.launcher."""
    check_nproc(args.nproc)
    nodes = nodes_from_args(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                                   args.rdzv_endpoint, args.rdzv_timeout)
    cfg, ranks = _load(args)
    dialect = ["--dialect", args.dialect] if args.dialect else []
    return run_job(job, cfg, summary, nproc=args.nproc, config_ranks=ranks, nodes=nodes,
                   argv=[args.command, args.config, *dialect, *args.overrides])


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint folder as an HF folder; see shardwise.jobs.export."""
    out = export.run(export.prepare(args.checkpoint_dir, args.out_dir, merged=args.merged, force=args.force))
    print(f"exported {args.checkpoint_dir} -> {out}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Another system's config as a shardwise YAML; see shardwise.jobs.configs."""
    configs.convert(args.file, args.dialect, args.out)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """The first examples (or prompts) of a config's data as its job feeds them; see
    shardwise.jobs.preview."""
    cfg, _ = _load(args)
    try:
        preview.show(cfg, args.n, args.prompts, as_json=args.json)
    except KeyboardInterrupt:  # Ctrl-C while a long or slow data set prepares: one line, no traceback
        print("\nshardwise: interrupted by SIGINT; nothing was written", file=sys.stderr)
        return 130
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """The resolved config with each value's origin, or every key's type, default and doc;
    see shardwise.jobs.configs."""
    configs.show(args.config, list(args.overrides), args.dialect, only=args.only, defaults=args.defaults,
                 as_json=args.json)
    return 0
