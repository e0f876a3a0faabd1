"""One `shardwise rl` run for a benchmark: the real command in a fresh run folder, its output
kept in a log, its metrics.jsonl read back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_rl(config: Path, run_dir: Path, overrides: list[str], *, nproc: int, log: Path, timeout: float,
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m shardwise.cli rl config --nproc N run.dir=run_dir overrides...`` from the
    repository root (OMP_NUM_THREADS=1 unless set; `env` on top). Returns ``wall_s`` (the
    command's launch to its exit), ``launched`` (the launch, wall clock) and either
    ``error`` (the last line of stderr) or ``stdout`` and ``steps`` (the metrics
    lines). The command and its whole output go to `log`."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "shardwise.cli", "rl", str(config), "--nproc", str(nproc), f"run.dir={run_dir}",
           *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    launched = time.time()
    t0 = time.perf_counter()
    res = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
    if res.returncode != 0:
        return {"wall_s": wall, "launched": launched, "error": (res.stderr.strip().splitlines() or ["?"])[-1]}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "time/eval" not in m]  # an evaluation's line (val/*) is its own
    return {"wall_s": wall, "launched": launched, "stdout": res.stdout, "steps": steps,
            "evals": [m for m in lines if "time/eval" in m]}
