"""What the benchmarks share, so that each benchmark file reads as its comparison.

- Worker launch: `torchrun` (the command line of N fresh ranks on a free port), `run_worker`
  (run it with a timeout, log it, read the record it wrote or the first error a rank wrote),
  `worker_env`, `free_port`, `failure_reason`, `machine_info`.
- Rounds: `run_rounds` runs every row once per round, every other round in reverse order (a
  machine getting faster or slower favours no row); a row that fails once runs no more.
- Seeds and their summary: `spread` (mean, min, max over seeds), `show` (``mean [min, max]``),
  `over_seeds` (each side's `spread` of each figure, its failed seeds), `seeds_table`,
  `trailing_mean`, `time_to_reach`.
- Tables: `ratio`, `fmt`, `write_csv`. Plots: `pyplot` (matplotlib on Agg, or None), `reward_curves`
  (every seed's reward per step and per wall-clock second). The command line: `parse_only`.
- A peer's venv: `peer_venv` (made once, stamped with its requirements), `venv_versions`.

It imports nothing heavy (torch only inside `machine_info`), so a worker in another venv could
import it too.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 1024 * 1024


# ---------------------------------------------------------------------- worker launch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(nproc: int) -> dict[str, str]:
    """The environment of the launched ranks: offline HF, and the cores split between ranks."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.setdefault(var, "1")
    return env


def torchrun(nproc: int, script: Path) -> list[str]:
    """The command line that starts `script` as `nproc` ranks of one node. `--standalone`:
    torchrun's own store binds a free port itself (a port picked here and bound later was
    taken by another test's job in between once: EADDRINUSE in the gpu_throughput smoke)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(script)]


def clear_stale(raw_json: Path) -> None:
    """Remove a previous run's record and its ranks' error files."""
    for stale in [raw_json, *raw_json.parent.glob(raw_json.name + ".rank*.error")]:
        stale.unlink(missing_ok=True)


def failure_reason(raw_json: Path, stderr: str, returncode: int) -> str:
    """The first error a rank wrote, else the last non-empty line of the launcher's stderr."""
    for err in sorted(raw_json.parent.glob(raw_json.name + ".rank*.error")):
        text = err.read_text().strip()
        if text:
            return text.splitlines()[0]
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"worker exited with status {returncode}"


def run_worker(cmd: list[str], nproc: int, timeout: float, log: Path, raw_json: Path,
               env: dict[str, str] | None = None) -> tuple[dict[str, Any], float]:
    """Run one torchrun worker command (`nproc` ranks, killed after `timeout` s), write its
    output to `log`; (the record it wrote to `raw_json`, or {"error": why}, wall seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=worker_env(nproc) if env is None else env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM: the launcher stops the ranks it started (each in a session of its own).
        proc.terminate()
        stdout, stderr = proc.communicate()
        stderr += f"\ntimed out after {timeout:.0f} s\n"
    wall_s = time.perf_counter() - start
    log.write_text(f"$ {' '.join(cmd)}\n\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    if proc.returncode == 0 and raw_json.is_file():
        return json.loads(raw_json.read_text()), wall_s
    return {"error": failure_reason(raw_json, stderr, proc.returncode)}, wall_s


def machine_info(nproc: int, cuda: bool | None = None) -> dict[str, Any]:
    """Versions, CPUs, the device and backend the ranks use (`cuda`: None = whether torch sees one)."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "backend": "nccl" if cuda else "gloo",
        "nproc": nproc,
        "omp_num_threads": worker_env(nproc)["OMP_NUM_THREADS"],
    }


# ---------------------------------------------------------------------- rounds


def run_rounds(rows: Sequence[Any], rounds: int, launch: Callable[[Any, int], dict[str, Any]],
               merge: Callable[[list[dict[str, Any]]], dict[str, Any]],
               detail: Callable[[dict[str, Any]], str], width: int) -> list[dict[str, Any]]:
    """`rounds` rounds over the rows (each with a `name`), every other round in reverse order,
    so that a machine getting faster or slower during the benchmark biases no row; a row that
    fails once (its record has an "error") is not run again. `launch(row, round_no)` runs one;
    `merge` makes a row's record of its runs; `detail` says one run on the progress line. One
    record per row, in the rows' order."""
    runs: dict[str, list[dict[str, Any]]] = {r.name: [] for r in rows}
    failed: dict[str, dict[str, Any]] = {}
    total, done = len(rows) * rounds, 0
    for round_no in range(1, rounds + 1):
        for row in rows if round_no % 2 else rows[::-1]:
            if row.name in failed:
                total -= 1
                continue
            record = launch(row, round_no)
            done += 1
            if "error" in record:
                failed[row.name] = record
                text = f"unavailable: {record['error']}"
            else:
                runs[row.name].append(record)
                text = detail(record)
            print(f"[{done}/{total}] run {round_no} {row.name:<{width}} {text}  ({record['wall_s']:.0f} s)",
                  flush=True)
    return [failed[r.name] if r.name in failed else merge(runs[r.name]) for r in rows]


# ---------------------------------------------------------------------- seeds and their summary


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the `window` - 1 before it (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def time_to_reach(run: dict[str, Any], reward: float, window: int) -> float | None:
    """Seconds until the mean reward of `run`'s last `window` steps first reaches `reward`
    (None: never). Only full windows count (the whole run if it is shorter), so one lucky
    early step does not. `run["steps"]`: dicts with "reward" and "t" (seconds since the first
    step began)."""
    means = trailing_mean([s["reward"] for s in run["steps"]], window)
    first = min(window, len(means)) - 1
    return next((s["t"] for s, m in list(zip(run["steps"], means))[first:] if m >= reward), None)


def spread(values: list[float | None]) -> dict[str, float] | None:
    """The mean, min and max of the values that are not None (None if there is none)."""
    v = [x for x in values if x is not None]
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "n": len(v)} if v else None


def show(s: dict[str, float] | None, spec: str = ".3f", suffix: str = "") -> str:
    """A `spread` as ``mean [min, max]`` (the mean alone for one value)."""
    if s is None:
        return "n/a"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['mean']:{spec}}{suffix}"
    return f"{s['mean']:{spec}}{suffix} [{s['min']:{spec}}, {s['max']:{spec}}]"


Figures = Sequence[tuple[str, str, str]]
"""(key in a run, column, format) per figure of a seeds table."""


def over_seeds(per_seed: dict[int, dict[str, dict[str, Any]]], names: Sequence[str], figures: Figures,
               unreached: Callable[[dict[str, Any]], bool] = lambda r: False,
               extra: Callable[[list[dict[str, Any]]], dict[str, Any]] = lambda ok: {}) -> dict[str, dict[str, Any]]:
    """Each name's (side's, setting's) figures over the seeds: {"seeds", "errors" (of the
    failed runs), "unreached" (runs `unreached` counts), what `extra(the runs that did not
    fail)` adds, each figure's `spread`}. A name no seed ran is left out."""
    out = {}
    for name in names:
        runs = [per_seed[s][name] for s in per_seed if name in per_seed[s]]
        if not runs:
            continue
        ok = [r for r in runs if "error" not in r]
        out[name] = {"seeds": len(runs), "errors": [r["error"] for r in runs if "error" in r],
                     "unreached": sum(1 for r in ok if unreached(r)), **extra(ok),
                     **{k: spread([r.get(k) for r in ok]) for k, _, _ in figures}}
    return out


def seeds_table(agg: dict[str, dict[str, Any]], figures: Figures, first: str,
                lead: Callable[[str], list[str]] | None = None, lead_cols: Sequence[str] = (),
                cell: Callable[[str, str, dict[str, Any], str], str] | None = None) -> list[str]:
    """The lines of a markdown table of `over_seeds` figures: a row per name (its `lead`
    cells first, under `lead_cols`), the seeds it ran (and how many failed), each figure
    `show`n (`cell(name, key, agg[name], text)` may reword one); a name whose every seed
    failed shows the first error; then each failed run's error on a line of its own."""
    cols = [c for _, c, _ in figures]
    head = [first, *lead_cols, "seeds"]
    lines = ["| " + " | ".join([*head, *cols]) + " |", "|---|" + "---|" * len(lead_cols) + "--:|" + "--:|" * len(cols)]
    for name, a in agg.items():
        pre = " | ".join([name, *(lead(name) if lead else [])])
        failed = f" ({len(a['errors'])} failed)" if a["errors"] else ""
        if a["errors"] and len(a["errors"]) == a["seeds"]:
            lines.append(f"| {pre} | {a['seeds']}{failed} | unavailable: {a['errors'][0]} |" + " |" * (len(cols) - 1))
            continue
        cells = [show(a[key], spec) for key, _, spec in figures]
        if cell:
            cells = [cell(name, key, a, text) for (key, _, _), text in zip(figures, cells)]
        lines.append(f"| {pre} | {a['seeds']}{failed} | " + " | ".join(cells) + " |")
    for name, a in agg.items():
        lines += [f"\n{name}: a run failed: {e}" for e in a["errors"]]
    return lines


def unreached_note(text: str, a: dict[str, Any]) -> str:
    """A time-to-reach cell with how many seeds never reached it."""
    return text + f" ({a['unreached']} seed(s) never reached it)" if a["unreached"] else text


# ---------------------------------------------------------------------- tables and plots


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else f"{x:{spec}}"


def write_csv(path: Path, rows: list[dict[str, Any]], fields: Sequence[str],
              value: Callable[[Any], Any] = lambda v: v) -> None:
    """One line per row with `fields` (a missing one empty; `value` may convert each)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: value(row.get(k, "")) for k in fields})


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display), or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def reward_curves(axes: Sequence[Any], per_seed: dict[int, dict[str, dict[str, Any]]],
                  colors: dict[str, str], smooth: int, seeds_word: str = "seeds",
                  fontsizes: tuple[float, float] | None = None) -> None:
    """Every seed's reward curve (a `smooth`-step trailing mean) of each name in `colors`, per
    step on axes[0] and per wall-clock second on axes[1], with their titles and legends
    (`fontsizes`: the titles' and the legends', else matplotlib's defaults)."""
    title_size, legend_size = ({"fontsize": fontsizes[0]}, {"fontsize": fontsizes[1]}) if fontsizes else ({}, {})
    for name, color in colors.items():
        runs = [per_seed[s][name] for s in per_seed if "error" not in per_seed[s].get(name, {"error": 1})]
        for k, r in enumerate(runs):
            rewards = trailing_mean([s["reward"] for s in r["steps"]], smooth)
            label = f"{name} ({len(runs)} {seeds_word})" if k == 0 else None
            axes[0].plot([s["step"] for s in r["steps"]], rewards, color=color, alpha=0.75, linewidth=1, label=label)
            axes[1].plot([s["t"] for s in r["steps"]], rewards, color=color, alpha=0.75, linewidth=1, label=label)
    for ax, title, xlabel in zip(axes[:2], ("reward per step", "reward per wall-clock second"),
                                 ("step", "seconds since the first step began")):
        ax.set_title(f"{title} (each seed: mean of {smooth} steps)", **title_size)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean reward")
        ax.legend(**legend_size)


# ---------------------------------------------------------------------- the command line


def parse_only(p: argparse.ArgumentParser, only: str | None, names: Sequence[str], what: str) -> list[str] | None:
    """--only's comma-separated names, each one of `names` (else the parser's error naming
    the unknown ones and the choices); None without --only."""
    if only is None:
        return None
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown or not wanted:
        p.error(f"--only: unknown {what} {unknown or only!r}; choose from {', '.join(names)}")
    return wanted


# ---------------------------------------------------------------------- a peer's venv


def peer_venv(venv: Path, requirements: list[str], skip_install: bool, who: str, peer: str = "TRL") -> Path:
    """The python of a venv of a peer library's own (TRL, ...: no shardwise dependency),
    created and filled with pip unless its stamp says it holds `requirements` already. The
    first requirement is installed first, alone (torch: the version shardwise runs on, so a
    CPU build stays one). `who` names the benchmark in its messages."""
    py = venv / "bin" / "python"
    stamp = venv / f".installed-{hashlib.sha256(' '.join(requirements).encode()).hexdigest()[:12]}"
    if skip_install or stamp.is_file():
        if not py.is_file():
            raise SystemExit(f"{who}: no {peer} venv at {venv}; run without --skip-trl-install")
        return py
    print(f"{who}: installing {' '.join(requirements)} into {venv}", flush=True)
    if not py.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, requirements[0]], check=True)
    subprocess.run([*pip, *requirements[1:]], check=True)
    for old in venv.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    return py


def venv_versions(py: Path, packages: Sequence[str]) -> dict[str, str]:
    """The versions of `packages` in the venv of `py`."""
    code = f"import json, importlib.metadata as m; print(json.dumps({{p: m.version(p) for p in {tuple(packages)!r}}}))"
    return json.loads(subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True).stdout)


class LoadSampler:
    """The machine's 1-minute load average, sampled every `every` seconds while a run lasts
    (its mean: on a shared machine, how busy it was beside the run; None where the OS has none)."""

    def __init__(self, every: float = 2.0) -> None:
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, AttributeError):
                self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 1)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None
