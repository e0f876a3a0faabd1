"""Evaluation (`shardwise.engine.evaluate`, issue 29): the metrics' math against direct
counts, and `shardwise infer` on a user-format validation file whose samples file, read
back, gives the figures the summary reports.

- `pass_at_k` equals the closed form and a brute-force enumeration of the k-subsets;
- `eval_metrics` on hand-built rows: accuracy, reward_mean, pass@k, maj@k (the reward's
  ``pred``; a tie goes to the answer seen first; only the first k samples vote), best@k,
  mean@k, per data_source;
- the real CLI: `shardwise infer` on a jsonl with prompt / response / data_source (two
  sources), sampled, scored by a user's dict-returning reward with a ``pred``: the samples
  file's rows, and pass@k / maj@k recounted from it equal the summary's val/*;
- validation data are checked before launch: a missing file, a row without ground truth
  (exit 2, one line naming the key, file and row).
"""

from __future__ import annotations

import itertools
import math

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT

from shardwise.engine.evaluate import eval_metrics, eval_table, is_eval_step, pass_at_k

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
