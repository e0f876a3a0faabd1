"""Progress bar, peak memory and per-phase wall-clock timings."""

from __future__ import annotations

import math
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from tqdm import tqdm

__all__ = ["Heartbeat", "Progress", "PhaseTimer", "peak_memory_bytes", "format_postfix_value"]


def format_postfix_value(value: Any) -> str:
    """A compact text for one postfix value: ``2.345``, ``3.00e-04``, ``12.3k``, ``7``.

    Single-element tensors/arrays are read with ``.item()``. Floats keep 4 significant
    digits; magnitudes of 10,000 and up use an SI suffix (k, M, G, ...), under 0.001 use
    scientific notation.
    """
    if not isinstance(value, (bool, int, float, str)) and callable(getattr(value, "item", None)):
        value = value.item()
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 100_000 else tqdm.format_sizeof(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 10_000:
            return ("-" if value < 0 else "") + tqdm.format_sizeof(abs(value))
        if value == 0 or abs(value) >= 1e-3:
            return f"{value:.4g}"
        return f"{value:.2e}"
    return str(value)


class Progress:
    """A tqdm bar on stderr, shown only when `enabled` (pass ``rank == 0``).

    Args:
        total: number of steps the bar counts to.
        enabled: whether this process draws the bar; otherwise every method is a no-op.
        desc: label in front of the bar.
        initial: steps already done (a resumed run); the rate and ETA count only new steps.
        mininterval: seconds between redraws. Default: 0.1 on a terminal; 30 when stderr
            is a file or pipe, where each redraw is a new line of the log.

    ``update(n, loss=2.31, **{"tok/s": 5.1e4})`` advances the bar and replaces the
    postfix (names that are not identifiers go through ``**{...}``). The elapsed time,
    rate and ETA come from tqdm.
    """

    def __init__(
        self,
        total: int,
        enabled: bool,
        desc: str,
        initial: int = 0,
        mininterval: float | None = None,
    ):
        self.enabled = bool(enabled)
        self._bar: tqdm | None = None
        if not self.enabled:
            return
        stream = sys.stderr  # looked up now so that a redirected stderr is honoured
        if mininterval is None:
            isatty = getattr(stream, "isatty", None)
            mininterval = 0.1 if isatty is not None and isatty() else 30.0
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            file=stream,
            mininterval=mininterval,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    @property
    def n(self) -> int:
        """Steps counted so far, `initial` included (0 when disabled)."""
        return 0 if self._bar is None else int(self._bar.n)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by `n` steps; when `postfix` is given it replaces the shown values."""
        if self._bar is None:
            return
        if postfix:
            text = ", ".join(f"{k}={format_postfix_value(v)}" for k, v in postfix.items())
            self._bar.set_postfix_str(text, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        """Draw the final state and release the line. Safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def peak_memory_bytes(device: torch.device | str | int) -> int:
    """Peak memory in bytes since start (or the last reset of the CUDA peak).

    On a CUDA device: ``torch.cuda.max_memory_allocated(device)``, bytes held by tensors on
    that GPU by this process. Anything else: this process's peak resident set size
    (``ru_maxrss``: kilobytes on Linux, bytes on macOS), covering all host memory, not only
    tensors.
    """
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PhaseTimer:
    """Wall-clock seconds per named phase, summed over repeats.

    ``timings = PhaseTimer(); with timings("generate"): ...; timings.as_dict()`` gives
    ``{"time/generate": seconds}``. A phase that raises still counts the time it ran.
    Different phases may nest (the outer one includes the inner); the same phase may not.

    Args:
        synchronize: call ``torch.cuda.synchronize()`` on entering and leaving a phase
            (when CUDA is available), so that queued GPU work is charged to the phase that
            launched it. Off by default: it stalls the host.
    """

    def __init__(self, synchronize: bool = False):
        self.synchronize = synchronize
        self._seconds: dict[str, float] = {}
        self._active: set[str] = set()

    def _sync(self) -> None:
        if self.synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name in self._active:
            raise ValueError(f"phase '{name}' is already being timed; it cannot nest in itself")
        self._active.add(name)
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            self._active.discard(name)
            self._seconds[name] = self._seconds.get(name, 0.0) + elapsed

    def as_dict(self) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` for every phase timed since the last `reset`."""
        return {f"time/{name}": seconds for name, seconds in self._seconds.items()}

    def reset(self) -> None:
        """Forget all totals (e.g. after logging them for a step)."""
        self._seconds.clear()


class Heartbeat:
    """Lines of progress for work that may be slow by size, none for work that is quick.

    ``with Heartbeat("data", total=len(records), enabled=rank == 0) as hb: ... hb.done += 1``
    prints nothing if the work ends within `delay` seconds; otherwise, from a daemon thread,
    ``shardwise: data: 3 of 10 prepared (12 s)`` after `delay` and then every `interval`
    seconds, and a last line when it ends (so a run that seems stuck on one huge record
    says it is working, and quick runs keep a clean console).
    """

    def __init__(self, what: str, total: int, enabled: bool, delay: float = 5.0, interval: float = 30.0):
        self.what, self.total, self.enabled = what, total, bool(enabled)
        self.delay, self.interval = delay, interval
        self.done = 0
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._spoke = False
        self._thread: threading.Thread | None = None

    def _line(self) -> None:
        self._spoke = True
        print(f"shardwise: {self.what}: {self.done} of {self.total} prepared "
              f"({time.monotonic() - self._start:.0f} s)", file=sys.stderr, flush=True)

    def _run(self) -> None:
        wait = self.delay
        while not self._stop.wait(wait):
            self._line()
            wait = self.interval

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name=f"shardwise-heartbeat-{self.what}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._spoke and exc_type is None:
                self._line()
