"""Scalar metrics of a run: one JSON line per `log` call, and the same numbers to the run's
experiment trackers (TensorBoard, wandb, MLflow: `shardwise.telemetry.trackers`).

File format (``run_dir/metrics.jsonl``): each line is one JSON object
``{"step": int, <metric>: number | str | bool, ..., "time": unix seconds (float)}``.

Non-finite rule: JSON has no NaN or infinity, so a non-finite float is written as the
string ``"nan"``, ``"inf"`` or ``"-inf"``. `read_metrics` turns exactly those three strings
back into floats, so a round trip gives ``float("nan")`` etc. (a string metric whose value
is literally one of those three words reads back as a float too).

Only the writer built with ``enabled=True`` touches the disk; the caller passes
``rank == 0`` so that N ranks do not write N copies. On other ranks `log` is a no-op and
does not even read its values (reading a CUDA tensor would force a device sync).

A tracker that raises (a full disk, a server gone) is switched off for the rest of the run
with one warning; the file keeps every step and the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from shardwise.telemetry.trackers import TensorBoardTracker, Tracker, TrackerRun, tensorboard_writer_class

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
    return tensorboard_writer_class()


class MetricsWriter:
    """Appends scalar metrics to ``run_dir/filename`` (JSON lines) and sends them to trackers.

    Args:
        run_dir: directory of the run; created if missing (only when enabled).
        enabled: whether this process writes. Pass ``rank == 0``.
        filename: name of the JSON-lines file inside `run_dir`; None: no file, the
            trackers alone (a job without steps, which sends them its config and summary).
        tensorboard: also write scalars to ``run_dir/tensorboard/`` when the tensorboard
            package is importable. Without it this is silently a no-op (logged at INFO).
            The jobs pass their trackers instead (``run.loggers``).
        after_step: the step the run starts after (0 for a fresh run, the checkpoint's step
            for a resumed one). Lines of later steps already in the file are dropped first:
            the run is about to log those steps again, and each step must appear once.
            None keeps the file as it is.
        trackers: started experiment trackers (`shardwise.telemetry.trackers.open_trackers`);
            the writer owns them from here and closes them in `close`.

    The file is opened in append mode, so a resumed run continues the same file; each line
    is flushed as it is written, so a crash of the process loses no logged line. Use as a
    context manager (an exception closes the trackers as failed) or call `close`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        enabled: bool,
        filename: str | None = "metrics.jsonl",
        tensorboard: bool = False,
        after_step: int | None = None,
        trackers: Sequence[Tracker] = (),
    ):
        self.run_dir = Path(run_dir)
        self.enabled = bool(enabled)
        self.path = self.run_dir / (filename or "metrics.jsonl")
        """Path of the JSON-lines file (written only when enabled and `filename` is given)."""
        self.tensorboard_dir: Path | None = None
        """``run_dir/tensorboard`` when TensorBoard scalars are being written, else None."""
        self.trackers: list[Tracker] = []
        """The trackers still on (one that raised is dropped)."""
        self._file: IO[str] | None = None
        self._closed = False
        if not self.enabled:
            assert not trackers, "trackers are started on the rank that writes only"
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if filename is not None:
            if after_step is not None:
                drop_steps_after(self.path, after_step)
            self._file = open(self.path, "a", encoding="utf-8")
        self.trackers = list(trackers)
        if tensorboard:
            writer_class = _tensorboard_writer_class()
            if writer_class is None:
                logger.info("tensorboard is not installed; metrics go to %s only", self.path)
            else:
                run = TrackerRun(self.run_dir, self.run_dir.name, None, after_step)
                self.trackers.append(TensorBoardTracker(run, writer_class))
        for tracker in self.trackers:
            if isinstance(tracker, TensorBoardTracker):
                self.tensorboard_dir = tracker.log_dir

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one line ``{"step": step, **metrics, "time": now}``.

        `metrics` maps a name to a number, string, bool or single-element tensor/array;
        the names ``step`` and ``time`` are reserved. Strings and bools are not sent to
        the trackers (they take numbers); a non-finite float goes to them as a float.
        No-op when the writer is disabled.
        """
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError(f"MetricsWriter for {self.path} is closed")
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
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self.trackers:
            numbers: dict[str, float | int] = {}
            for key, value in record.items():
                if key in _RESERVED_KEYS or isinstance(value, bool):
                    continue
                if isinstance(value, str):
                    if value not in NONFINITE_STRINGS:
                        continue
                    value = NONFINITE_STRINGS[value]
                numbers[key] = value
            self._each(f"at step {step}", lambda t: t.log_metrics(step, numbers, now))

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Send the resolved config (nested JSON values) to the trackers; no-op when disabled."""
        if self.enabled and not self._closed:
            self._each("with the config", lambda t: t.log_config(config))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Send the run's summary (nested JSON values) to the trackers; no-op when disabled."""
        if self.enabled and not self._closed:
            self._each("with the summary", lambda t: t.log_summary(summary))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Send an evaluation's sample rows (the caller passes the first
        ``eval.samples_logged``) to the trackers that take tables or text; no-op when
        disabled or when `rows` is empty. The file of every sample is the caller's
        (`shardwise.engine.evaluate.write_samples`)."""
        if self.enabled and not self._closed and rows:
            step = operator.index(step)
            self._each(f"with the samples of step {step}", lambda t: t.log_samples(step, rows))

    def _each(self, when: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must not end the run
                self.trackers.remove(tracker)
                logger.warning("%s failed %s (%s: %s); it is off for the rest of this run, %s has every step",
                               tracker.name, when, type(exc).__name__, exc, self.path)
                with contextlib.suppress(Exception):  # it has already failed once, and said so
                    tracker.close(failed=True)

    def close(self, failed: bool = False) -> None:
        """Flush and close the file, and end the trackers' runs (as failed when `failed`).
        Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:  # noqa: BLE001
                logger.warning("%s failed while closing (%s: %s)", tracker.name, type(exc).__name__, exc)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)


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
