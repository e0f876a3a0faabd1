"""Ulysses sequence parallel (`shardwise.distributed.ulysses`).

- `slice_batch`: padding to a multiple of sp, labels shifted before slicing, positions of
  the whole sequence, right padding enforced;
- the attention itself on 2 and 4 real gloo ranks equals causal sdpa on the whole sequence,
  outputs and gradients of q / k / v, with as many, fewer, and fewer-than-sp key/value heads;
- `shardwise train --nproc 2 parallel.ulysses_size=2` logs the losses of a 1-process run;
- config errors. Training parity (sp 2, dp 2 x sp 2, sp 4 with HSDP) is in test_parity.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, at_once, run_cli, run_ranks

from shardwise.cli import main
from shardwise.distributed.ulysses import slice_batch

SFT = str(REPO_ROOT / "examples" / "sft_arithmetic.yaml")


def test_slice_batch_pads_shifts_and_slices():
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    labels = torch.tensor([[-100, -100, 7, 8, 9], [-100, 6, 7, -100, -100]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    pos = torch.arange(5).expand(2, 5)
    parts = [slice_batch({"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos}, r, 2)
             for r in range(2)]
    assert [p["input_ids"].shape for p in parts] == [(2, 3), (2, 3)]  # 5 tokens padded to 6
    whole = {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
    assert whole["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0]]
    # position t predicts labels[t + 1], decided before slicing (a slice cannot see t + 1)
    assert whole["shift_labels"].tolist() == [[-100, 7, 8, 9, -100, -100], [6, 7, -100, -100, -100, -100]]
    assert whole["position_ids"].tolist() == [list(range(6))] * 2
    assert "attention_mask" not in parts[0]


def test_slice_batch_rejects_left_padding_and_packing():
    ids = torch.tensor([[0, 5, 6, 7]])
    with pytest.raises(ValueError, match="right-padded"):
        slice_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1]])}, 0, 2)
    with pytest.raises(ValueError, match="packing=false"):
        slice_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.ones(1, 1, 4, 4)}, 0, 2)


def _attention(rank: int, world: int, kv_heads: int) -> dict:
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.distributed.ulysses import sp_group, ulysses_attention

    init_distributed(timeout_s=60)
    group = sp_group(world, "cpu")
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 8, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (h, kv_heads, kv_heads))
    grad_out = torch.randn(b, s, h, d, generator=g)

    # reference: the whole sequence, plain causal sdpa, key/value heads repeated
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = h // kv_heads
    ref = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(rep, 1),
                                         full[2].repeat_interleave(rep, 1), is_causal=True, scale=0.3)
    ref = ref.transpose(1, 2)
    ref.backward(grad_out)

    n = s // world
    cut = slice(rank * n, (rank + 1) * n)
    mine = [t[:, :, cut].clone().requires_grad_() for t in (q, k, v)]
    module = SimpleNamespace(_shardwise_sp_group=group, training=False)
    out, _ = ulysses_attention(module, *mine, attention_mask=None, scaling=0.3)
    out.backward(grad_out[:, cut])
    result = {"out": (out - ref[:, cut]).abs().max().item(),
              "grads": [(m.grad - f.grad[:, :, cut]).abs().max().item() for m, f in zip(mine, full)]}
    teardown()
    return result


@pytest.mark.parametrize("world,kv_heads", [(2, 4), (2, 2), (4, 2), (4, 1)])
def test_attention_equals_whole_sequence_sdpa(world, kv_heads):
    for r in run_ranks(_attention, world, kv_heads, timeout=120):
        assert r["out"] < 1e-6 and max(r["grads"]) < 1e-6, r


def test_train_cli_with_ulysses_logs_the_losses_of_one_process(tmp_path):
    common = ["train", SFT, "train.max_steps=3", "train.micro_batch_size=8", "train.global_batch_size=16",
              "checkpoint.every_steps=0", "checkpoint.export_hf=false", "train.log_every=1"]
    one, sp = at_once(lambda: run_cli([*common, f"run.dir={tmp_path / 'one'}"], timeout=300),  # side by side
                      lambda: run_cli([*common, f"run.dir={tmp_path / 'sp'}", "parallel.ulysses_size=2", "--nproc", "2"],
                                      timeout=300))
    assert one.returncode == 0 and sp.returncode == 0, (one.stderr[-2000:], sp.stderr[-2000:])

    def losses(d, key="loss"):
        return [json.loads(x)[key] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
                if f'"{key}"' in x]

    # measured: equal to ~5e-8 relative (fp32 sums in another order)
    torch.testing.assert_close(torch.tensor(losses("sp")), torch.tensor(losses("one")), rtol=1e-5, atol=0)
    # the validation loss at the end (the built-in task's held-out examples) through the sp ranks' slices
    assert len(losses("sp", "val/loss")) == 1
    torch.testing.assert_close(torch.tensor(losses("sp", "val/loss")), torch.tensor(losses("one", "val/loss")),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("argv,key,fragment", [
    (["train", SFT, "parallel.ulysses_size=2", "data.packing=true"], "data.packing", "data.packing=false"),
    (["train", SFT, "parallel.ulysses_size=2", TINY_QWEN3.replace("num_attention_heads: 4", "num_attention_heads: 3")
      .replace("num_key_value_heads: 2", "num_key_value_heads: 1").replace("head_dim: 8", "head_dim: 8"),
      "model.path=null"], "parallel.ulysses_size", "2 does not divide the model's 3 attention heads"),
    (["rl", str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"), "parallel.ulysses_size=2", "model.path=null",
      TINY_QWEN3.replace("num_attention_heads: 4", "num_attention_heads: 3").replace("num_key_value_heads: 2",
                                                                                      "num_key_value_heads: 1")],
     "parallel.ulysses_size", "2 does not divide the model's 3 attention heads"),
    (["infer", str(REPO_ROOT / "examples" / "infer_arithmetic.yaml"), "parallel.ulysses_size=2",
      "model.path=null", TINY_QWEN3], "parallel.ulysses_size", "`shardwise infer` does not split sequences yet"),
])
def test_config_errors(argv, key, fragment, capsys, tmp_path):
    code = main([*argv, f"run.dir={tmp_path / 'run'}", "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and key in err and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
