"""torchrun as `shardwise.distributed.launch` runs it: ``python -m shardwise.distributed.torchrun
<torchrun arguments>``.

The same launcher (`torch.distributed.run`), with three differences: it dies with the
process that started it; its own logging (C++ included: the launching side starts it with
``TORCH_CPP_LOG_LEVEL=FATAL``, and it gives the ranks their own level back) and its
multi-line failure report stay off the terminal (the `shardwise` process prints one line
instead, from the ranks' error files) unless ``SHARDWISE_DEBUG=1``; and a rank that died
without writing an error file (killed by a signal, out of memory) is described in
``launcher-rank<r>.json`` of the error folder, a rendezvous that did not gather the job's
nodes (one of them never came within the timeout) in ``launcher.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.run import parse_args, run

from shardwise.distributed.launch import (
    CPP_LOG_ENV,
    ERROR_DIR_ENV,
    LAUNCHER_FILE,
    RENDEZVOUS_FAILED,
    SAVED_CPP_LOG_ENV,
    activity_file,
    debug_enabled,
    describe_exit,
    die_with_parent,
)
from shardwise.telemetry import activity


def _note(folder: str | None, name: str, **fields: object) -> None:
    """A failure that no rank wrote, for the launching side (`launch.read_failures`)."""
    if folder:
        note = {"user": False, "time": time.time(), **fields}
        (Path(folder) / name).write_text(json.dumps(note))


def _rendezvous_line(args, exc: BaseException) -> str:
    """What a node whose torchrun could not meet the others prints."""
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    waited = conf.get("timeout") or conf.get("join_timeout")
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return (f"the job's {args.nnodes} nodes did not meet at the rendezvous {endpoint}"
            + (f" within {waited} s" if waited else "") + f" ({detail}); start every node with the same "
            "endpoint and --nnodes")


def main(argv: list[str]) -> int:
    die_with_parent()
    if not debug_enabled():
        # torchrun's modules set their loggers' levels one by one when imported.
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
                logging.getLogger(name).setLevel(logging.CRITICAL)

    saved = os.environ.pop(SAVED_CPP_LOG_ENV, None)
    if saved is not None:  # this process logs C++ at FATAL (read at import); the ranks as they asked
        if saved:
            os.environ[CPP_LOG_ENV] = saved
        else:
            os.environ.pop(CPP_LOG_ENV, None)
    args = parse_args(argv)
    folder = os.environ.get(ERROR_DIR_ENV)
    try:
        run(args)
    except ChildFailedError as e:
        # Every rank that failed without a word (a signal, the OOM killer): one of them is
        # likely the cause, and its peers' files only say that they lost it.
        for r, f in e.failures.items():
            if not (folder and (Path(folder) / f"rank{r}.json").exists()):
                doing = activity.read_file(str(Path(folder) / activity_file(r))).get("doing") if folder else None
                _note(folder, f"launcher-rank{r}.json", rank=r, type="ProcessExit",
                      message=describe_exit(f.exitcode) + (f" in {doing}" if doing else ""), traceback=str(e))
        rank, failure = e.get_first_failure()
        if debug_enabled():
            print(str(e), file=sys.stderr)
        code = failure.exitcode
        return code if code > 0 else 128 - code
    except SignalException as e:
        return 128 + int(e.sigval)
    except (RendezvousError, DistError) as e:  # before any rank started: the nodes did not meet
        _note(folder, LAUNCHER_FILE, rank=None, type=RENDEZVOUS_FAILED, message=_rendezvous_line(args, e),
              traceback="".join(traceback.format_exception(e)))
        if debug_enabled():
            traceback.print_exception(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
