"""torchrun as `shardwise.distributed.launch` runs it: ``python -m shardwise.distributed.torchrun
<torchrun arguments>``.

The same launcher (`torch.distributed.run`), with four differences: it dies with the
process that started it; its own logging (C++ included: the launching side starts it with
``TORCH_CPP_LOG_LEVEL=FATAL``, and it gives the ranks their own level back) and its
multi-line failure report stay off the terminal (the `shardwise` process prints one line
instead, from the ranks' error files) unless ``SHARDWISE_DEBUG=1``; and a rank that died
without writing an error file (killed by a signal, out of memory) is described in
``launcher-rank<r>.json`` of the error folder, a rendezvous that did not gather the job's
nodes (one of them never came within the timeout) in ``launcher.json``. The rendezvous of a
multi-node job has a bound of its own (`nodes.rendezvous_bound_s`): where torch's timeouts
do not reach (a program squatting the port that accepts connections and never answers), a
watch thread ends the node with the same line. And where the launching side asks for it
(``SHARDWISE_FORK_RANKS``, `launch.fork_ranks`: one machine without a GPU), this process
imports the ranks' code once and torchrun forks each rank from it (its ``--start-method
fork`` for a function, as ``--run-path`` does), instead of starting an interpreter per rank
that imports torch, transformers and the jobs again: `run_module` makes the fork what
``python -u -m <module> <args>`` would have been. This process is then itself a fork of the
launching `shardwise` where that could take one (`launch.Zygote`), named ``sw-torchrun``.
"""

from __future__ import annotations

import importlib
import io
import ipaddress
import json
import logging
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch
from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args, run

from shardwise.contained import PR_SET_PDEATHSIG, prctl, set_process_name
from shardwise.distributed.launch import (
    CPP_LOG_ENV,
    ERROR_DIR_ENV,
    FORK_RANKS_ENV,
    LAUNCHER_FILE,
    RDZV_SINCE_ENV,
    RENDEZVOUS_FAILED,
    SAVED_CPP_LOG_ENV,
    activity_file,
    debug_enabled,
    descendants,
    describe_exit,
    die_with_parent,
    end_process,
)
from shardwise.distributed.nodes import rendezvous_bound_s
from shardwise.telemetry import activity


def _note(folder: str | None, name: str, **fields: object) -> None:
    """A failure that no rank wrote, for the launching side (`launch.read_failures`)."""
    if folder:
        note = {"user": False, "time": time.time(), **fields}
        (Path(folder) / name).write_text(json.dumps(note))


def _note_exit(folder: str | None, rank: int, exitcode: int, traceback: str) -> None:
    """Rank `rank` ended with `exitcode` (negative: killed by that signal) without its own
    error file: how it ended, and what it was doing (its activity file)."""
    doing = activity.read_file(str(Path(folder) / activity_file(rank))).get("doing") if folder else None
    _note(folder, f"launcher-rank{rank}.json", rank=rank, type="ProcessExit",
          message=describe_exit(exitcode) + (f" in {doing}" if doing else ""), traceback=traceback)


def _endpoint(args) -> str:
    return args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"


_RDZV_TIMEOUT_KEYS = ("timeout", "join_timeout")
"""The ``--rdzv-conf`` keys that bound the whole rendezvous (static, c10d)."""


def _waited(args) -> str | None:
    """The rendezvous timeout of torchrun's arguments (seconds, as given), if any."""
    given = getattr(args, "shardwise_rdzv_timeout", None)
    if given is not None:
        return given
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    return conf.get("timeout") or conf.get("join_timeout")


def _count_from_launch(args, since: float) -> None:
    """torch's rendezvous timeouts in `args` less the seconds since the launching side
    started this process (at `since`): ``--rdzv-timeout`` bounds the wait from the launch,
    this process's own start included, and torch's own line (which names what was missing)
    still comes before the watch's (`_bound_rendezvous`)."""
    waited = _waited(args)
    if waited is None or not waited.isdigit():
        return
    args.shardwise_rdzv_timeout = waited  # for the lines: the timeout as the user gave it
    left = max(1, int(int(waited) - (time.monotonic() - since)))
    args.rdzv_conf = ",".join(f"{k}={left}" if "=" in kv and (k := kv.split("=", 1)[0]) in _RDZV_TIMEOUT_KEYS
                              else kv for kv in args.rdzv_conf.split(","))


def _rendezvous_line(args, exc: BaseException) -> str:
    """What a node whose torchrun could not meet the others prints."""
    waited = _waited(args)
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return (f"the job's {args.nnodes} nodes did not meet at the rendezvous {_endpoint(args)}"
            + (f" within {waited} s" if waited else "") + f" ({detail}); start every node with the same "
            "endpoint and --nnodes")


def _bound_rendezvous(args, folder: str | None, since: float) -> None:
    """A multi-node job's rendezvous ends within `rendezvous_bound_s` of `since` (when the
    launching side started this process): unless a rank has started by then (torchrun
    starts them once the nodes have met), this process writes the rendezvous line and
    leaves (its parent then ends, and `die_with_parent` ranks with it)."""
    waited = _waited(args)
    if str(args.nnodes) == "1" or waited is None or not waited.isdigit():
        return
    bound = rendezvous_bound_s(int(waited))

    def watch() -> None:
        deadline = since + bound
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if descendants(os.getpid()):
                return
        why = TimeoutError(_unmet(args, f"within --rdzv-timeout {waited} s (+{bound - int(waited):g} s)"))
        _note(folder, LAUNCHER_FILE, rank=None, type=RENDEZVOUS_FAILED, message=_rendezvous_line(args, why),
              traceback="")
        if debug_enabled():
            print(f"shardwise torchrun: {why}", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="shardwise-rendezvous-bound", daemon=True).start()


def _unmet(args, within: str) -> str:
    """Why the rendezvous did not gather the nodes `within` the bound, as far as this node can
    tell without torch's own timeout (which did not come first): it hosts the rendezvous
    (static node rank 0, or a c10d endpoint on this machine) and the others did not come;
    or nothing listens at the endpoint (the hosting node has not started); or something
    there takes connections and never answers as a rendezvous (another program on the port)."""
    endpoint = _endpoint(args)
    host, _, port = endpoint.rpartition(":")
    others = int(args.nnodes) - 1 if str(args.nnodes).isdigit() else "the other"
    if (args.rdzv_backend == "static" and str(args.node_rank) == "0") or (
            args.rdzv_backend != "static" and _on_this_machine(host)):
        return f"this node hosts the rendezvous at {endpoint}, and {others} other node(s) did not join {within}"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            pass
    except ConnectionRefusedError:
        return (f"nothing listens at {endpoint} {within}: the node that hosts the rendezvous (node rank 0) has not "
                "started, or the address is wrong")
    except (OSError, ValueError):
        return f"{endpoint} could not be reached {within}"
    return (f"something at {endpoint} takes connections but did not answer as the job's rendezvous {within}: "
            "is another program listening on that port?")


def _on_this_machine(host: str) -> bool:
    """`host` names this machine (a loopback address, or one of its own)."""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host.strip("[]"), None)}
        own = set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        return False
    return any(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback or a in own for a in addrs)


def run_module(module: str, *argv: str) -> None:
    """A rank torchrun forked from this process (the function of ``elastic_launch``):
    ``python -u -m <module> <argv>``, run in a child of this fork, which waits for it.

    torchrun reports one failed process of those it forked, and reaps the others without a
    word; a rank that died without writing its error (a signal, user code calling
    os._exit) is named by its waiting parent instead, which knows its exit
    (``launcher-rank<r>.json``, as the wrapper writes for a fresh rank). That parent passes
    the signals torchrun sends on to the rank and ends as the rank ended (its status, or the
    same signal); with status 0 the function returns, which torchrun waits for."""
    rank = os.environ.get("RANK", "")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _rank_main(module, argv)
        finally:
            os._exit(1)  # never returns into torchrun's code
    set_process_name(f"sw-rank{rank}-wait")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    _, status = os.waitpid(pid, 0)  # retried after each signal handler (PEP 475)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return
    folder = os.environ.get(ERROR_DIR_ENV)
    if rank.isdigit() and not (folder and (Path(folder) / f"rank{rank}.json").exists()):
        _note_exit(folder, int(rank), code, traceback="")
    if code < 0:
        if -code != signal.SIGKILL:  # its handler cannot be set (EINVAL); it needs none
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code > 0 else 128 - code)


def _rank_main(module: str, argv: tuple[str, ...]) -> NoReturn:
    """The rank: it starts as a fresh interpreter would (named ``sw-rank<r>``; Python's signal
    handlers, not torchrun's; unbuffered stdout and stderr) and runs `exec_module`."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # until die_with_parent says the same
    set_process_name(f"sw-rank{os.environ.get('RANK', '')}")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # OpenMP read its count when torch was imported
        torch.set_num_threads(int(threads))
    _fresh_signal_handlers()
    for name, fd in (("stdout", 1), ("stderr", 2)):  # what -u gives
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False),  # noqa: SIM115
                                            encoding=old.encoding, errors=old.errors, write_through=True))
    exec_module(module, argv)


def _fresh_signal_handlers() -> None:
    """The handlers a fresh interpreter starts with, for those this launcher's code sets."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def exec_module(module: str, argv: Sequence[str]) -> NoReturn:
    """``python -m <module> <argv>`` in this process, a fork of one that imported what the
    module needs: ``sys.argv`` as `python -m` sets it, the module run as ``__main__`` (not
    the copy already imported), then the end an interpreter gives it (an uncaught error's
    traceback; the non-daemon threads joined; the atexit handlers run unless the module
    `leave`s, which skips them as it does in a fresh process; the streams flushed) and the
    process's exit with the module's status."""
    sys.argv = ["-m", *argv]  # run_module puts the module's file first, as `python -m` does
    sys.modules.pop(module, None)  # `python -m` runs it before any import of it (its imports stay)
    status: object = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        status = e.code
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught one
        traceback.print_exc()
        status = 1
    if status is not None and not isinstance(status, int):  # sys.exit("message")
        print(status, file=sys.stderr)
        status = 1
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    end_process(status or 0)  # its threads are joined: the atexit handlers, then the exit


def _launch_forked(args, preload: list[str]) -> None:
    """torchrun's `run` for a ``-m <module>`` job whose ranks are forked from this process."""
    for name in preload:
        importlib.import_module(name)
    config, _cmd, cmd_args = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=run_module)(*cmd_args[cmd_args.index("-m") + 1:])


def become(argv: list[str], env: dict[str, str]) -> int:
    """A zygote (`launch.Zygote`) becomes the wrapper: what ``python -m
    shardwise.distributed.torchrun <argv>`` does in a fresh interpreter with environment `env`."""
    set_process_name("sw-torchrun")  # its command line is the launcher's
    _fresh_signal_handlers()
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [__file__, *argv]
    # sys.path[0] as `python -m` sets it (the launcher's may be its script's folder)
    sys.path[0:0 if sys.flags.safe_path else 1] = [os.getcwd()]
    return main(argv)


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
    preload = [m for m in os.environ.pop(FORK_RANKS_ENV, "").split(",") if m]
    since_text = os.environ.pop(RDZV_SINCE_ENV, None)
    args = parse_args(argv)
    folder = os.environ.get(ERROR_DIR_ENV)
    since = float(since_text) if since_text else time.monotonic()
    if str(args.nnodes) != "1":
        _count_from_launch(args, since)
    _bound_rendezvous(args, folder, since)
    try:
        if preload and args.module:
            _launch_forked(args, preload)
        else:
            run(args)
    except ChildFailedError as e:
        # Every rank that failed without a word (a signal, the OOM killer): one of them is
        # likely the cause, and its peers' files only say that they lost it.
        for r, f in e.failures.items():
            if not (folder and (Path(folder) / f"rank{r}.json").exists()):
                _note_exit(folder, r, f.exitcode, traceback=str(e))
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
    end_process(main(sys.argv[1:]))  # without the teardown of the modules it imported (seconds)
