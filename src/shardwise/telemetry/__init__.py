"""Telemetry: metrics file and experiment trackers, progress bar, phase timings, plots.

Everything that writes is enabled on rank 0 only; the caller passes ``rank == 0``.
`plot_metrics` imports matplotlib on first use, not here.
"""

from shardwise.telemetry.metrics import MetricsWriter, read_metrics
from shardwise.telemetry.plots import plot_metrics, val_panels
from shardwise.telemetry.progress import PhaseTimer, Progress, peak_memory_bytes
from shardwise.telemetry.trackers import Tracker, TrackerRun, open_trackers

__all__ = [
    "MetricsWriter",
    "PhaseTimer",
    "Progress",
    "Tracker",
    "TrackerRun",
    "peak_memory_bytes",
    "plot_metrics",
    "val_panels",
    "open_trackers",
    "read_metrics",
]
