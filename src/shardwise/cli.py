"""The `shardwise` command: plan | train | infer | rl | export | convert | data | config.

The argument parser and a dispatch table (`COMMANDS`) over `shardwise.jobs` (the commands'
code in `shardwise.jobs.commands`, imported when one runs; `shardwise rl` imports its job
while Ray's head starts, `cmd_rl`), where each command's work lives: its checks (``prepare``: exit status 2 and one line on stderr, before
any process group, Ray worker or file of the run exists), the torchrun launch of ``--nproc``
ranks (`jobs.launcher`), the RL controller under its supervisor (`jobs.supervisor`) and
the tables and summaries printed (`jobs.report`). `_exit_status` says how an error ends it.
``--dialect roll|mindspeed|rlinf`` reads CONFIG as another system's config
(`shardwise.config.dialects`): converted first, then the overrides; a device count in it
is the default of ``--nproc`` / ``--world-size``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from shardwise.checkpoint.layout import resume_line
from shardwise.config.dialects import DIALECTS
from shardwise.distributed import launch
from shardwise.distributed.capacity import check_nproc
from shardwise.distributed.nodes import MASTER_PORT, RDZV_TIMEOUT_S
from shardwise.errors import ShardwiseError, as_disk_full
from shardwise.jobs import configs, supervisor
from shardwise.rl.cluster import WorkerError

COMMANDS_MODULE = "shardwise.jobs.commands"
"""Where the commands but `rl` do their work, imported when one runs (torch, transformers and
the jobs: seconds the parser, ``--help`` and the bad-argument lines do not wait for)."""


def cmd_rl(args: argparse.Namespace, ahead: bool = False) -> int:
    """RL post-training: this process is the single controller; `--nproc` Ray workers
    (default 1) form the FSDP process group. See shardwise.jobs.rl; with `ahead` (the
    command under its supervisor) a local Ray's head starts while the job imports
    (`shardwise.jobs.supervisor.control`)."""
    check_nproc(args.nproc)
    cfg, ranks = configs.load(args.config, args.overrides, args.dialect)
    return supervisor.control("shardwise.jobs.rl", cfg, args.nproc or ranks or 1, ahead=ahead)


def _deferred(name: str) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(COMMANDS_MODULE), name)(args)

    command.__name__ = name
    return command


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _deferred("cmd_plan"), "train": _deferred("cmd_train"), "infer": _deferred("cmd_infer"), "rl": cmd_rl,
    "export": _deferred("cmd_export"), "convert": _deferred("cmd_convert"), "data": _deferred("cmd_data"),
    "config": _deferred("cmd_config")}


def __getattr__(name: str):
    if name == "format_plan":  # tests import it from here; it lives with the other tables
        return importlib.import_module("shardwise.jobs.report").format_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    job = argparse.ArgumentParser(add_help=False)
    job.add_argument("config")
    job.add_argument("overrides", nargs="*", help="key.sub=value")
    nodes = argparse.ArgumentParser(add_help=False)
    g = nodes.add_argument_group("several machines", "the same command on every node (see the end of this help)")
    g.add_argument("--nnodes", type=int, default=None, help="number of nodes (machines) of the job (default 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank in [0, nnodes); node 0 hosts the "
                   "rendezvous at --master-addr")
    g.add_argument("--master-addr", default=None, help="address of node 0, where the nodes meet (static rendezvous)")
    g.add_argument("--master-port", type=int, default=None, help=f"its port (default {MASTER_PORT})")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of a c10d rendezvous instead (nodes are "
                   "numbered as they arrive; --node-rank is not needed)")
    g.add_argument("--rdzv-timeout", type=int, default=None, help="seconds a node waits for the others at the "
                   f"rendezvous before the job fails (default {RDZV_TIMEOUT_S})")
    sp = sub.add_parser("plan", parents=[common, dialect, job], help="print the sharding plan of a config (no process group, no weights)")
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
    tp = sub.add_parser("train", parents=[common, dialect, job, nodes], help="supervised fine-tuning (SFT) with the FSDP2 train engine",
                        epilog=NODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_argument("--nproc", type=int, default=None, help="start N local processes through torchrun (with "
                    "--nnodes: this node's ranks)")
    ip = sub.add_parser("infer", parents=[common, dialect, job, nodes], help="generate (and score) responses to data.source's prompts with the FSDP2 "
                        "infer engine", epilog=NODES_EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ip.add_argument("--nproc", type=int, default=None, help="start N local processes through torchrun (with "
                    "--nnodes: this node's ranks)")
    rp = sub.add_parser("rl", parents=[common, dialect, job], help="RL post-training (GRPO, PPO): a single controller over Ray workers")
    rp.add_argument("--nproc", type=int, default=None, help="number of worker processes (Ray actors); default 1")
    ep = sub.add_parser("export", parents=[common], help="write an HF folder (config, safetensors, tokenizer) from a checkpoint")
    ep.add_argument("checkpoint_dir")
    ep.add_argument("out_dir")
    ep.add_argument("--merged", action="store_true", help="a LoRA checkpoint: write the merged model (base + "
                    "adapters) instead of the PEFT adapter folder")
    ep.add_argument("--force", action="store_true", help="write into OUT_DIR even if it holds files (another "
                    "model's config and weights are replaced)")
    dp = sub.add_parser("data", parents=[common, dialect, job], help="show the first examples of a config's data as the "
                        "job feeds them: chat template applied, trained tokens marked, truncation said")
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
        return supervisor.supervise(lambda: _run(args, ahead=True), "the RL controller", resume_line)
    return _run(args)


def _run(args: argparse.Namespace, ahead: bool = False) -> int:
    try:
        return cmd_rl(args, ahead=True) if ahead else COMMANDS[args.command](args)
    except BaseException as e:  # noqa: BLE001 - sorted below; what is not ours is re-raised
        return _exit_status(e)


def _exit_status(e: BaseException) -> int:
    """How an error ends the command. User errors: one line, status 2. In a rank under
    torchrun: the error goes to the launcher's error folder (which prints one line for the
    whole job) and the rank leaves at once, without waiting for its peers. A failed Ray
    worker: one line (status 2 for a user error). Anything else in this process is a bug:
    Python's traceback."""
    if launch.under_torchrun() and not isinstance(e, SystemExit):
        launch.rank_failed(e)
    e = as_disk_full(e)
    if not isinstance(e, (ShardwiseError, WorkerError)):
        raise e
    kept = getattr(e, "error_file", None) if isinstance(e, WorkerError) else None
    print(f"shardwise: {' '.join(str(e).split())}" + (f" (traceback in {kept})" if kept else ""), file=sys.stderr)
    if launch.debug_enabled():
        traceback.print_exception(e)
    return e.exit_status if isinstance(e, ShardwiseError) else 1


def console() -> None:
    """The ``shardwise`` command (and ``python -m shardwise.cli``): `main`, then the end of
    the process. A rank that finished (its group destroyed, its files closed) leaves without
    the interpreter's shutdown: there, C++ threads of torch's process-group machinery were
    seen to abort a rank that had completed its work ("terminate called without an active
    exception", SIGABRT), failing a job that had succeeded. Any other process runs its
    atexit handlers and skips the module teardown after them (`launch.end_process`: 1.4-1.8 s
    of CPU once torch is imported, at the end of every command)."""
    status = main()
    if launch.under_torchrun():
        launch.leave(status)
    launch.end_process(status)


if __name__ == "__main__":
    console()
