import os, sys, time, torch
import torch.nn.functional as F
torch.set_num_threads(1)
sys.path.insert(0, "src")
from shardwise.data.batch import Batch
from shardwise.engine.packing import compact, pack_rows
from transformers.masking_utils import sdpa_mask, packed_sequence_mask_function, causal_mask_function, and_masks, find_packed_sequence_indices
BD = sys.argv[1]; H, KV, D = 4, 2, 32
res = {"packed": [], "bucket": []}
for step in range(int(sys.argv[2]), int(sys.argv[3])):
    b = Batch.from_bytes(open(f"{BD}/batches/step_{step:08d}.batch", "rb").read())
    am = b.tensors["attention_mask"]
    for mb in range(2):
        m = am[mb*64:(mb+1)*64]
        lengths = m.sum(-1).tolist()
        lay = compact(b.tensors["input_ids"][mb*64:(mb+1)*64], m, None, packed=True)
        R, W = lay.input_ids.shape
        N = sum(lengths)
        # (a) packed rows, block-diagonal mask (what transformers builds for sdpa)
        pid = find_packed_sequence_indices(lay.position_ids)
        seg = pid
        causal = torch.ones(W, W, dtype=torch.bool).tril()
        mask = (seg[:, :, None] == seg[:, None, :]) & causal
        mask = mask[:, None]
        q = torch.randn(R, H, W, D, requires_grad=True); k = torch.randn(R, KV, W, D, requires_grad=True); v = torch.randn(R, KV, W, D, requires_grad=True)
        def a():
            kk = k.repeat_interleave(H // KV, 1); vv = v.repeat_interleave(H // KV, 1)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            o.sum().backward()
        # (b) flat tokens; sequences bucketed by length, each bucket padded to its longest, is_causal
        qf = torch.randn(1, H, N, D, requires_grad=True); kf = torch.randn(1, KV, N, D, requires_grad=True); vf = torch.randn(1, KV, N, D, requires_grad=True)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        starts = [0]
        for L in lengths: starts.append(starts[-1] + L)
        # buckets: consecutive in sorted order; cut when padding would exceed 1/8 or width doubles
        buckets = []; cur = []
        for i in order:
            if cur and lengths[i] * len(cur + [i]) - sum(lengths[j] for j in cur + [i]) > 0.125 * sum(lengths[j] for j in cur + [i]):
                buckets.append(cur); cur = []
            cur.append(i)
        buckets.append(cur)
        idxs = []
        for bk in buckets:
            Lm = max(lengths[i] for i in bk)
            # gather index (len(bk), Lm) into flat tokens; pad positions point to token 0 (discarded)
            gi = torch.zeros(len(bk), Lm, dtype=torch.long); valid = torch.zeros(len(bk), Lm, dtype=torch.bool)
            for r, i in enumerate(bk):
                gi[r, :lengths[i]] = torch.arange(starts[i], starts[i] + lengths[i]); valid[r, :lengths[i]] = True
            idxs.append((gi, valid))
        def bfn():
            out = qf.new_zeros(1, H, N, D)
            outs = []; dst = []
            for gi, valid in idxs:
                qq = qf[0][:, gi].transpose(0, 1); kk = kf[0][:, gi].transpose(0, 1); vv = vf[0][:, gi].transpose(0, 1)
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)  # (nb, H, Lm, D)
                outs.append(o.transpose(0, 1)[:, valid]); dst.append(gi[valid])
            out = torch.cat(outs, 1)  # (H, N', D) in bucket order
            out.sum().backward()
        for name, fn in (("packed", a), ("bucket", bfn)):
            fn()
            t = time.perf_counter()
            for _ in range(3): fn()
            res[name].append((time.perf_counter() - t) / 3)
    print(step, R, W, N, len(buckets), {k: f"{v[-1]*1e3:.1f}ms" for k, v in res.items()})
print({k: f"{sum(v)/len(v)*1e3:.1f} ms per micro-batch per layer" for k, v in res.items()})
