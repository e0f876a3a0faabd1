"""Evaluation (`shardwise.engine.evaluate`, issue 29): the metrics' math against direct
counts, and `shardwise infer` on a user-format validation file whose samples file, read
back, gives the figures the summary reports.

- `pass_at_k` equals the closed form and a brute-force enumeration of the k-subsets;
- `eval_metrics` on hand-built rows: accuracy, reward_mean, pass@k, maj@k (the reward's
  ``pred``; a tie goes to the answer seen first; only the first k samples vote), best@k,
  mean@k, per data_source;
- `evaluate` with a real HF generator: the greedy pass seeded 0, the samples keyed
  "heldout-{i}/{j}" with the job's seed, in chunks; ``pred`` from an ``extract`` beside the reward;
- the real CLI: `shardwise infer` on a jsonl with prompt / response / data_source (two
  sources), sampled, scored by a user's dict-returning reward with a ``pred``: the samples
  file's rows, and pass@k / maj@k recounted from it equal the summary's val/*;
- validation data are checked before launch: a missing file, a row without ground truth
  (exit 2, one line naming the key, file and row).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, run_cli
from transformers import Qwen3Config, Qwen3ForCausalLM

from shardwise.config.load import load_config
from shardwise.config.schema import InferConfig
from shardwise.data.rewards import RewardFunctionError, resolve_reward_fn
from shardwise.data.tokenizer import build_char_tokenizer
from shardwise.distributed.runtime import Runtime
from shardwise.engine.evaluate import (
    EvalPlan,
    answer_row,
    bounded_extract,
    eval_metrics,
    eval_table,
    evaluate,
    extract_fn,
    is_eval_step,
    pass_at_k,
)
from shardwise.engine.generate import HFGenerator
from shardwise.errors import ShardwiseError
from shardwise.jobs.inputs import check_eval

EXAMPLE = str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")
INLINE = ["model.path=null", TINY_QWEN3]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pass_at_k_equals_the_closed_form_and_the_count_over_subsets(n):
    for c in range(n + 1):
        right = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(right, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            closed = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12) == pytest.approx(closed, abs=1e-12)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def _row(index, sample, reward, pred, source=None, greedy=False):
    return {"index": index, "sample": sample, "greedy": greedy, "reward": reward, "pred": pred,
            "data_source": source}


def test_eval_metrics_on_hand_built_rows():
    rows = [
        _row(0, 0, 1.0, "a", "s1", greedy=True), _row(1, 0, 0.5, "x", "s2", greedy=True),
        # prompt 0 (s1): answers b, a, a, b -> maj@2 is a tie b/a: b (seen first), wrong;
        # maj@4 is a tie 2/2: b again; maj@3: a (2 of 3), right
        _row(0, 0, 0.0, "b", "s1"), _row(0, 1, 1.0, "a", "s1"), _row(0, 2, 1.0, "a", "s1"), _row(0, 3, 0.0, "b", "s1"),
        # prompt 1 (s2): the samples come in out of order; all wrong but rewards differ
        _row(1, 3, 0.25, "z", "s2"), _row(1, 0, 0.5, "y", "s2"), _row(1, 1, 0.0, "z", "s2"), _row(1, 2, 0.75, "y", "s2"),
    ]
    m = eval_metrics(rows, (1, 2, 3, 4), greedy=True)
    assert m["val/accuracy"] == 0.5 and m["val/reward_mean"] == 0.75
    assert m["val/pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["val/pass@2"] == pytest.approx((1 - 1 / 6) / 2)
    assert m["val/pass@4"] == 0.5
    assert m["val/maj@1"] == 0.0 and m["val/maj@2"] == 0.0 and m["val/maj@3"] == 0.5 and m["val/maj@4"] == 0.0
    assert m["val/best@1"] == 0.25 and m["val/best@2"] == 0.75 and m["val/best@4"] == 0.875
    assert m["val/mean@2"] == pytest.approx((0.5 + 0.25) / 2) and m["val/mean@4"] == pytest.approx((0.5 + 0.375) / 2)
    assert m["val/s1/accuracy"] == 1.0 and m["val/s2/accuracy"] == 0.0
    assert m["val/s1/maj@3"] == 1.0 and m["val/s2/best@4"] == 0.75 and m["val/s2/reward_mean"] == 0.5
    # without greedy rows: reward_mean over the samples, no accuracy
    sampled = eval_metrics([r for r in rows if not r["greedy"]], (4,), greedy=False)
    assert "val/accuracy" not in sampled and sampled["val/reward_mean"] == pytest.approx(3.5 / 8)
    table = eval_table({**m, "time/eval": 1.5})
    assert table.splitlines()[0].split()[:3] == ["eval", "accuracy", "reward_mean"]
    assert [line.split()[0] for line in table.splitlines()[1:4]] == ["all", "s1", "s2"]
    assert [is_eval_step(s, 3, 7) for s in range(8)] == [True, False, False, True, False, False, True, True]
    assert [is_eval_step(s, 0, 3) for s in range(4)] == [True, False, False, True]


REWARD = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 2 == 0), "pred": solution_str[:1], "length": len(solution_str)}
'''


def _write_validation(folder: Path, rows: int = 6) -> Path:
    data = folder / "val.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "response": str(2 * i),
                                        "data_source": "even" if i % 2 == 0 else "odd"}) + "\n" for i in range(rows)))
    return data


def test_infer_samples_file_recounts_to_the_summary(tmp_path):
    """`shardwise infer` on a user-format file (two data sources), 4 samples per prompt
    scored by a dict-returning verl-form reward with ``pred``: the samples file holds every
    answer with the data's prompt, the reward's extra keys and its pred, and pass@k / maj@k
    / best@k / mean@k counted directly from it (closed form, Counter) are the summary's."""
    data = _write_validation(tmp_path)
    (tmp_path / "my_reward.py").write_text(REWARD)
    run = tmp_path / "run"
    res = run_cli(["infer", EXAMPLE, *INLINE, f"run.dir={run}", f"data.source={data}", "infer.reward=my_reward:score",
                   "infer.temperature=1.0", "infer.n=4", "eval.k=[1,2,4]", "infer.max_new_tokens=5"],
                  timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "infer_summary.json").read_text())
    got = [json.loads(x) for x in (run / "samples" / "step_0000000.jsonl").read_text().splitlines()]
    generations = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert summary["samples"] == str(run / "samples" / "step_0000000.jsonl")
    assert [(r["index"], r["sample"]) for r in got] == [(i, j) for i in range(6) for j in range(4)]
    for r, g in zip(got, generations, strict=True):
        assert r["prompt"] == f"{r['index']}+{r['index']}=" and r["ground_truth"] == str(2 * r["index"])
        assert r["response"] == g["response"] and r["reward"] == g["score"] == float(len(r["response"]) % 2 == 0)
        assert r["pred"] == r["response"][:1] and r["length"] == len(r["response"]) and r["step"] == 0
        assert r["data_source"] == ("even" if r["index"] % 2 == 0 else "odd") and r["greedy"] is False

    def recount(rows, prefix):
        by = {}
        for r in rows:
            by.setdefault(r["index"], []).append(r)
        out = {f"{prefix}reward_mean": sum(r["reward"] for r in rows) / len(rows)}
        for k in (1, 2, 4):
            passes, majs, bests, means = [], [], [], []
            for g in by.values():
                c = sum(r["reward"] >= 1 for r in g)
                passes.append(1 - math.comb(len(g) - c, k) / math.comb(len(g), k))
                first = g[:k]
                votes = Counter(r["pred"] for r in first)
                top = max(votes.values())
                winner = next(r for r in first if votes[r["pred"]] == top)  # a tie: the answer seen first
                majs.append(float(winner["reward"] >= 1))
                bests.append(max(r["reward"] for r in first))
                means.append(sum(r["reward"] for r in first) / k)
            out |= {f"{prefix}pass@{k}": sum(passes) / len(by), f"{prefix}maj@{k}": sum(majs) / len(by),
                    f"{prefix}best@{k}": sum(bests) / len(by), f"{prefix}mean@{k}": sum(means) / len(by)}
        return out

    expected = recount(got, "val/")
    for source in ("even", "odd"):
        expected |= recount([r for r in got if r["data_source"] == source], f"val/{source}/")
    assert {k: v for k, v in summary.items() if k.startswith("val/")} == pytest.approx(expected, abs=1e-12)
    assert 0 < summary["val/pass@4"] and summary["val/pass@1"] < 1  # right and wrong answers both
    assert "val/accuracy" not in summary  # sampled: no greedy answer
    table = [line.split() for line in res.stdout.splitlines() if line.strip().startswith(("eval ", "all ", "odd "))]
    assert table[0][:3] == ["eval", "reward_mean", "pass@1"] and len(table) == 3, res.stdout
    assert f"{summary['val/pass@4']:.1%}" in res.stdout


def test_validation_data_are_checked_before_launch(tmp_path):
    """eval.source: a missing file and a row without ground truth are one line naming the
    key, the file and the row (exit status 2), from `check_eval` before anything starts;
    so is a keep_best that the evaluation does not give (the nearest name suggested)."""
    data = _write_validation(tmp_path, rows=3)
    base = [*INLINE, "data.source=builtin:arithmetic", "rl.reward.function=builtin:arithmetic"]

    def error(*overrides):
        with pytest.raises(ShardwiseError) as e:
            check_eval(load_config(EXAMPLE, [*base, *overrides]), "rl")
        message = str(e.value)
        assert e.value.exit_status == 2 and len(message.splitlines()) == 1, message
        return message

    assert "eval.source" in error(f"eval.source={tmp_path / 'nope.jsonl'}") and "nope.jsonl" in error(
        f"eval.source={tmp_path / 'nope.jsonl'}")
    lines = data.read_text().splitlines()
    data.write_text("\n".join([lines[0], json.dumps({"prompt": "1+1=", "data_source": "odd"}), lines[2]]) + "\n")
    message = error(f"eval.source={data}")
    assert "data.response_key" in message and "val.jsonl" in message and "line 2" in message, message
    message = error("checkpoint.keep_best=val/acuracy")
    assert "checkpoint.keep_best" in message and "val/accuracy" in message, message
    assert "eval.k" in error("eval.k=[1,8]")  # more than rl.rollout.n samples per prompt

    plan = check_eval(load_config(EXAMPLE, [*base, "eval.num_prompts=5", "checkpoint.keep_best=val/pass@4"]), "rl")
    assert plan is not None and plan.builtin and len(plan.records) == 5 and plan.ks == (1, 4) and plan.n == 4
    assert check_eval(load_config(EXAMPLE, [*base, "rl.heldout_eval=false"]), "rl") is None


EXTRACTING = '''
def score(prompt, response, ground_truth):
    return float(response[:1] == "a")

def extract(response):
    return response[:1].upper()
'''


def test_evaluate_asks_greedy_and_keyed_samples_and_counts_its_rows(tmp_path, monkeypatch):
    """`evaluate` with a real HF generator on a tiny model: the greedy pass is seeded 0 and
    greedy, the sampled one carries the job's seed and sample_key "heldout-{i}/{j}", both the
    plan's max_new_tokens; its metrics are `eval_metrics` of its rows; ``pred`` comes from
    the ``extract`` beside a module:function reward (`extract_fn`; none for a built-in)."""
    (tmp_path / "my_extracting.py").write_text(EXTRACTING)
    monkeypatch.chdir(tmp_path)
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, vocab_size=len(tok),
                                         max_position_embeddings=64))
    gen = HFGenerator(model, InferConfig(temperature=1.0), Runtime(0, 1, 0, torch.device("cpu"), "gloo"),
                      tok.pad_token_id, tok.eos_token_id)
    asked = []

    def generate(batch):
        asked.append(batch)
        return gen.generate_sequences(batch)

    records = [{"prompt": f"{i}+1=", "response": str(i + 1), "data_source": "ab"[i % 2]} for i in range(3)]
    plan = EvalPlan("val.jsonl", records, greedy=True, n=3, ks=(1, 3), reward="my_extracting:score", every_steps=0,
                    samples_logged=2, max_new_tokens=4, builtin=False)
    assert extract_fn("builtin:arithmetic") is None and extract_fn(None) is None
    extract = extract_fn(plan.reward)
    res = evaluate(generate, tok, plan, resolve_reward_fn(plan.reward), seed=7, max_length=16, step=5, timeout_s=10,
                   timeout_key="rl.reward.timeout_s", extract=extract, progress=False, chunk_prompts=2)
    assert [(b.meta["seed"], b.meta["greedy"], b.meta["max_new_tokens"], len(b)) for b in asked] == \
        [(0, True, 4, 2), (0, True, 4, 1), (7, False, 4, 6), (7, False, 4, 3)]
    assert [list(b.arrays["sample_key"]) for b in asked[2:]] == \
        [[f"heldout-{i}/{j}" for i in (0, 1) for j in range(3)], [f"heldout-2/{j}" for j in range(3)]]
    assert [(r["index"], r["sample"], r["greedy"]) for r in res.rows] == \
        [(i, 0, True) for i in range(3)] + [(i, j, False) for i in range(3) for j in range(3)]
    assert all(r["pred"] == r["response"][:1].upper() and r["step"] == 5 for r in res.rows)
    assert all(r["reward"] == float(r["response"][:1] == "a") for r in res.rows)
    metrics = dict(res.metrics)
    assert metrics.pop("time/eval") >= 0 and metrics == eval_metrics(res.rows, (1, 3), greedy=True)
    assert {"val/accuracy", "val/a/pass@3", "val/b/maj@1"} <= set(metrics)


def test_a_user_extract_that_raises_or_hangs_is_contained():
    """An ``extract`` that raises leaves that answer's pred unknown (said in the row) and the
    evaluation goes on; one that does not return within the reward's timeout stops it with
    one line naming the function and the setting."""
    def broken(response):
        raise KeyError(response)

    def slow(response):
        time.sleep(30)
        return response  # had it not been stopped, a pred and no error

    record = {"prompt": "1+1=", "response": "2"}
    row = answer_row(step=0, index=0, sample=0, greedy=True, record=record, response=" 2 ", reward=1.0,
                     extract=bounded_extract(broken, 5.0, "infer.reward_timeout_s"))
    assert row["pred"] is None and row["extract_error"].startswith("KeyError")
    assert answer_row(step=0, index=0, sample=0, greedy=True, record=record, response=" 2 ", reward=1.0,
                      info={"pred": 2, "why": "x"})["pred"] == 2
    assert answer_row(step=0, index=0, sample=0, greedy=True, record=record, response=" 2 ", reward=1.0)["pred"] == "2"
    with pytest.raises(RewardFunctionError) as e:
        answer_row(step=0, index=0, sample=0, greedy=True, record=record, response="2", reward=1.0,
                   extract=bounded_extract(slow, 0.2, "infer.reward_timeout_s"))
    assert "slow" in str(e.value) and "infer.reward_timeout_s" in str(e.value) and len(str(e.value).splitlines()) == 1
