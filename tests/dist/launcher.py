"""Run test code in real processes: N spawned ranks, torchrun, or the shardwise CLI.

Every entry point has a hard timeout. When it passes, the whole process tree is killed
(process groups, and descendants found through /proc, since torchrun starts its workers in
sessions of their own) and the test fails with the tail of what the processes printed.
A hung collective therefore fails in seconds and never blocks the suite.

Public interface::

    free_port() -> int
    run_ranks(fn, world_size, *args, timeout=180.0, init_pg=False, env=None) -> list
    run_torchrun(argv, nproc, timeout=300.0, env=None, cwd=None) -> subprocess.CompletedProcess
    run_cli(argv, timeout=120.0, env=None, cwd=None, fresh=False) -> subprocess.CompletedProcess
    run_python(argv, timeout=120.0, env=None, cwd=None) -> subprocess.CompletedProcess
    at_once(*calls) -> list

``at_once`` runs independent commands side by side (each call in a thread of its own,
e.g. ``lambda: run_cli(...)``): a command is mostly the start-up of its processes, which
two commands overlap on two cores.

In ``env`` mappings a value of ``None`` removes the variable from the child's environment.
Set ``SHARDWISE_KEEP_RANK_LOGS=1`` to keep ``run_ranks``'s per-rank log folder after a run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import wait as _wait_for_sentinels
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

__all__ = ["alive", "free_port", "run_ranks", "run_torchrun", "run_cli", "at_once"]

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC_DIR = REPO_ROOT / "src"

LOG_TAIL_LINES = 40
OUTPUT_TAIL_LINES = 60
# After one rank has failed, the others get this long to finish before they are killed
# (a peer waiting in a collective for the failed rank would otherwise sit out the timeout).
FAILURE_GRACE_S = 5.0
# Time given to a rank to write its stack dump (SIGUSR1, faulthandler) before it is killed.
STACK_DUMP_WAIT_S = 0.5
PROCESS_GROUP_TIMEOUT = timedelta(seconds=60)
KEEP_LOGS_VAR = "SHARDWISE_KEEP_RANK_LOGS"

_environ_lock = threading.Lock()


# --------------------------------------------------------------------------- helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _apply_overrides(target: dict[str, str] | os._Environ, overrides: Mapping[str, str | None]) -> None:
    for key, value in overrides.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = str(value)


@contextlib.contextmanager
def _patched_environ(overrides: Mapping[str, str | None]) -> Iterator[None]:
    """Set variables in os.environ for the duration (a spawned child inherits them at exec,
    before it imports anything, which matters for OMP_NUM_THREADS)."""
    with _environ_lock:
        saved = {key: os.environ.get(key) for key in overrides}
        try:
            _apply_overrides(os.environ, overrides)
            yield
        finally:
            _apply_overrides(os.environ, saved)


def _tail(text: str, lines: int) -> str:
    parts = text.splitlines()
    if len(parts) <= lines:
        return "\n".join(parts)
    return f"[... {len(parts) - lines} earlier lines]\n" + "\n".join(parts[-lines:])


def _read_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"[cannot read {path}: {exc}]"
    return _tail(text, lines) if text.strip() else "[empty]"


def _as_text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data


def _exit_description(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"exit code {code} (killed by {name})"
    return f"exit code {code}"


# ----------------------------------------------------------- process-tree handling


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def _process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc; just ``pid`` elsewhere)."""
    children = _children_by_parent()
    tree: list[int] = []
    stack = [pid]
    while stack:
        current = stack.pop()
        if current in tree:
            continue
        tree.append(current)
        stack.extend(children.get(current, ()))
    return tree


def environ_of(pid: int) -> dict[str, str]:
    """The environment of process `pid` ({} when it is gone or not ours to read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


def rank_of(pid: int) -> int | None:
    """The torchrun rank process `pid` is: RANK in its environment (a fresh rank), else its
    name ``sw-rank<r>`` (a rank torchrun forked: /proc shows the environment it was forked
    from); None for any other process."""
    rank = environ_of(pid).get("RANK")
    if rank is None:
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            rank = name[len("sw-rank"):] if name.startswith("sw-rank") else None
    return int(rank) if rank is not None and rank.isdigit() else None


def alive(pids: Sequence[int]) -> list[int]:
    """The processes of `pids` still running (a zombie counts as gone)."""
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(p)
        except OSError:
            pass
    return out


def _send(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def _kill_tree(pid: int) -> None:
    """SIGKILL a live (not yet reaped) process, its descendants and their process groups.

    The test runner's own process group is never signalled."""
    pids = _process_tree(pid)
    own_group = os.getpgrp()
    groups = set()
    for p in pids:
        with contextlib.suppress(OSError):
            group = os.getpgid(p)
            if group != own_group:
                groups.add(group)
    for p in pids:
        _send(p, signal.SIGKILL)
    for group in groups:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)


def _kill_group(pgid: int) -> None:
    """Kill what is left of a finished rank's process group (stray grandchildren)."""
    if pgid != os.getpgrp():
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


# ------------------------------------------------------------------- run_ranks


def _importable_name(fn: Callable[..., Any]) -> tuple[str, str]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    problem = None
    if not module or not qualname or "<" in qualname:
        problem = "it is not a module-level function"
    elif module == "__main__":
        problem = "it lives in __main__, which a spawned process cannot import"
    else:
        obj: Any = sys.modules.get(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is not fn:
            problem = f"{module}.{qualname} does not name it"
    if problem:
        raise TypeError(
            f"run_ranks needs a function importable by name in a fresh process; {fn!r}: "
            f"{problem}. Define it at module level and pass data through *args."
        )
    return module, qualname


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _error_payload(exc: BaseException, rank: int, note: str = "") -> dict[str, Any]:
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    text = "".join(traceback.format_exception(exc))
    if note:
        text += note + "\n"
    summary = "".join(traceback.format_exception_only(exc)).strip()
    print(f"[run_ranks] rank {rank} failed: {summary} (full traceback sent to the parent)",
          file=sys.stderr, flush=True)
    return {"ok": False, "error_type": name, "traceback": text}


def _write_result(payload: dict[str, Any], path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    torch.load(partial, weights_only=True)  # what the parent will do; fail here, on this rank
    os.replace(partial, path)


def _rank_entry(
    module: str,
    qualname: str,
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    init_pg: bool,
    result_path: str,
    log_path: str,
    env: dict[str, str | None],
) -> None:
    """Body of each rank (runs in the child, forked by the forkserver)."""
    # The forkserver's environment is the one it started with: this rank's variables are
    # set here, before anything reads them.
    _apply_overrides(os.environ, env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # Lead a process group of our own, so the parent can kill us with our children.
    with contextlib.suppress(OSError):
        os.setsid()
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)  # fd level: C++ output (gloo, c10d) lands in the log too
    os.dup2(log_fd, 2)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    result = Path(result_path)
    payload: dict[str, Any]
    try:
        fn = _resolve(module, qualname)
        import torch.distributed as dist

        if init_pg:
            dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
        try:
            value = fn(rank, world_size, *args)
        finally:
            if init_pg and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception as exc:  # don't hide the error of fn, if any
                    print(f"[run_ranks] destroy_process_group failed: {exc!r}", file=sys.stderr)
        payload = {"ok": True, "value": value}
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from fn are failures too
        payload = _error_payload(exc, rank)

    if payload["ok"]:
        try:
            _write_result(payload, result)
        except BaseException as exc:
            payload = _error_payload(
                exc,
                rank,
                "The return value must load with torch.load(weights_only=True): tensors, "
                "dicts, lists, tuples, numbers, strings, None (for a DTensor return "
                ".full_tensor()).",
            )
    if not payload["ok"]:
        _write_result(payload, result)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(0 if payload["ok"] else 1)


CLI_PRELOAD = ["shardwise.cli", "shardwise.jobs.commands", "shardwise.jobs.rl"]
"""What ``python -m shardwise.cli`` imports before it reads its config; `run_cli` forks its
commands from a server that has imported them."""

FORKSERVER_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
    "transformers.models.qwen3.modeling_qwen3", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe", "shardwise.engine.train", "shardwise.engine.infer",
    "shardwise.fsdp.build", "shardwise.checkpoint.dcp", *CLI_PRELOAD,
    "matplotlib.figure", "matplotlib.backends.backend_agg",
]
"""Modules the forkserver imports once; every rank is forked from it with them loaded (a
rank started from scratch spends ~5 s importing them, most of a small test's time). The
plot every train and rl command draws at its end imports matplotlib (~0.6 s of CPU a
command, the only import left to a forked command)."""

_context: Any = None


def _rank_context() -> Any:
    """A forkserver context whose server has imported `FORKSERVER_PRELOAD`. Each rank is a
    fresh process forked from that server (nothing of one test reaches the next), started
    with one OpenMP thread (the server is started with OMP_NUM_THREADS=1)."""
    global _context
    if _context is None:
        ctx = torch.multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([m for m in FORKSERVER_PRELOAD if importlib.util.find_spec(m.split(".")[0])])
        with _patched_environ({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
                [str(SRC_DIR), str(SRC_DIR.parent / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}):
            ctx.Process(target=_noop).start()  # starts the server under these variables
        _context = ctx
    return _context


def _noop() -> None:
    pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    init_pg: bool = False,
    env: Mapping[str, str | None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be a module-level function. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (free, per call),
    OMP_NUM_THREADS=1, then ``env`` on top. With ``init_pg`` the harness brackets ``fn``
    with a gloo ``init_process_group`` (60 s timeout) and ``destroy_process_group``.
    Stdout/stderr of each rank (fd level) go to a per-rank log file.

    Returns the ranks' return values, index = rank; they travel through ``torch.save`` /
    ``torch.load(weights_only=True)``. Raises AssertionError with every failing rank's
    traceback and every rank's log tail if a rank raises, dies without a result, or the
    timeout passes (then all ranks and their children are killed first).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    module, qualname = _importable_name(fn)
    label = f"run_ranks({module}.{qualname}, world_size={world_size})"
    workdir = Path(tempfile.mkdtemp(prefix=f"shardwise-ranks-{getattr(fn, '__name__', 'fn')}-"))
    port = free_port()
    base_env: dict[str, str | None] = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    ctx = _rank_context()
    procs: list[Any] = []
    log_paths = [workdir / f"rank{rank}.log" for rank in range(world_size)]
    result_paths = [workdir / f"rank{rank}.result.pt" for rank in range(world_size)]
    start = time.monotonic()
    ok = False
    try:
        for rank in range(world_size):
            rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank), **(env or {})}
            proc = ctx.Process(
                target=_rank_entry,
                args=(module, qualname, rank, world_size, args, init_pg,
                      str(result_paths[rank]), str(log_paths[rank]), rank_env),
                name=f"shardwise-rank{rank}",
            )
            with _patched_environ(rank_env):
                proc.start()
            procs.append(proc)

        unfinished, timed_out = _wait_for_ranks(procs, start + timeout)
        if unfinished:
            for rank in unfinished:  # ask for Python stacks of the stuck ranks first
                _send(procs[rank].pid, signal.SIGUSR1)
            _wait_for_sentinels([procs[r].sentinel for r in unfinished], STACK_DUMP_WAIT_S)
            for rank in unfinished:
                if procs[rank].exitcode is None:
                    _kill_tree(procs[rank].pid)
        for proc in procs:
            proc.join(10)
            _kill_group(proc.pid)  # stray grandchildren of ranks that did exit
        elapsed = time.monotonic() - start

        results, failure = _collect(procs, result_paths, unfinished, timed_out, timeout, elapsed)
        if failure is None:
            ok = True
            return results
        keep = "" if os.environ.get(KEEP_LOGS_VAR) else f" (removed; set {KEEP_LOGS_VAR}=1 to keep)"
        sections = [f"{label} failed after {elapsed:.1f} s: {failure}", f"rank logs: {workdir}{keep}"]
        for rank in range(world_size):
            sections.append(_rank_report(rank, procs[rank], result_paths[rank], log_paths[rank], unfinished))
        raise AssertionError("\n".join(sections))
    finally:
        for proc in procs:  # also on KeyboardInterrupt or an error in the harness itself
            if proc.exitcode is None:
                _kill_tree(proc.pid)
                proc.join(10)
        if ok or not os.environ.get(KEEP_LOGS_VAR):
            shutil.rmtree(workdir, ignore_errors=True)


def _wait_for_ranks(procs: Sequence[Any], deadline: float) -> tuple[list[int], bool]:
    """Wait until all ranks exited, the deadline passed, or FAILURE_GRACE_S after the first
    failure. Returns (ranks still running, whether the deadline was the cause)."""
    pending = set(range(len(procs)))
    first_failure: float | None = None
    while pending:
        now = time.monotonic()
        limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE_S)
        if now >= limit:
            return sorted(pending), limit == deadline
        _wait_for_sentinels([procs[r].sentinel for r in pending], limit - now)
        for rank in sorted(pending):
            code = procs[rank].exitcode
            if code is not None:
                pending.discard(rank)
                if code != 0 and first_failure is None:
                    first_failure = time.monotonic()
    return [], False


def _load(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not path.exists():
        return None, None
    try:
        return torch.load(path, weights_only=True), None
    except Exception as exc:
        return None, f"cannot load its result file {path}: {exc!r}"


def _collect(
    procs: Sequence[Any],
    result_paths: Sequence[Path],
    unfinished: Sequence[int],
    timed_out: bool,
    timeout: float,
    elapsed: float,
) -> tuple[list[Any], str | None]:
    results: list[Any] = []
    problems: list[str] = []
    for rank, proc in enumerate(procs):
        payload, load_error = _load(result_paths[rank])
        code = proc.exitcode
        if rank in unfinished:
            results.append(None)
            continue
        if load_error:
            problems.append(f"rank {rank} {load_error}")
        elif payload is None:
            problems.append(f"rank {rank} died without a result, {_exit_description(code)}")
        elif not payload["ok"]:
            problems.append(f"rank {rank} raised {payload['error_type']}")
        elif code != 0:
            problems.append(f"rank {rank} returned but then exited with {_exit_description(code)}")
        results.append(payload["value"] if payload and payload["ok"] else None)
    if unfinished:
        if timed_out:
            problems.insert(
                0, f"timed out after {timeout:.1f} s; ranks {list(unfinished)} had not finished "
                "(killed with their children)",
            )
        else:
            problems.append(
                f"ranks {list(unfinished)} had not finished {FAILURE_GRACE_S:.0f} s after the "
                "first failure (killed with their children)"
            )
    return results, ("; ".join(problems) if problems else None)


def _rank_report(rank: int, proc: Any, result_path: Path, log_path: Path, unfinished: Sequence[int]) -> str:
    payload, load_error = _load(result_path)
    if rank in unfinished:
        if payload is not None:
            status = "returned a result but did not exit (hung at interpreter exit?); killed"
        else:
            status = "had not finished; killed (its Python stacks, dumped on SIGUSR1, end the log)"
    elif load_error:
        status = load_error
    elif payload is None:
        status = f"died without a result, {_exit_description(proc.exitcode)}"
    elif not payload["ok"]:
        status = f"raised {payload['error_type']}, {_exit_description(proc.exitcode)}"
    else:
        status = f"returned, {_exit_description(proc.exitcode)}"
    lines = [f"\n===== rank {rank}: {status} ====="]
    if payload is not None and not payload["ok"]:
        lines += ["--- traceback ---", payload["traceback"].rstrip()]
    lines += [f"--- log tail ({log_path.name}) ---", _read_tail(log_path)]
    return "\n".join(lines)


# ------------------------------------------------------- torchrun and the CLI


def _subprocess_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    merged = dict(os.environ)
    merged["OMP_NUM_THREADS"] = "1"
    merged["PYTHONUNBUFFERED"] = "1"
    # shardwise is used from the src layout, not necessarily installed.
    paths = [str(SRC_DIR)] + [p for p in merged.get("PYTHONPATH", "").split(os.pathsep) if p]
    merged["PYTHONPATH"] = os.pathsep.join(paths)
    _apply_overrides(merged, env or {})
    return merged


def _timed_out(cmd: list[str], timeout: float, stdout: str, stderr: str) -> AssertionError:
    """The failure of a command the harness killed at its timeout, with its output's tail."""
    return AssertionError(
        f"timed out after {timeout:.1f} s, killed the process group and its descendants: {shlex.join(cmd)}\n"
        f"--- stdout (tail) ---\n{_tail(stdout, OUTPUT_TAIL_LINES)}\n"
        f"--- stderr (tail) ---\n{_tail(stderr, OUTPUT_TAIL_LINES)}")


def _run_killable(
    cmd: list[str],
    timeout: float,
    env: Mapping[str, str | None] | None,
    cwd: str | os.PathLike[str] | None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=_subprocess_env(env),
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)  # its group and every descendant, e.g. torchrun's workers
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired as exc:  # something escaped and holds the pipes
            stdout, stderr = _as_text(exc.stdout), _as_text(exc.stderr)
            proc.kill()
            for pipe in (proc.stdout, proc.stderr):
                with contextlib.suppress(Exception):
                    pipe.close()  # type: ignore[union-attr]
            proc.wait()
        raise _timed_out(cmd, timeout, _as_text(stdout), _as_text(stderr)) from None
    except BaseException:
        _kill_tree(proc.pid)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_torchrun(
    argv: Sequence[str],
    nproc: int,
    timeout: float = 300.0,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc-per-node nproc ... *argv`` on 127.0.0.1 and a
    free port, in a session of its own, output captured as text. Returns whatever the exit
    code; raises AssertionError (with the output tail) after killing everything on timeout."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        *map(str, argv),
    ]
    return _run_killable(cmd, timeout, env, cwd)


def run_cli(
    argv: Sequence[str],
    timeout: float = 120.0,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``python -m shardwise.cli *argv``, killable and captured like ``run_torchrun``.

    The command's process is forked from the harness's forkserver, which has imported
    shardwise's commands once (`CLI_PRELOAD`): a command started from scratch spends ~9 s
    of CPU importing torch, transformers and the jobs before it reads its config, in every
    test that runs one, which was most of the suite's time. The child is then what
    ``python -m shardwise.cli`` is: a process of its own, in a session of its own, with
    the environment, working directory, ``sys.argv``, stdin (/dev/null) and fds 1 / 2 of
    that command; it runs ``shardwise.cli`` as ``__main__`` (the RL controller under its
    supervisor, as there), waits for its threads, runs its atexit handlers and exits with
    the command's status (negative: the signal that ended it). The processes it starts
    (torchrun, ranks, Ray) are started as by the command. ``fresh=True`` starts a new
    interpreter instead, for tests of what only a fresh process shows (its imports'
    warnings on stderr, the command found from any directory)."""
    cmd = [sys.executable, "-m", "shardwise.cli", *map(str, argv)]
    if fresh:
        return _run_killable(cmd, timeout, env, cwd)
    workdir = Path(tempfile.mkdtemp(prefix="shardwise-cli-"))
    out_path, err_path = workdir / "stdout", workdir / "stderr"
    child_env = _subprocess_env(env)
    ctx = _rank_context()
    with _start_lock:
        proc = ctx.Process(target=_cli_entry, args=(cmd[3:], str(Path(cwd or os.getcwd()).resolve()), child_env,
                                                    str(out_path), str(err_path)))
        proc.start()
    try:
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            _kill_tree(proc.pid)  # its group and every descendant, e.g. torchrun's workers
            proc.join(10)
        stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out_path, err_path))
        if timed_out:
            raise _timed_out(cmd, timeout, stdout, stderr)
    except BaseException:
        if proc.exitcode is None:
            _kill_tree(proc.pid)
            proc.join(10)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)


_start_lock = threading.Lock()
"""Commands started side by side (`at_once`) ask the forkserver one at a time."""


def _cli_entry(argv: list[str], cwd: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    """Body of a `run_cli` command (in the child, forked by the forkserver): become
    ``python -m shardwise.cli *argv`` and end as that process would."""
    from shardwise.distributed.torchrun import exec_module

    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if sys.path and sys.path[0] in ("", "."):  # `python -m`: the working directory, in full
        sys.path[0] = cwd
    else:
        sys.path.insert(0, cwd)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        if fd == 2 and err_path == out_path:  # one file for both, as 2>&1
            os.dup2(1, 2)
            continue
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)  # fd level: what torchrun and the ranks print lands there too
        os.close(new)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    exec_module("shardwise.cli", argv)  # as the forked ranks of `shardwise train` run theirs


def run_python(
    argv: Sequence[str],
    timeout: float = 120.0,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python *argv`` (a script and its arguments, e.g. a benchmark), killable and captured
    like ``run_torchrun``."""
    return _run_killable([sys.executable, *map(str, argv)], timeout, env, cwd)


class _Forked:
    """What `Background` uses of a ``subprocess.Popen``, for a command forked as `run_cli`
    forks one (its exit status comes from the forkserver, which reaps it)."""

    def __init__(self, process: Any):
        self._process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"shardwise (pid {self.pid})", timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


class Background:
    """``python -m shardwise.cli *argv`` in the background, in a session of its own, its
    output (stdout and stderr) in the file `out_path`. Forked as `run_cli` forks its
    commands (the same process, without ~9 s of imports); ``fresh=True``: a new interpreter."""

    def __init__(self, argv: Sequence[str], out_path: str | os.PathLike[str], env: Mapping[str, str] | None = None,
                 fresh: bool = False):
        self.out = open(out_path, "w+")
        child_env = {**os.environ, "PYTHONPATH": str(SRC_DIR), "OMP_NUM_THREADS": "1", **(env or {})}
        if fresh:
            self.proc: subprocess.Popen[bytes] | _Forked = subprocess.Popen(
                [sys.executable, "-m", "shardwise.cli", *map(str, argv)], stdout=self.out, stderr=subprocess.STDOUT,
                start_new_session=True, env=child_env)
            return
        with _start_lock:
            process = _rank_context().Process(target=_cli_entry, args=(
                [str(a) for a in argv], str(Path.cwd()), child_env, str(out_path), str(out_path)))
            process.start()
        self.proc = _Forked(process)

    def pids(self) -> list[int]:
        return _process_tree(self.proc.pid)

    def output(self) -> str:
        """The last 4000 characters of its output so far."""
        self.out.flush()
        self.out.seek(0)
        return self.out.read()[-4000:]

    def close(self) -> None:
        _kill_tree(self.proc.pid)
        self.proc.wait()
        self.out.close()


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """Call each of ``calls`` in a thread of its own, all at once; their results in order.
    Every call runs to its end (each command has its own timeout) before the first
    exception, if any, is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
    return [f.result() for f in futures]
