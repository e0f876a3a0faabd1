"""User-facing errors.

A user mistake raises one of these with a message that says what to change; the CLI
prints the message (no traceback) and exits with status 2. Internal impossibilities are
asserts, not these.
"""

from __future__ import annotations

import difflib
import reprlib
import shutil
from collections.abc import Iterable
from pathlib import Path


class ShardwiseError(Exception):
    """Base of all errors a user can fix by changing their input.

    Instances pickle by their message alone (`__reduce__`), whatever a subclass's
    constructor takes, so an error raised in a rank or a Ray worker reaches the launcher or
    the controller as itself, with its type and message intact.
    """

    exit_status = 2
    """The command's exit status when this error ends it (docs/failures.md: exit statuses)."""

    def __reduce__(self):
        return _rebuild, (type(self), str(self), dict(self.__dict__))


EXIT_DISK_FULL = 74
"""A checkpoint or export could not be written for want of disk space (sysexits' EX_IOERR)."""


class DiskFullError(ShardwiseError, OSError):
    """The disk filled up while the run wrote its state; what was committed before is intact."""

    exit_status = EXIT_DISK_FULL


def as_disk_full(exc: BaseException) -> BaseException:
    """`exc`, or for an OSError of a full disk (ENOSPC, e.g. writing metrics.jsonl once a
    checkpoint filled the disk) a `DiskFullError` naming the file: its own exit status and
    one line instead of a traceback."""
    if isinstance(exc, OSError) and not isinstance(exc, DiskFullError) and exc.errno == 28:
        where = f" writing {exc.filename}" if exc.filename else ""
        return DiskFullError(f"no space left on device{where}; checkpoints already committed are intact (free "
                             "space, or move run.dir to a larger disk, and run the same command to resume)")
    return exc


def _rebuild(cls: type[ShardwiseError], message: str, state: dict) -> ShardwiseError:
    """An error of class `cls` carrying `message` and attributes `state`, without calling
    its constructor."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


QUOTE_LIMIT = 200
"""Most characters of a user's value an error message quotes (`short_repr`)."""


def short_repr(value: object, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)`, cut to at most `limit` characters: an error line quotes a value, never
    a whole file's worth of it."""
    text = reprlib_repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reprlib_repr(value: object) -> str:
    """repr of a value that may be large: containers are abbreviated before they are
    formatted (a list of 20,000 values is not rendered whole to be cut)."""
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 50:
        r = reprlib.Repr()
        r.maxlist = r.maxtuple = r.maxdict = r.maxset = 20
        r.maxstring = r.maxother = QUOTE_LIMIT
        r.maxlevel = 4
        return r.repr(value)
    return repr(value)


class ConfigError(ShardwiseError, ValueError):
    """A config key has a bad value, or keys disagree.

    `key` is the dotted path of the offending key (e.g. ``fsdp.reshard_after_forward``).
    """

    def __init__(self, key: str, problem: str, hint: str | None = None):
        # A key or problem quoting a user's value is cut (callers quote with `short_repr`;
        # this is the last guard): the error is one readable line, never a file's worth.
        key, problem = _cut(key, QUOTE_LIMIT * 2), _cut(problem, QUOTE_LIMIT * 5)
        hint = None if hint is None else _cut(hint, QUOTE_LIMIT * 5)
        self.key = key
        self.problem = problem
        self.hint = hint
        msg = f"config error at '{key}': {problem}" if key else f"config error: {problem}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 20] + " ... " + text[-15:]


class DataError(ShardwiseError, ValueError):
    """A data source, a record key, a task name or a length does not fit.

    A `ValueError` too, so callers that only know the builtin hierarchy catch it.
    """


class CheckpointError(ShardwiseError, ValueError):
    """A checkpoint folder is missing files, fails its checksums or cannot be read."""


class PatternError(ConfigError):
    """A module path pattern is malformed or matches nothing."""


def nearest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The closest spellings of `word` among `choices`, best first (maybe empty)."""
    choices = list(dict.fromkeys(choices))
    word = word[:QUOTE_LIMIT]  # a near name is short; a long value is compared by its start
    found = difflib.get_close_matches(word, choices, n=n, cutoff=0.5)
    if not found:
        low = word.lower()
        found = [c for c in choices if low and (low in c.lower() or c.lower() in low)][:n]
    return found


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str | None:
    """'did you mean X?' for the nearest choice, or a list of valid choices when none is near."""
    choices = list(choices)
    found = nearest(word, choices, n=1)
    if found:
        return f"did you mean {prefix}{found[0]}?"
    if choices and len(choices) <= 12:
        return "valid: " + ", ".join(prefix + c for c in choices)
    return None


def free_bytes(folder: Path) -> int | None:
    """Bytes free on the disk holding `folder` (its nearest existing parent); None if unknown."""
    for p in (folder, *folder.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def human_bytes(n: int | None) -> str:
    """`n` bytes in words for a line: "512 B", "3.4 MiB"; "unknown" for None."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
