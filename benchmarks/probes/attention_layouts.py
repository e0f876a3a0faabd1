"""Attention forward + backward per micro-batch and layer: packed rows with a block-diagonal
mask (what runs) against each sequence alone in length buckets with ``is_causal``.

    python benchmarks/probes/attention_layouts.py RUN_FOLDER FIRST_STEP END_STEP

The lengths come from the batches ``rl.record_batches`` wrote under RUN_FOLDER; the tensors are
random (4 query and 2 key/value heads of 32), one thread. results/update_profile/README.md
has what it showed.
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from transformers.masking_utils import find_packed_sequence_indices  # noqa: E402

from shardwise.data.batch import Batch  # noqa: E402
from shardwise.engine.packing import compact  # noqa: E402

torch.set_num_threads(1)
BD = sys.argv[1]
H, KV, D = 4, 2, 32


def packed(q, k, v, mask) -> None:
    """(a) packed rows, block-diagonal mask (what transformers builds for sdpa)."""
    kk = k.repeat_interleave(H // KV, 1)
    vv = v.repeat_interleave(H // KV, 1)
    o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    o.sum().backward()


def bucketed(qf, kf, vf, idxs) -> None:
    """(b) flat tokens; sequences bucketed by length, each bucket padded to its longest, is_causal."""
    outs = []
    for gi, valid in idxs:
        qq = qf[0][:, gi].transpose(0, 1)
        kk = kf[0][:, gi].transpose(0, 1)
        vv = vf[0][:, gi].transpose(0, 1)
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)  # (nb, H, Lm, D)
        outs.append(o.transpose(0, 1)[:, valid])
    out = torch.cat(outs, 1)  # (H, N', D) in bucket order
    out.sum().backward()


res = {"packed": [], "bucket": []}
for step in range(int(sys.argv[2]), int(sys.argv[3])):
    b = Batch.from_bytes(open(f"{BD}/batches/step_{step:08d}.batch", "rb").read())
    am = b.tensors["attention_mask"]
    for mb in range(2):
        m = am[mb * 64:(mb + 1) * 64]
        lengths = m.sum(-1).tolist()
        lay = compact(b.tensors["input_ids"][mb * 64:(mb + 1) * 64], m, None, packed=True)
        R, W = lay.input_ids.shape
        N = sum(lengths)
        seg = find_packed_sequence_indices(lay.position_ids)
        causal = torch.ones(W, W, dtype=torch.bool).tril()
        mask = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
        q = torch.randn(R, H, W, D, requires_grad=True)
        k = torch.randn(R, KV, W, D, requires_grad=True)
        v = torch.randn(R, KV, W, D, requires_grad=True)
        qf = torch.randn(1, H, N, D, requires_grad=True)
        kf = torch.randn(1, KV, N, D, requires_grad=True)
        vf = torch.randn(1, KV, N, D, requires_grad=True)
        order = sorted(range(len(lengths)), key=lambda i, lengths=lengths: lengths[i])
        starts = [0]
        for L in lengths:
            starts.append(starts[-1] + L)
        # buckets: consecutive in sorted order; cut when padding would exceed 1/8
        buckets, cur = [], []
        for i in order:
            grown = [*cur, i]
            if cur and lengths[i] * len(grown) - sum(lengths[j] for j in grown) > 0.125 * sum(lengths[j] for j in grown):
                buckets.append(cur)
                cur = []
            cur.append(i)
        buckets.append(cur)
        idxs = []
        for bk in buckets:
            Lm = max(lengths[i] for i in bk)
            # gather index (len(bk), Lm) into flat tokens; pad positions point to token 0 (discarded)
            gi = torch.zeros(len(bk), Lm, dtype=torch.long)
            valid = torch.zeros(len(bk), Lm, dtype=torch.bool)
            for r, i in enumerate(bk):
                gi[r, :lengths[i]] = torch.arange(starts[i], starts[i] + lengths[i])
                valid[r, :lengths[i]] = True
            idxs.append((gi, valid))
        for name, fn in (("packed", lambda: packed(q, k, v, mask)),  # noqa: B023 (called in this iteration)
                         ("bucket", lambda: bucketed(qf, kf, vf, idxs))):  # noqa: B023
            fn()
            t = time.perf_counter()
            for _ in range(3):
                fn()
            res[name].append((time.perf_counter() - t) / 3)
    print(step, R, W, N, len(buckets), {k: f"{v[-1] * 1e3:.1f}ms" for k, v in res.items()})
print({k: f"{sum(v) / len(v) * 1e3:.1f} ms per micro-batch per layer" for k, v in res.items()})
