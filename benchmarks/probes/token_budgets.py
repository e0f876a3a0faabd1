"""Padding and attention cost of token-budget micro-batches, from recorded batches' lengths.

    python benchmarks/probes/token_budgets.py RUN_FOLDER FIRST_STEP END_STEP

RUN_FOLDER: a run's folder whose ``batches/`` ``rl.record_batches`` wrote. Nothing runs a
model. results/update_profile/README.md has what it showed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from shardwise.data.batch import Batch  # noqa: E402
from shardwise.data.sampler import token_budget_micro_batches  # noqa: E402
from shardwise.engine.packing import pack_rows  # noqa: E402

BD, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for budget in [None, 1500, 2000, 3000, 4000, 6000]:
    pad = att = real = comp = nmb = 0
    for s in range(a, b):
        bt = Batch.from_bytes(open(f"{BD}/batches/step_{s:08d}.batch", "rb").read())
        L = bt.tensors["attention_mask"].sum(-1).tolist()
        rows = list(range(len(L)))
        if budget is None:
            mbs = [rows[i:i + 64] for i in range(0, len(rows), 64)]
        else:
            mbs = token_budget_micro_batches(rows, L, budget, packed=True, key="k")
        for mb in mbs:
            ls = [L[i] for i in mb]
            W = max(ls)
            bins = pack_rows(ls)
            comp += len(bins) * W
            real += sum(ls)
            att += len(bins) * W * W
            nmb += 1
    print(f"budget {budget}: micro-batches/step {nmb / (b - a):.1f}, padding {1 - real / comp:.3f}, "
          f"attention W^2 per real token {att / real:.1f}, computed tokens {comp / (b - a):.0f}")
