"""torchrun as `shardwise.distributed.launch` runs it: ``python -m shardwise.distributed.torchrun
<torchrun arguments>``.

The same launcher (`torch.distributed.run`), with three differences: it dies with the
process that started it; its own logging (C++ included: the launching side starts it with
``TORCH_CPP_LOG_LEVEL=FATAL``, and it gives the ranks their own level back) and its
multi-line failure report stay off the terminal (the `shardwise` process prints one line
instead, from the ranks' error files) unless ``SHARDWISE_DEBUG=1``; and a rank that died
without writing an error file (killed by a signal, out of memory) is described in
``launcher-rank<r>.json`` of the error folder, a rendezvous that did not gather the job's
nodes (one of them never came within the timeout) in ``launcher.json``. The rendezvous of a
multi-node job has a bound of its own (`launch.rendezvous_bound_s`): where torch's timeouts
do not reach (a program squatting the port that accepts connections and never answers), a
watch thread ends the node with the same line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
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
    descendants,
    describe_exit,
    die_with_parent,
    rendezvous_bound_s,
)
from shardwise.telemetry import activity


def _note(folder: str | None, name: str, **fields: object) -> None:
    """A failure that no rank wrote, for the launching side (`launch.read_failures`)."""
    if folder:
        note = {"user": False, "time": time.time(), **fields}
        (Path(folder) / name).write_text(json.dumps(note))


def _endpoint(args) -> str:
    return args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"


def _waited(args) -> str | None:
    """The rendezvous timeout of torchrun's arguments (seconds, as given), if any."""
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    return conf.get("timeout") or conf.get("join_timeout")


def _rendezvous_line(args, exc: BaseException) -> str:
    """What a node whose torchrun could not meet the others prints."""
    waited = _waited(args)
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return (f"the job's {args.nnodes} nodes did not meet at the rendezvous {_endpoint(args)}"
            + (f" within {waited} s" if waited else "") + f" ({detail}); start every node with the same "
            "endpoint and --nnodes")


def _bound_rendezvous(args, folder: str | None) -> None:
    """A multi-node job's rendezvous ends within `rendezvous_bound_s` of now: unless a rank
    has started by then (torchrun starts them once the nodes have met), this process writes
    the rendezvous line and leaves (its parent then ends, and `die_with_parent` ranks with it)."""
    waited = _waited(args)
    if str(args.nnodes) == "1" or waited is None or not waited.isdigit():
        return
    bound = rendezvous_bound_s(int(waited))

    def watch() -> None:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if descendants(os.getpid()):
                return
        endpoint = _endpoint(args)
        why = TimeoutError(f"nothing at {endpoint} answered as the job's rendezvous within {bound:.0f} s: "
                           "is another program listening on that port?")
        _note(folder, LAUNCHER_FILE, rank=None, type=RENDEZVOUS_FAILED, message=_rendezvous_line(args, why),
              traceback="")
        if debug_enabled():
            print(f"shardwise torchrun: {why}", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="shardwise-rendezvous-bound", daemon=True).start()


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
    _bound_rendezvous(args, folder)
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
