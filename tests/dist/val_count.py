"""The evaluation's figures counted directly from a samples file's rows
(run.dir/samples/step_XXXXXXX.jsonl), independently of `shardwise.engine.evaluate`."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path


def sample_rows(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "samples" / f"step_{step:07d}.jsonl").read_text().splitlines()]


def count_val(rows: list[dict], ks: list[int]) -> dict[str, float]:
    """Greedy accuracy, pass@k (1 - C(n-c, k) / C(n, k)) and maj@k (the most frequent
    ``pred`` of a prompt's first k samples, ties to the one seen first, right when the
    first sample giving it scores >= 1), each a mean over prompts."""
    greedy = [r for r in rows if r["greedy"]]
    prompts: dict[int, list[dict]] = {}
    for r in rows:
        if not r["greedy"]:
            prompts.setdefault(r["index"], []).append(r)
    out = {"accuracy": sum(r["reward"] >= 1 for r in greedy) / len(greedy)} if greedy else {}
    for k in ks:
        passes, majs = [], []
        for samples in prompts.values():
            samples = sorted(samples, key=lambda r: r["sample"])
            n, c = len(samples), sum(r["reward"] >= 1 for r in samples)
            passes.append(1 - comb(n - c, k) / comb(n, k))
            preds = [r["pred"] for r in samples[:k]]
            top = max(preds, key=lambda p: (preds.count(p), -preds.index(p)))
            majs.append(float(samples[preds.index(top)]["reward"] >= 1))
        out[f"pass@{k}"], out[f"maj@{k}"] = sum(passes) / len(passes), sum(majs) / len(majs)
    return out
