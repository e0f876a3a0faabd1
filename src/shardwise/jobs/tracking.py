"""A job's metrics writer: ``run.dir/metrics.jsonl`` and the trackers of ``run.loggers``.

The one place that reads ``run.loggers``, ``run.name`` and ``run.project``. The writer
is enabled on rank 0 of `shardwise train` / `shardwise infer` and in the controller of
`shardwise rl`; every other rank gets a disabled one (no tracker is started there).
"""

from __future__ import annotations

from pathlib import Path

from shardwise.config.schema import Config
from shardwise.telemetry import MetricsWriter, TrackerRun, open_trackers

__all__ = ["open_metrics"]


def open_metrics(cfg: Config, enabled: bool, after_step: int | None, jsonl: bool = True) -> MetricsWriter:
    """The job's writer, its trackers started and given the resolved config.

    `after_step`: the step the job starts after (0: a fresh run, > 0: resumed from that
    checkpoint, which continues the trackers' runs). `jsonl`: write metrics.jsonl (False
    for a job without steps, `infer`: the trackers get its config and summary only).
    """
    run_dir = Path(cfg.run.dir)
    trackers = []
    if enabled:
        name = cfg.run.name or run_dir.resolve().name
        trackers = open_trackers(cfg.run.loggers, TrackerRun(run_dir, name, cfg.run.project, after_step))
    writer = MetricsWriter(run_dir, enabled=enabled, filename="metrics.jsonl" if jsonl else None,
                           after_step=after_step, trackers=trackers)
    writer.log_config(cfg.model_dump(by_alias=True, mode="json"))
    return writer

