"""Scalar metrics of a run: one JSON line per `log` call, plus TensorBoard when installed.

File format (``run_dir/metrics.jsonl``): each line is one JSON object
``{"step": int, <metric>: number | str | bool, ..., "time": unix seconds (float)}``.

Non-finite rule: JSON has no NaN or infinity, so a non-finite float is written as the
string ``"nan"``, ``"inf"`` or ``"-inf"``. `read_metrics` turns exactly those three strings
back into floats, so a round trip gives ``float("nan")`` etc. (a string metric whose value
is literally one of those three words reads back as a float too).

Only the writer built with ``enabled=True`` touches the disk; the caller passes
``rank == 0`` so that N ranks do not write N copies. On other ranks `log` is a no-op and
does not even read its values (reading a CUDA tensor would force a device sync).
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["MetricsWriter", "drop_steps_after", "read_metrics", "to_json_value", "NONFINITE_STRINGS"]

logger = logging.getLogger(__name__)

MetricValue = float | int | str | bool

# The string written for each non-finite float; `read_metrics` inverts this table.
NONFINITE_STRINGS: dict[str, float] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

_RESERVED_KEYS = ("step", "time")


def to_json_value(key: str, value: Any) -> MetricValue:
    """One metric value as a JSON-safe Python value.

    Python ``int``/``float``/``str``/``bool`` pass through; anything with ``.item()`` that
    holds a single element (a 0-d or 1-element torch tensor, a numpy scalar or array) is
    converted with ``.item()``. A non-finite float becomes ``"nan"``/``"inf"``/``"-inf"``.
    Raises ``TypeError`` for any other value, naming `key`.
    """
    if not isinstance(value, (bool, int, float, str)) and callable(getattr(value, "item", None)):
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:  # more than one element
            shape = tuple(getattr(value, "shape", ()))
            raise TypeError(
                f"metric '{key}' must be a scalar; got a value of shape {shape} "
                "(reduce it first, e.g. .mean())"
            ) from exc
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    raise TypeError(
        f"metric '{key}' has type {type(value).__name__}; log a number, a string or a "
        "scalar tensor"
    )


def _tensorboard_writer_class() -> type | None:
    """`torch.utils.tensorboard.SummaryWriter`, or None when the tensorboard package is absent."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module imports the `tensorboard` package at import time
        return None
    return SummaryWriter


class MetricsWriter:
    """Appends scalar metrics to ``run_dir/filename`` (JSON lines) and to TensorBoard.

    Args:
        run_dir: directory of the run; created if missing (only when enabled).
        enabled: whether this process writes. Pass ``rank == 0``.
        filename: name of the JSON-lines file inside `run_dir`.
        tensorboard: also write scalars to ``run_dir/tensorboard/`` when the tensorboard
            package is importable. Without it this is silently a no-op (logged at INFO),
            since the default is on and most runs do not install it.

        after_step: the step the run starts after (0 for a fresh run, the checkpoint's step
            for a resumed one). Lines of later steps already in the file are dropped first:
            the run is about to log those steps again, and each step must appear once.
            None keeps the file as it is.

    The file is opened in append mode, so a resumed run continues the same file; each line
    is flushed as it is written, so a crash of the process loses no logged line.
    Use as a context manager or call `close`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        enabled: bool,
        filename: str = "metrics.jsonl",
        tensorboard: bool = True,
        after_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.enabled = bool(enabled)
        self.path = self.run_dir / filename
        """Path of the JSON-lines file (written only when enabled)."""
        self.tensorboard_dir: Path | None = None
        """``run_dir/tensorboard`` when TensorBoard scalars are being written, else None."""
        self._file: IO[str] | None = None
        self._tb: Any = None
        self._closed = False
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if after_step is not None:
            drop_steps_after(self.path, after_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            writer_class = _tensorboard_writer_class()
            if writer_class is None:
                logger.info("tensorboard is not installed; metrics go to %s only", self.path)
            else:
                self.tensorboard_dir = self.run_dir / "tensorboard"
                self._tb = writer_class(log_dir=str(self.tensorboard_dir))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one line ``{"step": step, **metrics, "time": now}``.

        `metrics` maps a name to a number, string, bool or single-element tensor/array;
        the names ``step`` and ``time`` are reserved. Strings and bools are not sent to
        TensorBoard (it only takes numbers); non-finite floats follow the module's rule.
        No-op when the writer is disabled.
        """
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError(f"MetricsWriter for {self.path} is closed")
        assert self._file is not None
        step = operator.index(step)
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be strings; got {key!r}")
            if key in _RESERVED_KEYS:
                raise ValueError(f"metric name '{key}' is reserved; rename it")
            record[key] = to_json_value(key, value)
        now = time.time()
        record["time"] = now
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key in _RESERVED_KEYS or isinstance(value, bool):
                    continue
                if isinstance(value, str):
                    if value not in NONFINITE_STRINGS:
                        continue
                    value = NONFINITE_STRINGS[value]
                self._tb.add_scalar(key, value, global_step=step, walltime=now)

    def close(self) -> None:
        """Flush and close the file and the TensorBoard writer. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def drop_steps_after(path: str | os.PathLike[str], step: int) -> int:
    """Rewrite the metrics file `path` without the lines of steps after `step` (and without
    a truncated last line); returns how many lines were dropped. A missing file is fine."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            record = None  # a line cut by a crash
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file, in file order.

    `path` is the JSON-lines file or a run directory holding ``metrics.jsonl``. The strings
    ``"nan"``, ``"inf"``, ``"-inf"`` become floats again. A truncated last line (the
    process died while writing it) is dropped with a warning; a bad line elsewhere raises
    ``ValueError`` with its line number.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: dropping truncated last line", stacklevel=2)
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {line[:80]!r}")
        records.append(
            {
                k: NONFINITE_STRINGS[v] if isinstance(v, str) and v in NONFINITE_STRINGS else v
                for k, v in record.items()
            }
        )
    return records
