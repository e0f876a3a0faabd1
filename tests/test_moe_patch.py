"""The MoE expert patch (`shardwise.models.patches.moe`): transformers 5's fused experts
split into one Qwen3MoeMLP per expert, every expert run on every rank.

- the split model computes what the fused one does (logits, gradients, generation);
- 2 ranks with every expert its own FSDP unit, on batches where the ranks route tokens to
  different experts (recorded, and asserted to happen), train like the unsharded fused
  model: losses within 1e-5 relative, parameters within 2e-6 (the parity tolerance of
  tests/test_parity.py), and no rank waits on another;
- config mistakes name the key and the way out.
Export of a patched model (live and from a DCP checkpoint, loaded by plain transformers)
is a row of tests/test_export.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist.common import (
    FP32,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
    full_params,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
    reference_run,
)
from dist.launcher import run_ranks

from shardwise.config import load_config
from shardwise.config.validate import mesh_spec
from shardwise.errors import ConfigError
from shardwise.fsdp.build import plan_for
from shardwise.models.patches.moe import PerExpertMoE, split_moe_experts

PATCH = ["fsdp.moe_expert_patch=true", "fsdp.wrap.moe_experts=[Qwen3MoeMLP]"]
# 16 experts, top-1, one 12-token row per micro-batch: each rank leaves some experts without
# tokens that the other rank uses (the case that deadlocks per-expert units unpatched).
SPARSE = TINY_QWEN3_MOE.replace("num_experts: 8, num_experts_per_tok: 2", "num_experts: 16, num_experts_per_tok: 1")
BASE = ["train.optimizer.lr=1e-3", "train.scheduler.warmup_steps=2", "train.max_steps=4", "train.grad_clip=1.0"]


def fused_names(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert parameter names -> transformers 5's fused ones (gate and up concatenated)."""
    out, experts = {}, {}
    for k, v in per_expert.items():
        head, sep, tail = k.partition(".mlp.experts.")
        if not sep:
            out[k] = v
            continue
        e, _, proj = tail.partition(".")
        experts.setdefault(head, {}).setdefault(int(e), {})[proj] = v
    for head, by_e in experts.items():
        order = sorted(by_e)
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_e[e]["gate_proj.weight"], by_e[e]["up_proj.weight"]]) for e in order])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([by_e[e]["down_proj.weight"] for e in order])
    return out


def test_split_model_computes_what_the_fused_model_does():
    from shardwise.models.loading import build_full_model

    cfg = load_config(None, [TINY_QWEN3_MOE, *FP32])
    fused = build_full_model(cfg.model, 0)
    split = copy.deepcopy(fused)
    assert split_moe_experts(split) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = split.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, PerExpertMoE) and len(experts) == 8
    assert type(experts[0]).__name__ == "Qwen3MoeMLP"
    torch.testing.assert_close(fused_names(split.state_dict()), fused.state_dict(), rtol=0, atol=0)

    ids = torch.randint(1, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    out_f, out_s = fused(input_ids=ids, labels=ids), split(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_s.logits, out_f.logits, rtol=0, atol=1e-6)
    out_f.loss.backward()
    out_s.loss.backward()
    grads = fused_names({k: p.grad for k, p in split.named_parameters()})
    for k, p in fused.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=0, atol=1e-6, msg=k)
    assert sum(experts.tokens_per_expert) == 3 * 10 * 2  # every (token, slot) pair routed once

    with torch.no_grad():
        gen_f = fused.generate(input_ids=ids[:, :4], max_new_tokens=5, do_sample=False)
        gen_s = split.generate(input_ids=ids[:, :4], max_new_tokens=5, do_sample=False)
    assert torch.equal(gen_f, gen_s)


def _patched_training(rank: int, world: int, overrides: list[str]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    engine = TrainEngine(load_config(None, overrides), runtime)
    counts: list[list[int]] = []
    units = 0
    for mod in engine.model.modules():
        if isinstance(mod, PerExpertMoE):
            mod.register_forward_hook(lambda m, args, out: counts.append(list(m.tokens_per_expert)))
            units += sum(hasattr(e, "unshard") for e in mod)  # FSDPModule per expert
    losses = []
    for step in range(4):
        rows = make_global_batch(step, 4)
        losses.append(engine.train_step(micro_batches_of(rows, rank, world, 1), loss_tokens(rows)).loss)
    params = full_params(engine.model)
    teardown()
    return {"losses": losses, "counts": counts, "units": units, "params": params if rank == 0 else None}


def test_per_expert_units_on_two_ranks_train_like_the_unsharded_fused_model():
    overrides = [SPARSE, *FP32, *BASE, *PATCH]
    ranks = run_ranks(_patched_training, 2, overrides, timeout=240)
    assert ranks[0]["units"] == 32  # 2 layers x 16 experts, each its own fully_shard unit
    # The ranks routed differently: some expert had tokens on one rank and none on the other
    # in the same forward (4 steps x 2 micro-batches x 2 layers = 16 forwards per rank).
    c0, c1 = ranks[0]["counts"], ranks[1]["counts"]
    assert len(c0) == len(c1) == 16
    differing = sum((a == 0) != (b == 0) for f0, f1 in zip(c0, c1) for a, b in zip(f0, f1))
    assert differing > 0, (c0, c1)

    ref = reference_run([SPARSE, *FP32, *BASE], 4, 4, 1)  # one process, HF's fused experts
    assert ranks[1]["losses"] == ranks[0]["losses"]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    got = fused_names(ranks[0]["params"])
    assert got.keys() == ref["params"].keys()
    for k in got:
        torch.testing.assert_close(got[k], ref["params"][k], rtol=0, atol=2e-6, msg=k)


def _training_without_the_patch(rank: int, world: int, overrides: list[str]) -> dict:
    """Per-expert units whose layer calls only the experts its tokens were routed to (what
    HF's own MoE loop does): the counterfactual the patch exists for."""
    def routed_only(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        routed = torch.nn.functional.one_hot(top_k_index, num_classes=len(self)).permute(2, 1, 0)
        for e, expert in enumerate(self):
            slot, token = torch.where(routed[e])
            if token.numel():
                out.index_add_(0, token, expert(hidden_states[token]) * top_k_weights[token, slot, None])
        return out

    PerExpertMoE.forward = routed_only  # this rank process only
    return _patched_training(rank, world, overrides)


def test_without_running_every_expert_the_ranks_fall_out_of_step():
    # Observed on gloo within seconds: one rank aborts (SIGABRT) inside an expert's all-gather
    # that the other rank issued for another expert, and its peer loses the connection.
    # NCCL would hang until its timeout instead.
    with pytest.raises(AssertionError, match="failed after"):
        run_ranks(_training_without_the_patch, 2, [SPARSE, *FP32, *BASE, *PATCH], timeout=90)


def test_patch_on_a_dense_model_is_an_error():
    cfg = load_config(None, [TINY_QWEN3, "fsdp.moe_expert_patch=true"])
    with pytest.raises(ConfigError, match="fsdp.moe_expert_patch.*it has no MoE experts.*moe_expert_patch=false"):
        plan_for(cfg, mesh_spec(cfg.parallel, 2))


def test_per_expert_wrap_without_the_patch_says_how():
    cfg = load_config(None, [TINY_QWEN3_MOE, "fsdp.wrap.moe_experts=[Qwen3MoeMLP]"])
    with pytest.raises(ConfigError, match=r"fsdp.wrap.moe_experts\[0\].*experts are fused \(Qwen3MoeExperts.*"
                                          r"set fsdp.moe_expert_patch=true"):
        plan_for(cfg, mesh_spec(cfg.parallel, 2))
    # the fused module itself may be a unit, patch or not
    cfg = load_config(None, [TINY_QWEN3_MOE, "fsdp.wrap.moe_experts=[Qwen3MoeExperts]"])
    assert "model.layers.1.mlp.experts" in [u.path for u in plan_for(cfg, mesh_spec(cfg.parallel, 2))[1].units]


def test_plan_of_a_patched_model_names_every_expert():
    cfg = load_config(None, [TINY_QWEN3_MOE, *PATCH])
    model, plan = plan_for(cfg, mesh_spec(cfg.parallel, 2))
    units = [u.path for u in plan.units]
    assert [p for p in units if ".experts." in p] == [f"model.layers.{i}.mlp.experts.{e}" for i in range(2)
                                                      for e in range(8)]
    assert all(p.device.type == "meta" for p in model.parameters())
    # the per-expert container itself may be one unit too (it has a forward)
    cfg = load_config(None, [TINY_QWEN3_MOE, "fsdp.moe_expert_patch=true",
                             "fsdp.wrap.moe_experts=[model.layers.{*}.mlp.experts]"])
    assert "model.layers.0.mlp.experts" in [u.path for u in plan_for(cfg, mesh_spec(cfg.parallel, 2))[1].units]
