"""The best checkpoint of a run by an evaluation metric (``checkpoint.keep_best``).

``<run.dir>/checkpoints/best.json`` records it::

    {"metric": "val/loss", "mode": "min", "step": 4, "value": 1.23,
     "history": [[0, 2.5], [2, 1.4], [4, 1.23]]}

`record_best` is called by rank 0 (the RL controller) after each evaluation whose step
was checkpointed; the file is replaced atomically (tmp + os.replace), so a crash leaves the
old record or the new one. ``history`` holds every recorded (step, value): a resume from an
earlier step (`forget_best_after`) falls back to the best of the steps it keeps.
`CheckpointManager.prune` never deletes the folder of the recorded step, and
``checkpoint.export_from: best`` exports `best_checkpoint`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from shardwise.checkpoint.layout import CHECKPOINTS_DIR, is_complete, step_dir_name

log = logging.getLogger(__name__)

__all__ = ["BEST_FILE", "best_checkpoint", "best_step", "forget_best_after", "lower_is_better", "read_best",
           "record_best"]

BEST_FILE = "best.json"
"""In run.dir/checkpoints."""

_LOWER_IS_BETTER = ("loss", "ppl")


def lower_is_better(metric: str) -> bool:
    """val/loss, val/ppl and any ``*/loss`` or ``*/ppl`` (per data source too): lower is
    better; every other metric (accuracy, pass@k, rewards): higher is better."""
    return metric.rsplit("/", 1)[-1] in _LOWER_IS_BETTER


def _path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / BEST_FILE


def read_best(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record of best.json ({"metric", "step", "value", "mode", "history"}), or None
    when there is none (or it cannot be read: a warning, and the run records anew)."""
    path = _path(run_dir)
    try:
        best = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s); the best checkpoint is recorded anew", path, exc)
        return None
    if not (isinstance(best, dict) and isinstance(best.get("step"), int) and isinstance(best.get("metric"), str)
            and isinstance(best.get("value"), (int, float))):
        log.warning("%s is not a best-checkpoint record; the best checkpoint is recorded anew", path)
        return None
    return best


def _write(run_dir: str | os.PathLike[str], best: dict[str, Any]) -> None:
    path = _path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(best, indent=2))
    os.replace(tmp, path)


def _better(value: float, than: float, mode: str) -> bool:
    return value < than if mode == "min" else value > than


def _best_of(history: list[list[Any]], mode: str) -> tuple[int, float] | None:
    """The (step, value) of `history` that is best, the earliest among equals."""
    best: tuple[int, float] | None = None
    for step, value in sorted(history, key=lambda x: x[0]):
        if best is None or _better(value, best[1], mode):
            best = (step, value)
    return best


def record_best(run_dir: str | os.PathLike[str], metric: str, step: int, metrics: dict[str, Any]) -> bool:
    """Add `step`'s value of `metric` (from `metrics`, an evaluation's val/* dict) to
    best.json; True when `step` is now the best (strictly better than the recorded best,
    or the first). A missing or non-finite value is not recorded (False). A record of
    another metric (keep_best changed on resume) is started anew. Evaluating a recorded
    step again (a resumed run with nothing left to train) replaces its value."""
    value = metrics.get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    mode = "min" if lower_is_better(metric) else "max"
    old = read_best(run_dir)
    history = []
    if old is not None and old.get("metric") == metric:
        history = [h for h in _history(old) if h[0] != step]
    history.append([int(step), float(value)])
    history.sort(key=lambda h: h[0])
    best_step, best_value = _best_of(history, mode)
    _write(run_dir, {"metric": metric, "mode": mode, "step": best_step, "value": best_value, "history": history})
    return best_step == step


def _history(best: dict[str, Any]) -> list[list[Any]]:
    """The recorded (step, value) pairs of a best.json (one written without a history: its best)."""
    history = best.get("history")
    if not isinstance(history, list):
        return [[best["step"], best["value"]]]
    return [list(h) for h in history if isinstance(h, list) and len(h) == 2 and isinstance(h[0], int)
            and isinstance(h[1], (int, float))]


def forget_best_after(run_dir: str | os.PathLike[str], step: int) -> None:
    """A run resumed from `step`: evaluations of later steps never happened in the run that
    goes on, so drop them; the best becomes the best of the steps kept whose checkpoint
    folder is still there (best.json is removed when none is left)."""
    old = read_best(run_dir)
    if old is None:
        return
    history = _history(old)
    kept = [h for h in history if h[0] <= step]
    if len(kept) == len(history) and old["step"] <= step:
        return
    folder = Path(run_dir) / CHECKPOINTS_DIR
    kept = [h for h in kept if is_complete(folder / step_dir_name(h[0]))]
    found = _best_of(kept, "min" if lower_is_better(old["metric"]) else "max")
    if found is None:
        _path(run_dir).unlink(missing_ok=True)
        return
    _write(run_dir, {**old, "step": found[0], "value": found[1], "history": kept})


def best_step(run_dir: str | os.PathLike[str]) -> int | None:
    """The recorded best step, or None."""
    best = read_best(run_dir)
    return None if best is None else int(best["step"])


def best_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint folder of the recorded best step, else None (no record, or
    its folder is not a complete checkpoint)."""
    step = best_step(run_dir)
    if step is None:
        return None
    folder = Path(run_dir) / CHECKPOINTS_DIR / step_dir_name(step)
    return folder if is_complete(folder) else None
