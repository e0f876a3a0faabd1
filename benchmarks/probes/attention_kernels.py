"""Attention forward + backward on packed rows: sdpa's flash and math kernels against eager.

    python benchmarks/probes/attention_kernels.py

Random tensors of two micro-batch shapes of the long and agentic tasks (rows x width), 4
query and 2 key/value heads of 32, one thread. results/update_profile/README.md has what it showed.
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

torch.set_num_threads(1)
H, KV, D = 4, 2, 32
for R, W in ((38, 91), (54, 124)):
    seg = torch.randint(0, 3, (R, W)).sort(-1).values
    mask = ((seg[:, :, None] == seg[:, None, :]) & torch.ones(W, W, dtype=torch.bool).tril())[:, None]
    q = torch.randn(R, H, W, D, requires_grad=True)
    k = torch.randn(R, KV, W, D, requires_grad=True)
    v = torch.randn(R, KV, W, D, requires_grad=True)
    addmask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))

    def flash(q=q, k=k, v=v, mask=mask):
        kk = k.repeat_interleave(2, 1)
        vv = v.repeat_interleave(2, 1)
        F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).sum().backward()

    def math(q=q, k=k, v=v, mask=mask):
        kk = k.repeat_interleave(2, 1)
        vv = v.repeat_interleave(2, 1)
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).sum().backward()

    def eager(q=q, k=k, v=v, addmask=addmask):
        kk = k.repeat_interleave(2, 1)
        vv = v.repeat_interleave(2, 1)
        s = (q @ kk.transpose(-1, -2)) * D ** -0.5 + addmask
        (s.softmax(-1) @ vv).sum().backward()

    def eager_gqa(q=q, k=k, v=v, addmask=addmask, R=R, W=W):  # no repeat: group heads into the query length
        qq = q.view(R, KV, 2 * W, D)
        s = (qq @ k.transpose(-1, -2)) * D ** -0.5 + addmask.repeat(1, 1, 2, 1)
        (s.softmax(-1) @ v).sum().backward()

    for name, fn in (("flash", flash), ("math", math), ("eager", eager), ("eager_gqa", eager_gqa)):
        fn()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        print(R, W, name, f"{(time.perf_counter() - t) / 5 * 1e3:.1f} ms")
