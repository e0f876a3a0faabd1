"""Evaluation on held-out prompts: generate answers, score them, count the metrics every job
reports (``val/*``), and write the answers where a person can read them.

One path for every job (`shardwise rl`, `shardwise train` on a built-in task, `shardwise
infer`): `evaluate` asks `generate` (a job's ``generate_on_ranks``, a worker group's
``generate_sequences``) for a greedy answer per prompt and / or ``n`` sampled answers per
prompt, scores each with the reward function (`shardwise.data.rewards.score_sequences`: any
signature, dict returns, ``builtin:*``, a contained user function, its timeout) and returns
one row per answer; `eval_metrics` counts the metrics from those rows alone, so that a test
(or a person) recounts them from the samples file (`write_samples`,
``run.dir/samples/step_XXXXXXX.jsonl``).

The metrics (`eval_metrics`; each also as ``val/<data_source>/<name>`` for every
data_source of the rows):

- ``val/accuracy``: the share of prompts whose greedy answer scores >= 1;
- ``val/reward_mean``: the mean reward of the greedy answers (greedy), else of all samples;
- ``val/pass@k``: the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` (`pass_at_k`) of a
  prompt's n samples, c of them scoring >= 1, averaged over prompts;
- ``val/maj@k``: over the FIRST k samples of a prompt, the most frequent extracted answer
  (ties: the one seen first) is right when the first sample that gave it scores >= 1;
- ``val/best@k`` / ``val/mean@k``: the max / mean reward over the first k samples, averaged
  over prompts.

The extracted answer of a sample (``pred``, for maj@k): the reward function's own ``pred``
when it returns a dict that has one; else ``extract(response)`` where the reward is a
``module:function`` whose module also defines a function ``extract`` (`extract_fn`); else
the response text, stripped.

Seeds: the greedy pass is seeded 0 (``meta["greedy"]``); the sampled pass is seeded with the
job's seed and each row's ``sample_key`` ``"<uid>/<j>"`` (`shardwise.engine.generate.
sample_keys`), so an answer does not depend on the ranks that generate it. A built-in task's
held-out prompts have the uids ``heldout-{i}`` and the task's ``max_new_tokens``: the same
batches as the held-out accuracy and pass@k the jobs printed before this module.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.data.batch import Batch
from shardwise.data.reward_row import RewardFunctionError, describe, short
from shardwise.data.rewards import RewardFn, call_within, import_attribute, score_sequences
from shardwise.data.tasks import BUILTIN_PREFIX
from shardwise.engine.generate import PromptBatchFn, prompt_batch, sample_keys
from shardwise.errors import DiskFullError, free_bytes, human_bytes
from shardwise.models.vision import VisionInputs
from shardwise.telemetry import Progress

__all__ = ["EvalPlan", "EvalResult", "answer_row", "asked_records", "bounded_extract", "eval_metrics", "eval_table", "evaluate",
           "extract_fn", "is_eval_step", "metric_names", "pass_at_k", "samples_path", "write_samples"]

RIGHT = 1.0
"""A reward at least this is a right answer (accuracy, pass@k, maj@k)."""


@dataclass(frozen=True)
class EvalPlan:
    """What one job evaluates, resolved before launch (`shardwise.jobs.inputs.check_eval`)."""

    source: str
    """``eval.source``, or the built-in ``data.source`` whose held-out prompts are used."""
    records: list[dict]
    """``prompt`` (as in the data, before any template), ``response`` (the ground truth),
    ``data_source``, ``extra_info``, ``where``; for ``train`` on a file: SFT examples."""
    greedy: bool
    """One greedy answer per prompt (val/accuracy, val/reward_mean)."""
    n: int
    """Sampled answers per prompt (0: none)."""
    ks: tuple[int, ...]
    """The k of pass@k / maj@k / best@k / mean@k, each <= n (empty when n == 0)."""
    reward: str | None
    """The scorer's spec (``eval.reward`` or the job's)."""
    every_steps: int
    """``eval.every_steps`` (0: at step 0 and at the end only)."""
    samples_logged: int
    """Rows sent to the trackers at each evaluation."""
    max_new_tokens: int | None
    """A built-in task's own ``max_new_tokens``; None: the job's."""
    builtin: bool
    """`records` are a built-in task's held-out examples (uids ``heldout-{i}``)."""


def is_eval_step(step: int, every_steps: int, max_steps: int) -> bool:
    """Whether the job evaluates after `step` optimizer steps: at 0 (before training), at
    every multiple of `every_steps` (0: none) and at `max_steps` (the end)."""
    return step == 0 or step == max_steps or (every_steps > 0 and step % every_steps == 0)


@dataclass
class EvalResult:
    """One evaluation: `metrics` (``val/*`` and ``time/eval``, seconds) and `rows`, one per
    answer (`answer_row`), greedy ones first, then the samples, each in prompt order."""

    metrics: dict[str, float]
    rows: list[dict]


# ---------------------------------------------------------------- the math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` are right: the chance
    that k of them drawn without replacement hold a right one, ``1 - C(n-c, k) / C(n, k)``
    (computed as a product, exact for any n). ValueError unless ``0 <= c <= n`` and
    ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        miss *= 1.0 - k / i
    return 1.0 - miss


def _answer_key(pred: Any) -> Any:
    """A hashable stand-in for an extracted answer (lists / dicts by their JSON text)."""
    if isinstance(pred, (str, int, float, bool)) or pred is None:
        return pred
    return repr(pred)


def _counts(rows: list[dict], ks: Sequence[int], greedy: bool) -> dict[str, float]:
    """The metrics of `rows` (one data_source, or all), names without the ``val/``."""
    out: dict[str, float] = {}
    firsts = [r for r in rows if r["greedy"]]
    sampled = [r for r in rows if not r["greedy"]]
    if greedy and firsts:
        out["accuracy"] = sum(float(r["reward"]) >= RIGHT for r in firsts) / len(firsts)
        out["reward_mean"] = sum(float(r["reward"]) for r in firsts) / len(firsts)
    elif sampled:
        out["reward_mean"] = sum(float(r["reward"]) for r in sampled) / len(sampled)
    if not sampled or not ks:
        return out
    groups: dict[Any, list[dict]] = {}
    for r in sampled:
        groups.setdefault(r["index"], []).append(r)
    samples = [sorted(g, key=lambda r: r["sample"]) for g in groups.values()]
    for k in ks:
        if any(len(g) < k for g in samples):
            raise ValueError(f"k={k} is more than the {min(len(g) for g in samples)} samples of some prompt")
        passes, majs, bests, means = [], [], [], []
        for g in samples:
            rewards = [float(r["reward"]) for r in g]
            passes.append(pass_at_k(len(g), sum(x >= RIGHT for x in rewards), k))
            first_k = g[:k]
            votes: dict[Any, list[int]] = {}  # answer -> [count, position of its first sample]
            for i, r in enumerate(first_k):
                votes.setdefault(_answer_key(r.get("pred")), [0, i])[0] += 1
            _, (_, at) = max(votes.items(), key=lambda kv: (kv[1][0], -kv[1][1]))
            majs.append(float(float(first_k[at]["reward"]) >= RIGHT))
            bests.append(max(rewards[:k]))
            means.append(sum(rewards[:k]) / k)
        p = len(samples)
        out |= {f"pass@{k}": sum(passes) / p, f"maj@{k}": sum(majs) / p, f"best@{k}": sum(bests) / p,
                f"mean@{k}": sum(means) / p}
    return out


def eval_metrics(rows: list[dict], ks: Sequence[int], greedy: bool) -> dict[str, float]:
    """The ``val/*`` metrics (module docstring) counted from `rows` alone (`answer_row`'s
    keys ``index``, ``sample``, ``greedy``, ``reward``, ``pred``, ``data_source``): over all
    rows and, as ``val/<data_source>/<name>``, over each data_source's (rows without one
    count in the totals only). `greedy`: the greedy rows give accuracy and reward_mean (else
    reward_mean is over the samples). Pure: a samples file read back gives the same dict."""
    ks = tuple(dict.fromkeys(int(k) for k in ks))
    metrics = {f"val/{k}": v for k, v in _counts(rows, ks, greedy).items()}
    sources = dict.fromkeys(str(r["data_source"]) for r in rows if r.get("data_source") is not None)
    for source in sources:
        part = [r for r in rows if r.get("data_source") is not None and str(r["data_source"]) == source]
        metrics |= {f"val/{source}/{k}": v for k, v in _counts(part, ks, greedy).items()}
    return metrics


def metric_names(greedy: bool, n: int, ks: Sequence[int], sources: Sequence[str] = ()) -> list[str]:
    """The ``val/*`` names `eval_metrics` gives for a plan of this shape (per-source ones for
    `sources`): what ``checkpoint.keep_best`` may name."""
    base = (["accuracy", "reward_mean"] if greedy else []) + (["reward_mean"] if n and not greedy else [])
    if n:
        base += [f"{m}@{k}" for k in ks for m in ("pass", "maj", "best", "mean")]
    return [f"val/{b}" for b in base] + [f"val/{s}/{b}" for s in sources for b in base]


# ---------------------------------------------------------------- rows


def extract_fn(reward_spec: str | None) -> Callable[[str], Any] | None:
    """The function ``extract`` of the module of a ``module:function`` reward (None for a
    built-in reward, no reward, or a module without one): ``extract(response) -> answer``,
    the answer maj@k votes on when the reward returns no ``pred``."""
    if not reward_spec or reward_spec.strip().startswith(BUILTIN_PREFIX) or ":" not in reward_spec:
        return None
    module = reward_spec.strip().partition(":")[0]
    try:
        fn = import_attribute(module, "extract", "eval.reward")
    except Exception:  # no extract there (or the module fails: the reward's own check says so)
        return None
    return fn if callable(fn) else None


def bounded_extract(extract: Callable[[str], Any] | None, timeout_s: float | None,
                    timeout_key: str) -> Callable[[str], Any] | None:
    """`extract` bounded by the reward's timeout: a call past `timeout_s` seconds stops the
    job with one line naming the function, the response and `timeout_key` (a
    `RewardFunctionError`, as a slow reward function does); a call that raises leaves the
    answer unknown (`answer_row`)."""
    if extract is None:
        return None
    name = describe(extract)

    def bounded(response: str) -> Any:
        return call_within(timeout_s, lambda: extract(response),
                           f"extract function {name} did not return within {timeout_s:g} s on the response "
                           f"{short(response)}; make it faster or raise {timeout_key}")
    return bounded


def answer_row(*, step: int, index: int, sample: int, greedy: bool, record: dict, response: str, reward: float,
               info: dict | None = None, extract: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """One row of the samples file: ``step``, ``index`` (the prompt's), ``sample`` (0..n-1;
    0 for a greedy answer), ``greedy``, ``prompt`` (the record's, as in the data),
    ``response``, ``ground_truth``, ``reward``, ``pred`` (the extracted answer: `info`'s
    ``pred``, else ``extract(response)``, else the stripped response) and ``data_source``,
    then the reward function's other keys (`info`, plain JSON) where they do not clash."""
    info = dict(info or {})
    if "pred" in info:
        pred = info["pred"]
    elif extract is not None:
        try:
            pred = extract(response)
        except RewardFunctionError:  # it did not return in time (`bounded_extract`): the job stops
            raise
        except Exception as e:  # user code: the answer is then unknown, said in the row
            pred, info["extract_error"] = None, f"{type(e).__name__}: {e}"
    else:
        pred = response.strip()
    truth = record.get("response")
    row = {"step": int(step), "index": int(index), "sample": int(sample), "greedy": bool(greedy),
           "prompt": record.get("prompt"), "response": response, "ground_truth": "" if truth is None else str(truth),
           "reward": float(reward), "pred": _plain(pred), "data_source": record.get("data_source")}
    return {**row, **{k: v for k, v in info.items() if k not in row}}


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, list, dict)) or value is None:
        return value
    return value.item() if hasattr(value, "item") else str(value)


# ---------------------------------------------------------------- evaluate


def asked_records(records: list[dict], chat: bool) -> list[dict]:
    """`records` as they are asked: with `chat` (the job's chat setting,
    `shardwise.data.chat.text_prompts_as_chat`) a text prompt becomes one user turn."""
    return [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} if chat and isinstance(r["prompt"], str)
            else r for r in records]


def evaluate(generate: Callable[[Batch], Batch], tokenizer, plan: EvalPlan, scorer: RewardFn | None, *,
             seed: int, max_length: int, step: int, timeout_s: float | None, timeout_key: str,
             batch_fn: PromptBatchFn | None = None, vision: VisionInputs | None = None, chat: bool = False,
             extract: Callable[[str], Any] | None = None, progress: bool = True,
             chunk_prompts: int | None = None) -> EvalResult:
    """Generate and score the answers of `plan` (module docstring) at `step`.

    `generate` maps a prompt batch (`prompt_batch`, or `batch_fn` ``(records, uids)``: a
    multi-turn job's) to its sequences; `scorer` scores them (None: an environment's reward
    only, `score_sequences`) within `timeout_s` per call (`timeout_key` names the setting).
    `extract` (`extract_fn`) gives each answer's ``pred``, bounded by `timeout_s` too
    (`bounded_extract`). `chat`: text prompts are asked as one user turn. Prompts go in chunks of `chunk_prompts`
    (None: all in one call), under a progress bar ``eval`` when `progress`. Not collective
    itself (`generate` may be: every rank then calls this alike); writes nothing."""
    t0 = time.perf_counter()
    extract = bounded_extract(extract, timeout_s, timeout_key)
    records = list(plan.records)
    asked = asked_records(records, chat)
    uids = [f"heldout-{i}" for i in range(len(records))]
    per = max(1, chunk_prompts or len(records) or 1)
    chunks = [range(a, min(a + per, len(records))) for a in range(0, len(records), per)]
    passes = [(True, 1)] if plan.greedy else []
    if plan.n:
        passes.append((False, plan.n))
    bar = Progress(total=len(chunks) * len(passes), enabled=progress, desc="eval")
    rows: list[dict] = []
    try:
        for greedy, n in passes:
            for chunk in chunks:
                recs, ids = [asked[i] for i in chunk], [uids[i] for i in chunk]
                batch = batch_fn(recs, ids) if batch_fn is not None else \
                    prompt_batch(tokenizer, recs, max_length, ids, vision)
                if not greedy:
                    batch = batch.repeat(n, interleave=True)
                    batch = batch.union(Batch.from_dict(arrays={"sample_key": sample_keys(ids, n)}))
                batch.meta.update(seed=0 if greedy else seed, greedy=greedy)
                if plan.max_new_tokens is not None:
                    batch.meta["max_new_tokens"] = plan.max_new_tokens
                out = generate(batch)
                scored = score_sequences(out, tokenizer, scorer, timeout_s, timeout_key)
                texts, scores = scored.arrays["response_text"], scored.arrays["score"]
                infos = scored.arrays["reward_info"]
                for j in range(len(out)):
                    i = chunk[j // n]
                    rows.append(answer_row(step=step, index=i, sample=j % n, greedy=greedy, record=records[i],
                                           response=str(texts[j]), reward=float(scores[j]), info=infos[j],
                                           extract=extract))
                bar.update(1)
    finally:
        bar.close()
    metrics = eval_metrics(rows, plan.ks, plan.greedy)
    metrics["time/eval"] = time.perf_counter() - t0
    return EvalResult(metrics, rows)


# ---------------------------------------------------------------- files and tables


def samples_path(run_dir: str | os.PathLike, step: int) -> Path:
    """``run_dir/samples/step_{step:07d}.jsonl``: the answers of the evaluation at `step`."""
    return Path(run_dir) / "samples" / f"step_{int(step):07d}.jsonl"


def write_samples(run_dir: str | os.PathLike, step: int, rows: list[dict],
                  resume: Callable[[str | os.PathLike], str] | None = None) -> Path:
    """`rows` as JSON lines at `samples_path` (a temporary file replaced in one step: a
    reader never sees half a file); returns the path. A full disk is a `DiskFullError`
    (exit status 74) naming the file, the free space and the file's size, after the partial
    file is removed (it would fill the disk the resumed run needs); any other OSError is
    raised as it is, the partial file removed too. `resume(run_dir)`: where the stopped run
    resumes from, in words, for the line (a job with checkpoints passes
    `checkpoint.layout.resume_line`; infer keeps none and passes nothing)."""
    path = samples_path(run_dir, step)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        os.replace(tmp, path)
    except OSError as e:
        full = _samples_disk_full_line(run_dir, path, tmp, rows, resume) if e.errno == errno.ENOSPC else None
        with contextlib.suppress(OSError):  # the free space above is the full disk's, before this
            tmp.unlink(missing_ok=True)
        if full is None:
            raise
        raise DiskFullError(full) from None
    return path


def _samples_disk_full_line(run_dir: str | os.PathLike, path: Path, tmp: Path, rows: list[dict],
                            resume: Callable[[str | os.PathLike], str] | None) -> str:
    need = sum(len((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")) for r in rows)
    then = f"; {resume(run_dir)}" if resume is not None else ""
    return (f"evaluation samples {str(path)!r} could not be written: the disk holding it is full "
            f"({human_bytes(free_bytes(path.parent))} free, the file needs about {human_bytes(need)}); the partial "
            f"file {tmp.name} was removed{then} (free space, or move run.dir to a larger disk)")


def eval_table(metrics: dict[str, float]) -> str:
    """The ``val/*`` metrics as the table every job prints: one line per data_source (all
    first), one column per metric (accuracy, reward_mean, then pass / maj / best / mean by
    k); shares as percents, rewards with 4 digits; ``time/eval`` under it. "" without any."""
    vals = {k[4:]: v for k, v in metrics.items() if k.startswith("val/")}
    if not vals:
        return ""
    groups: dict[str, dict[str, float]] = {}
    for name, v in vals.items():
        source, _, metric = name.rpartition("/")
        groups.setdefault(source or "all", {})[metric] = v
    if "all" in groups:
        groups = {"all": groups.pop("all"), **groups}
    first = ("loss", "ppl", "accuracy", "reward_mean")

    def order(m: str) -> tuple:
        kind, _, k = m.partition("@")
        if m in first:
            return (0, first.index(m), 0, m)
        if k.isdigit() and kind in ("pass", "maj", "best", "mean"):
            return (1, int(k), ("pass", "maj", "best", "mean").index(kind), m)
        return (2, 0, 0, m)

    columns = sorted({m for g in groups.values() for m in g}, key=order)

    def cell(m: str, v: float | None) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if m == "accuracy" or m.split("@")[0] in ("pass", "maj"):
            return f"{v:.1%}"
        return f"{v:.4f}"

    head = ["eval", *columns]
    table = [[g, *(cell(m, groups[g].get(m)) for m in columns)] for g in groups]
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head))]
    fmt = "  ".join(("{:<%d}" if i == 0 else "{:>%d}") % w for i, w in enumerate(widths))
    lines = [fmt.format(*head), *(fmt.format(*r) for r in table)]
    if "time/eval" in metrics:
        lines.append(f"(evaluation took {metrics['time/eval']:.1f} s)")
    return "\n".join(lines)
