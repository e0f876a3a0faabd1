"""Micro-batches by a token budget (issue 20, SFT part: `train.max_tokens_per_micro_batch`):
the split's properties, and an SFT run whose micro-batches are made by the budget takes
the same steps as one with fixed micro-batches (the loss is normalised by the global
batch's loss tokens, so only the order of sums differs)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from dist.launcher import REPO_ROOT, at_once, run_cli

from shardwise.data.sampler import token_budget_micro_batches
from shardwise.errors import DataError


def _cost(rows: list[int], lengths: dict[int, int], packed: bool) -> int:
    return sum(lengths[i] for i in rows) if packed else max(lengths[i] for i in rows) * len(rows)


@pytest.mark.parametrize("packed", [False, True])
def test_every_row_once_within_the_budget_and_balanced(packed):
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 40)
        idx = [100 + i for i in range(n)]
        lengths = [rng.randint(1, 64) for _ in range(n)]
        budget = rng.randint(64, 400)
        split = token_budget_micro_batches(idx, lengths, budget, packed=packed)
        by_index = dict(zip(idx, lengths))
        assert sorted(i for mb in split for i in mb) == idx
        assert all(mb == sorted(mb) for mb in split)  # rows keep their order inside a micro-batch
        costs = [_cost(mb, by_index, packed) for mb in split]
        assert max(costs) <= budget
        total = sum(lengths) if packed else None
        if packed:  # first-fit-decreasing: never more than twice the lower bound
            assert len(split) <= 2 * -(-total // budget)
    # equal rows: exactly as many micro-batches as the budget needs, filled evenly
    split = token_budget_micro_batches(list(range(10)), [8] * 10, 32)
    assert [len(mb) for mb in split] == [4, 4, 2]
    with pytest.raises(DataError, match="train.max_tokens_per_micro_batch: a row of 70 tokens"):
        token_budget_micro_batches([0, 1], [70, 3], 64)


def test_sft_with_a_token_budget_takes_the_steps_of_fixed_micro_batches(tmp_path):
    args = ["train", str(REPO_ROOT / "examples/sft_arithmetic.yaml"), "--nproc", "2", "train.max_steps=5",
            "train.log_every=1", "train.global_batch_size=16", "train.micro_batch_size=2",
            "checkpoint.every_steps=0", "checkpoint.export_hf=false", "data.max_length=16"]
    fixed, budget = tmp_path / "fixed", tmp_path / "budget"
    a, b = at_once(lambda: run_cli([*args, f"run.dir={fixed}"], timeout=300),
                   lambda: run_cli([*args, f"run.dir={budget}", "train.max_tokens_per_micro_batch=40"], timeout=300))
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    la = [json.loads(x)["loss"] for x in (fixed / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    lb = [json.loads(x)["loss"] for x in (budget / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    # fp32, the same global batches: only the order of sums differs (tests/test_parity.py's tolerance)
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-5, atol=0)
    bad = run_cli([*args, f"run.dir={tmp_path / 'bad'}", "train.max_tokens_per_micro_batch=8"], timeout=120)
    assert bad.returncode == 2 and "train.max_tokens_per_micro_batch" in bad.stderr
    assert not (tmp_path / "bad").exists()
