"""Paths a job writes to, as the filesystem will see them when it writes.

``runs/new/../other`` cannot be looked at while ``runs/new`` does not exist: every check
(is it a folder, does it hold files, whose checkpoint is in it) sees nothing there. The
writer then creates ``runs/new`` (``mkdir(parents=True)``) and writes into ``runs/other``,
another model's or another run's folder, which the same check refuses when it is named
directly. So a path with a ``..`` part is resolved before it is checked and used
(`resolve_dots`), and the check and the writes see the same folder. A leading ``~`` is the
home folder, as for every path a job reads (`out_path`): ``run.dir=~/runs/x`` on a command
line, where the shell does not expand it, wrote into a folder literally named ``~``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["out_path", "resolve_dots"]


def resolve_dots(path: str | os.PathLike[str]) -> str:
    """`path` unchanged when it has no ``..`` part; otherwise the folder it leads to, as
    `os.path.realpath` finds it (symlinks followed as the OS follows them, missing parts
    taken as plain folders, as ``mkdir(parents=True)`` would create them); a relative path
    stays relative to the working directory when it leads inside it (``runs/new/../other``
    -> ``runs/other``), an absolute one absolute."""
    text = os.fspath(path)
    if ".." not in Path(text).parts:
        return text
    real = Path(os.path.realpath(text))
    if Path(text).is_absolute():
        return str(real)
    try:
        return str(real.relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(real)


def out_path(path: str | os.PathLike[str]) -> str:
    """A folder or file a job writes (run.dir, infer.output): ``~`` expanded, then
    `resolve_dots`."""
    return resolve_dots(os.path.expanduser(os.fspath(path)))
