"""Where a command's start-up goes: seconds per part, from the command's launch to its first step.

A `StartupClock` is a timeline of laps: ``clock.lap("ray")`` charges the seconds since the
previous lap (or since the launch) to the part ``ray``, so the parts are consecutive and
add up to the time since the launch at the last lap. `split` moves seconds of a part to
sub-parts measured elsewhere (the model load a worker timed inside the part
``worker_groups``), keeping the sum. `metrics` gives ``time/startup/<part>`` and
``time/startup/total`` (the launch to now; the parts add up to no more than it).

The launch is when the command's process started (`launched_at`: Linux's record of it, or
the clock's creation elsewhere); under a supervising parent (`shardwise.jobs.supervisor`,
which forks the command's controller) the parent's start, i.e. the command's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from shardwise.telemetry import activity

__all__ = ["StartupClock", "launched_at", "process_started_at"]

PREFIX = "time/startup/"


def process_started_at(pid: int | str = "self") -> float | None:
    """Wall-clock time (seconds since the epoch) at which process `pid` started, from
    ``/proc`` (10 ms resolution); None where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        now = time.time()
        return now - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def launched_at() -> float | None:
    """When the command began: this process's start, or its supervising parent's when
    `shardwise.jobs.supervisor` forked this process off it; None where unknown."""
    if activity.installed() is not None:  # the forked controller of a supervised command
        parent = process_started_at(os.getppid())
        if parent is not None:
            return parent
    return process_started_at()


class StartupClock:
    """Consecutive start-up parts in seconds (see the module docstring). `launched`: the
    launch's wall-clock time (None: now)."""

    def __init__(self, launched: float | None = None):
        now = time.time()
        self.launched = now if launched is None or launched > now else launched
        self._last = self.launched
        self.parts: dict[str, float] = {}

    def lap(self, part: str) -> float:
        """Charge the seconds since the previous lap to `part` (added to what it has);
        returns them."""
        now = time.time()
        seconds = max(now - self._last, 0.0)
        self._last = now
        self.parts[part] = self.parts.get(part, 0.0) + seconds
        return seconds

    def split(self, part: str, sub_parts: dict[str, float]) -> None:
        """Move `sub_parts` (name -> seconds, measured inside `part`) out of `part`; what
        they claim beyond `part`'s seconds is cut in proportion, so the sum is kept."""
        have = self.parts.get(part, 0.0)
        claimed = sum(max(v, 0.0) for v in sub_parts.values())
        scale = min(1.0, have / claimed) if claimed > 0 else 0.0
        for name, seconds in sub_parts.items():
            self.parts[name] = self.parts.get(name, 0.0) + max(seconds, 0.0) * scale
        self.parts[part] = have - claimed * scale

    def total(self) -> float:
        """Seconds since the launch."""
        return max(time.time() - self.launched, 0.0)

    def metrics(self) -> dict[str, float]:
        """``time/startup/<part>`` for every part and ``time/startup/total`` (the launch to now)."""
        out = {f"{PREFIX}{k}": v for k, v in self.parts.items()}
        out[f"{PREFIX}total"] = self.total()
        return out
