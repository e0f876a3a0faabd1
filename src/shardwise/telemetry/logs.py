"""Other libraries' output goes to ``run.dir/logs/``; the console keeps shardwise's own lines.

vLLM, torch, transformers and Ray warn about things meant for their own developers
(Triton without a CPU backend, deprecated torch.distributed names, NUMA binding, Ray's
token authentication): on the console they bury the lines the user needs. Each process of
`shardwise rl` writes them to a file of its own under ``run.dir/logs/``:

- a Ray worker (`capture_worker_stderr`, `console_logger`): the process's stderr (fd 2,
  where Python's warnings, the logging handlers and torch's C++ warnings write) is the
  file ``<group>-rank<i>.log``; the ``shardwise`` logger and shardwise's own warnings
  write to the original stderr, which Ray forwards to the console;
- the controller (`ThirdPartyToFile`): its stderr also carries the progress bar and the
  error lines, so it stays; for the run, the third-party loggers (`THIRD_PARTY_LOGGERS`)
  and the warnings libraries issue go to ``controller.log``.

A warning is shardwise's (or the user's, e.g. from a reward function) by the code that
issued it (`is_ours`), and stays on the console.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import TextIO

__all__ = ["THIRD_PARTY_LOGGERS", "ThirdPartyToFile", "capture_worker_stderr", "console_logger", "is_ours",
           "route_warnings"]

THIRD_PARTY_LOGGERS = ("vllm", "torch", "transformers", "ray", "huggingface_hub")
"""Loggers whose records go to the log file, not the console (their children included)."""


def _library_dirs() -> tuple[str, ...]:
    """The folders installed libraries and the standard library live in."""
    paths = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted({os.path.realpath(p) + os.sep for p in paths if p}))


def is_ours(frame=None) -> bool:
    """Whether the code that issued the warning being shown is shardwise's or the user's
    (a reward function, a script), not a library's: the first frame outside the warnings
    machinery (and this module) is in a ``shardwise`` module, or in a file outside the
    installed libraries and the standard library. A warning a library raises when
    shardwise calls it is the library's."""
    frame = frame or inspect.currentframe()
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name not in ("warnings", __name__):
            if name == "shardwise" or name.startswith("shardwise."):
                return True
            file = frame.f_code.co_filename
            return not file.startswith("<") and not os.path.realpath(file).startswith(_library_dirs())
        frame = frame.f_back
    return False


def route_warnings(console: TextIO | None, log: TextIO):
    """Show shardwise's warnings on `console` (None: whatever ``sys.stderr`` is when one is
    shown) and every other warning in `log`; returns the `warnings.showwarning` it replaced
    (put it back to undo)."""
    previous = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line)
        stream = file if file is not None else ((console or sys.stderr) if is_ours() else log)
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):  # a closed stream: the warning is lost, the job is not
            pass

    warnings.showwarning = showwarning
    return previous


def _open(path: str | os.PathLike[str]) -> TextIO:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", buffering=1, encoding="utf-8", errors="replace")


def capture_worker_stderr(path: str | os.PathLike[str]) -> TextIO:
    """In a Ray worker process: fd 2 (and so ``sys.stderr``, torch's C++ warnings and the
    processes it starts) writes to `path` from now on; returns a stream on the original
    stderr, which Ray forwards to the driver's console. Warnings issued by shardwise (or
    user code, `is_ours`) go to that stream, the others to the file."""
    log = _open(path)
    sys.stderr.flush()
    console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(log.fileno(), 2)
    log.close()  # fd 2 holds the file now
    route_warnings(console, sys.stderr)
    return console


def console_logger(console: TextIO, fmt: str, level: int) -> None:
    """The ``shardwise`` logger's lines also go to `console` (after `capture_worker_stderr`;
    they still reach the root logger's handlers, i.e. the log file)."""
    handler = logging.StreamHandler(console)
    handler.setFormatter(logging.Formatter(fmt))
    handler.setLevel(level)
    logging.getLogger("shardwise").addHandler(handler)


def _third_party(name: str) -> bool:
    return any(name == top or name.startswith(top + ".") for top in THIRD_PARTY_LOGGERS)


class _LastResort(logging.Handler):
    """`logging.lastResort` while `ThirdPartyToFile` is on (the handler of records no
    handler takes): a third-party record goes to `file`; any other goes on to the handler
    it replaced (a warning or worse: its message, on stderr), as before."""

    def __init__(self, file: logging.Handler, previous: logging.Handler | None) -> None:
        super().__init__()
        self.file = file
        self.previous = previous

    def emit(self, record: logging.LogRecord) -> None:
        if _third_party(record.name):
            self.file.handle(record)
        elif self.previous is not None and record.levelno >= self.previous.level:
            self.previous.handle(record)


class ThirdPartyToFile:
    """For the ``with`` block: the records of `THIRD_PARTY_LOGGERS` and the warnings
    libraries issue (`is_ours`) go to the file `path` instead of the console (stderr); put
    back on exit. For the controller process, whose stderr stays the console's.

    The libraries' loggers lose their own handlers and propagate; where no handler of the
    application takes their records (the command-line process configures none), the
    handler of last resort sends them to the file. A library that resets its logger later
    (Ray's import gives ``ray`` a stderr handler; ``ray.init`` removes it again, then warns)
    still ends there."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
        self._file: TextIO | None = None
        self._last_resort: logging.Handler | None = None
        self._showwarning = None

    def __enter__(self) -> ThirdPartyToFile:
        self._file = _open(self.path)
        handler = logging.StreamHandler(self._file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._last_resort = logging.lastResort
        logging.lastResort = _LastResort(handler, self._last_resort)
        for name in THIRD_PARTY_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, list(logger.handlers), logger.propagate))
            logger.handlers = []
            logger.propagate = True
        self._showwarning = route_warnings(None, self._file)
        return self

    def __exit__(self, *exc: object) -> None:
        warnings.showwarning = self._showwarning
        logging.lastResort = self._last_resort
        for logger, handlers, propagate in self._saved:
            logger.handlers = handlers
            logger.propagate = propagate
        self._saved.clear()
        if self._file is not None:
            self._file.close()
