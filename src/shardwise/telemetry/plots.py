"""Plot a run's metrics file to a PNG, one subplot per panel, step on the x axis.

`val_panels` picks the validation panels (``val/*`` keys of the evaluations during
training, logged at sparse steps) that the SFT and RL plots add to their training panels."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise.errors import nearest
from shardwise.telemetry.metrics import read_metrics

__all__ = ["plot_metrics", "val_panels"]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]] | None:
    """(steps, values) of `key`, sorted by step; None when `key` never holds a number.

    A resumed run logs some steps twice; the later line wins.
    """
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[int(record["step"])] = float(value)
    if not by_step:
        return None
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


_VAL_GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("validation loss", re.compile(r"^loss$")),
    ("validation perplexity", re.compile(r"^ppl$")),
    ("validation accuracy", re.compile(r"^(accuracy|pass@\d+|maj@\d+)$")),
    ("validation reward", re.compile(r"^(reward_mean|best@\d+|mean@\d+)$")),
)
"""Panel of each validation metric, by its name after ``val/``."""

_BY_SOURCE = ("loss", "ppl", "accuracy", "reward_mean")
"""The metrics drawn per data source (one panel each) when the rows have several."""


_KINDS = ("accuracy", "reward_mean", "pass", "best", "maj", "mean")


def _k_order(name: str) -> tuple[int, str, int]:
    """accuracy, then pass@k (pass@2 before pass@16), then maj@k; reward_mean, best@k, mean@k."""
    head, _, k = name.partition("@")
    return _KINDS.index(head) if head in _KINDS else len(_KINDS), head, int(k) if k.isdigit() else -1


def val_panels(records: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The validation panels for the ``val/*`` keys present in `records` (metrics.jsonl
    lines): loss, perplexity, accuracy-like rates (accuracy, pass@k, maj@k) and rewards
    (reward_mean, best@k, mean@k) over all data; with more than one data source
    (``val/<source>/...``), also ``validation <m> by data source`` for m in loss, ppl,
    accuracy, reward_mean: one line per source. ``time/eval`` and keys of no group are
    left out; [] when no ``val/`` key is present."""
    keys = sorted({k for r in records for k in r if k.startswith("val/")})
    overall: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) != 2:
            continue
        for title, pattern in _VAL_GROUPS:
            if pattern.match(parts[1]):
                overall.setdefault(title, []).append(key)
                break
    panels = [(title, sorted(overall[title], key=lambda k: _k_order(k.split("/")[1])))
              for title, _ in _VAL_GROUPS if title in overall]
    per_source = [k.split("/") for k in keys if k.count("/") == 2]
    if len({parts[1] for parts in per_source}) > 1:
        for name in _BY_SOURCE:
            lines = [f"val/{src}/{m}" for _, src, m in per_source if m == name]
            if lines:
                panels.append((f"validation {name} by data source", lines))
    return panels


def plot_metrics(
    metrics_path: str | os.PathLike[str],
    out_png: str | os.PathLike[str],
    panels: Sequence[tuple[str, Sequence[str]]],
) -> Path:
    """Draw ``panels`` from a metrics file into `out_png` and return its path.

    `panels` is ``[(title, [metric, ...]), ...]``, e.g.
    ``[("loss", ["loss", "eval/loss"]), ("learning rate", ["lr"])]``: one subplot per
    panel, one line per metric, x = step. `metrics_path` is a ``metrics.jsonl`` file or
    its run directory. A metric that never appears with a numeric value is skipped with
    a warning (and a panel left with none is dropped); ``ValueError`` when none appears.
    Rendered with matplotlib's Agg canvas directly, so no display is needed and the
    pyplot backend of the calling process is left alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("plot_metrics needs at least one panel, e.g. [('loss', ['loss'])]")
    records = read_metrics(metrics_path)
    present = sorted({k for r in records for k in r} - {"step", "time"})

    drawn: list[tuple[str, list[tuple[str, tuple[list[int], list[float]]]]]] = []
    missing: list[str] = []
    for title, keys in panels:
        if isinstance(keys, str):
            raise TypeError(f"panel '{title}': give a list of metric names, not the string {keys!r}")
        lines = []
        for key in keys:
            series = _series(records, key)
            if series is None:
                missing.append(key)
            else:
                lines.append((key, series))
        if lines:
            drawn.append((title, lines))

    def describe(key: str) -> str:
        near = nearest(key, present, n=1)
        return f"'{key}' (did you mean '{near[0]}'?)" if near else f"'{key}'"

    if not drawn:
        raise ValueError(
            f"none of the requested metrics has a numeric value in {metrics_path}: "
            + ", ".join(describe(k) for k in missing)
            + f"; present: {', '.join(present) or 'nothing'}"
        )
    if missing:
        warnings.warn(
            "skipping metrics that never appear in "
            f"{metrics_path}: " + ", ".join(describe(k) for k in missing),
            stacklevel=2,
        )

    # Margins in inches, fixed: a layout engine measuring every label ("constrained") took
    # half of the plot's second, at the end of every run
    rows, panel_h, top, bottom, gap = len(drawn), 2.6, 0.4, 0.55, 0.45
    height = rows * panel_h + 0.6
    fig = Figure(figsize=(8.0, height))
    fig.subplots_adjust(left=0.11, right=0.97, top=1 - top / height, bottom=bottom / height,
                        hspace=gap / ((height - top - bottom - gap * (rows - 1)) / rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(drawn), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, lines) in zip(axes, drawn):
        for key, (steps, values) in lines:
            # one point would be an invisible line, and an evaluation's few points are
            # easier to read as points: markers keep them on the plot
            marker = "o" if len(steps) == 1 else ("." if key.startswith("val/") else None)
            ax.plot(steps, values, label=key, marker=marker)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if len(lines) > 1 or lines[0][0] != title:
            ax.legend(loc="best", fontsize="small")
        # learning rates like 3e-4 read better in scientific notation than as 0.0003
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    axes[-1].set_xlabel("step")

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, format="png")
    return out
