import sys
sys.path.insert(0, "src")
from shardwise.data.batch import Batch
from shardwise.engine.packing import pack_rows
from shardwise.data.sampler import token_budget_micro_batches
BD, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for budget in [None, 1500, 2000, 3000, 4000, 6000]:
    pad = att = real = comp = nmb = 0
    for s in range(a, b):
        bt = Batch.from_bytes(open(f"{BD}/batches/step_{s:08d}.batch", "rb").read())
        L = bt.tensors["attention_mask"].sum(-1).tolist()
        rows = list(range(len(L)))
        mbs = [rows[i:i+64] for i in range(0, len(rows), 64)] if budget is None else token_budget_micro_batches(rows, L, budget, packed=True, key="k")
        for mb in mbs:
            ls = [L[i] for i in mb]; W = max(ls); bins = pack_rows(ls)
            comp += len(bins) * W; real += sum(ls); att += len(bins) * W * W; nmb += 1
    print(f"budget {budget}: micro-batches/step {nmb/(b-a):.1f}, padding {1-real/comp:.3f}, attention W^2 per real token {att/real:.1f}, computed tokens {comp/(b-a):.0f}")
