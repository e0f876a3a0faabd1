"""Padding-free RL forwards (``rl.packing``) and token-budget micro-batches
(``rl.actor.max_tokens_per_micro_batch``, ``rl.log_prob_max_tokens_per_micro_batch``).

The packed layout runs a micro-batch's real tokens as one row, positions restarting per
sequence and no attention mask: transformers then masks attention per sequence. Its
log-probs, entropies and gradients must be the padded rows' up to the order of fp32 sums,
for each attention implementation that runs on CPU, with the chunked LM head and a tied
head; the actor's update with packing and token budgets must equal the padded update with
fixed micro-batches (the loss is normalised by the global mini-batch's counts).
"""

from __future__ import annotations

import pytest
import torch
from dist.common import FP32, TINY_LLAMA, TINY_QWEN3, assert_trained_params_close, full_params
from dist.launcher import REPO_ROOT, run_ranks
from test_rl_actor import BASE, shares

EXAMPLES = REPO_ROOT / "examples"


def rl_rows(rows: int = 6, prompt: int = 5, resp: int = 9, seed: int = 3):
    """Worker-layout rows: prompts left-padded by 0-2, responses of 1-9 tokens right-padded."""
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (rows, prompt + resp), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        n = 1 + (r * 4) % resp
        attn[r, : r % 3] = 0
        attn[r, prompt + n:] = 0
        mask[r, prompt: prompt + n] = 1
    ids[attn == 0] = 0
    return ids, attn, default_position_ids(attn), mask


def tiny_model(spec: str, attn: str):
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    cfg = load_config(None, [spec, *FP32, f"model.attn_implementation={attn}"])
    return build_full_model(cfg.model, seed=1).float()


@pytest.mark.parametrize("spec,attn,chunk", [
    (TINY_QWEN3, "sdpa", None), (TINY_QWEN3, "eager", None), (TINY_QWEN3, "sdpa", 5), (TINY_LLAMA, "sdpa", None),
], ids=["qwen3-sdpa", "qwen3-eager", "qwen3-chunked-head", "llama-tied-head"])
def test_packed_and_compact_log_probs_and_gradients_equal_the_padded_rows(spec, attn, chunk):
    from shardwise.engine import packing
    from shardwise.engine.infer import compute_log_probs

    model = tiny_model(spec, attn)
    ids, attn_mask, pos, mask = rl_rows()
    got = {}
    for layout in packing.LAYOUTS:
        model.zero_grad()
        out = compute_log_probs(model, ids, attn_mask, pos, with_entropy=True, temperature=0.7,
                                chunk_tokens=chunk, layout=layout)
        (out["log_probs"] * mask).sum().backward()
        got[layout] = ({k: v.detach().masked_fill(mask == 0, 0.0) for k, v in out.items()},
                       {n: p.grad.clone() for n, p in model.named_parameters()})
    ref, ref_grads = got["padded"]
    assert float(ref["log_probs"].abs().sum()) > 1.0  # not vacuous
    for layout in ("packed", "compact"):
        values, grads = got[layout]
        for k in ref:
            torch.testing.assert_close(values[k], ref[k], rtol=0, atol=1e-5, msg=f"{layout} {k}")
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=f"{layout} grad {n}")


def test_layouts_hold_only_real_tokens_and_unpack_back():
    from shardwise.engine import packing

    ids, attn, pos, _ = rl_rows()
    real = int(attn.sum())
    packed = packing.compact(ids, attn, pos, packed=True)
    longest = int(attn.sum(-1).max())
    # rows as wide as the longest sequence, first-fit: fewer rows than sequences, little padding
    assert packed.input_ids.shape[1] == longest and packed.attention_mask is None
    assert real <= packed.input_ids.numel() < real + longest and packed.input_ids.shape[0] < len(ids)
    assert torch.equal(packed.unpack(packed.input_ids), ids)  # pads are 0 in ids too
    assert torch.equal(packed.unpack(packed.position_ids), pos * attn)
    compact = packing.compact(ids, attn, pos, packed=False)
    assert compact.input_ids.shape == (len(ids), int(attn.sum(-1).max()))
    assert torch.equal(compact.unpack(compact.input_ids), ids)
    assert packing.padding_share([attn.sum(-1).tolist()], [ids.shape[1]]) == pytest.approx(1 - real / ids.numel())


def test_token_budget_groups_hold_every_row_once_within_the_budget():
    from shardwise.engine import packing

    lengths = [30, 7, 12, 25, 3, 18, 9, 14]
    for packed in (False, True):
        groups = packing.micro_batch_rows(lengths, 2, 40, packed, "rl.actor.max_tokens_per_micro_batch")
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            held = sum(lengths[i] for i in g) if packed else len(g) * max(lengths[i] for i in g)
            assert held <= 40 and g == sorted(g)
    assert packing.micro_batch_rows(lengths, 3, None, True, "k") == [[0, 1, 2], [3, 4, 5], [6, 7]]


def spread_batch():
    """Worker-layout rows whose lengths spread from 3 to 16 tokens (prompts of 3-4, answers
    of 1-12), so packed rows hold several sequences each; advantages of both signs, old
    log-probs off-policy enough to clip."""
    from shardwise.data.batch import Batch

    ids, attn, pos, mask = rl_rows(rows=8, prompt=4, resp=12, seed=9)
    for r, n in enumerate([12, 1, 2, 10, 1, 3, 11, 2]):
        attn[r] = 0
        attn[r, r % 2:4 + n] = 1
        mask[r] = 0
        mask[r, 4:4 + n] = 1
    ids[attn == 0] = 0
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(2)
    adv = torch.randn(ids.shape, generator=g) * mask
    noise = 0.3 * torch.randn(ids.shape, generator=g)
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": mask, "advantages": adv}), noise


def spread_actor_body(rank: int, world: int, overrides: list[str], split: tuple[int, ...] | None) -> dict:
    """Score, reference-score, update (off-policy old log-probs, KL loss) and score again
    `spread_batch`'s rows: rank r's share of `split`, or all of them on every rank (None:
    one sequence-parallel group)."""
    import os

    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.distributed import ulysses
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.actor import ActorWorker, ReferenceWorker

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    if os.environ.get("SHARDWISE_TEST_ONE_SEGMENT"):  # a control: packed sequences attend to each other
        ulysses._segments = lambda pos: torch.zeros_like(pos)
    actor = ActorWorker(cfg, runtime)
    init = full_params(actor.model)
    batch, noise = spread_batch()
    if split is not None:
        batch, noise = batch[shares(split)[rank]], noise[shares(split)[rank]]
    scored = actor.compute_log_prob(batch)
    reference = ReferenceWorker(cfg, runtime)
    ref = reference.compute_ref_log_prob(batch)
    split_seq = [actor.engine.sp_group is not None, reference.engine.sp_group is not None]
    t = batch.tensors
    infer = reference.engine.log_probs(t["input_ids"], t["attention_mask"], t["response_mask"],
                                       layout="packed", max_tokens_per_micro_batch=30)["log_probs"]
    mask = batch.tensors["response_mask"].bool()
    old = (scored.tensors["old_log_probs"] + noise).masked_fill(~mask, 0.0)
    batch = batch.union(Batch.from_dict({"old_log_probs": old,
                                         "ref_log_probs": ref.tensors["ref_log_probs"] - 0.2 * noise}))
    metrics = actor.update_actor(batch)
    after = actor.compute_log_prob(batch)
    params = full_params(actor.model)  # collective
    teardown()
    return {"metrics": metrics, "init": init if rank == 0 else None, "params": params if rank == 0 else None,
            "split": split_seq, "before": scored.tensors["old_log_probs"], "entropy": scored.tensors["entropy"],
            "ref": ref.tensors["ref_log_probs"], "infer": infer, "after": after.tensors["old_log_probs"]}


def test_actor_update_with_packing_and_token_budgets_equals_the_padded_fixed_one():
    """2 ranks holding 6 and 2 rows (2 mini-batches, 2 epochs, KL and entropy terms):
    packed forwards with token budgets (so the ranks hold different numbers of
    micro-batches, packed rows several sequences) against padded rows one per micro-batch."""
    from shardwise.engine import packing

    split = (6, 2)
    lengths = spread_batch()[0].tensors["attention_mask"].sum(-1).tolist()
    assert len(packing.pack_rows(lengths[:6])) < 6  # rows that share a packed row
    padded = run_ranks(spread_actor_body, 2, [*BASE, "rl.packing=false"], split, timeout=180)
    packed = run_ranks(spread_actor_body, 2, [*BASE, "rl.packing=true", "rl.actor.max_tokens_per_micro_batch=24",
                                              "rl.log_prob_max_tokens_per_micro_batch=40"], split, timeout=180)
    for r in range(2):
        torch.testing.assert_close(packed[r]["before"], padded[r]["before"], rtol=0, atol=1e-5)
        # after 4 AdamW steps whose params agree as assert_trained_params_close allows: a
        # log-prob of magnitude ~4 then to a relative 1e-5
        torch.testing.assert_close(packed[r]["after"], padded[r]["after"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[r]["ref"], packed[r]["before"], rtol=0, atol=1e-6)
    m1, m2 = padded[0]["metrics"], packed[0]["metrics"]
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # 2 epochs x 2 mini-batches of AdamW at lr 1e-2 (see assert_trained_params_close)
    assert_trained_params_close(packed[0]["params"], padded[0]["params"], padded[0]["init"], lr=1e-2, steps=4)
    assert float((padded[0]["after"] - padded[0]["before"]).abs().max()) > 1e-2  # the update moved the policy


@pytest.mark.parametrize("overrides,fragment", [
    (["rl.actor.max_tokens_per_micro_batch=20"], "'rl.actor.max_tokens_per_micro_batch': 20 tokens do not hold"),
    (["rl.log_prob_max_tokens_per_micro_batch=8"], "raise it to at least"),
])
def test_a_budget_below_the_longest_row_is_one_line_exit_2(overrides, fragment, capsys, tmp_path, monkeypatch):
    from shardwise.cli import main

    monkeypatch.chdir(REPO_ROOT)
    code = main(["rl", str(EXAMPLES / "grpo_reverse.yaml"), f"run.dir={tmp_path / 'run'}",
                 "model.path=missing-is-checked-later", *overrides, "--nproc", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and fragment in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
