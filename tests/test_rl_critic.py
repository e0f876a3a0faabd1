"""CriticWorker: values aligned with the head's output at the previous position, and the
PPO value update under 2 processes equal to the unsharded update on the same rows, with
mini-batches, 2 epochs, micro-batching and rows split unevenly between ranks.

The critic loads a tiny Qwen3 causal-LM folder (save_pretrained) through ``model.path``;
its value head is new. One 2-process run (module fixture) does every step; the
assertions run here, against a plain unsharded HF model given the critic's initial
weights and trained by the loop written out in `reference_updates` (one process, one
forward per mini-batch, torch's own grad clipping).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from dist.common import FP32, TINY_QWEN3, assert_trained_params_close, full_params
from dist.launcher import run_ranks

ROWS, PROMPT, RESP = 8, 5, 6
T = PROMPT + RESP
MINI = 2
UPDATES = 10
BASE = [*FP32, "train.micro_batch_size=2", "train.scheduler.name=constant", "train.scheduler.warmup_steps=0",
        "train.max_steps=3", "rl.critic.lr=5e-3", "rl.critic.cliprange_value=0.5", "rl.actor.ppo_epochs=2",
        f"rl.actor.ppo_mini_batches={MINI}", "rl.actor.loss_agg_mode=token-mean"]

# Rows of each rank in the 2-process run; the unsharded reference takes every row, in the
# order that makes its mini-batch k the union of the ranks' mini-batches k (`one_process_order`).
EVEN = [[0, 1, 2, 3], [4, 5, 6, 7]]
UNEVEN = [[0, 1, 2, 3, 4, 5], [6, 7]]  # mini-batches of 3 and 1 rows: 2 vs 1 micro-batches
FIRST_SPLITS = [UNEVEN, [list(range(ROWS)), []]]  # then rank 1 holds no row at all
VALUE_SPLITS = {"even": EVEN, "seven_one": [list(range(7)), [7]], "all_none": [list(range(8)), []]}


def one_process_order(split: list[list[int]], n_mini: int) -> list[int]:
    order = []
    for k in range(n_mini):
        for rows in split:
            size = len(rows) // n_mini
            order += rows[k * size:(k + 1) * size]
    return order


def rollout_batch():
    """Layout rows: prompts left-padded by 0-2, responses of 1-6 tokens right-padded; old
    values and returns drawn independently of the model (returns mostly within the clip
    range of the old values, some beyond it)."""
    from shardwise.data.batch import Batch
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 64, (ROWS, T), generator=g)
    attn = torch.ones(ROWS, T, dtype=torch.long)
    resp = torch.zeros(ROWS, T, dtype=torch.long)
    for r in range(ROWS):
        pad = r % 3
        n = 1 + (r * 5) % RESP
        attn[r, :pad] = 0
        resp[r, PROMPT:PROMPT + n] = 1
        attn[r, PROMPT + n:] = 0
    ids[attn == 0] = 0
    old = 0.2 * torch.randn(ROWS, T, generator=g) * resp
    returns = (old + 0.4 * torch.randn(ROWS, T, generator=g)) * resp
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": resp, "values": old, "returns": returns})


def critic_body(rank: int, world: int, overrides: list[str]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.errors import ConfigError
    from shardwise.rl.workers.critic import CriticWorker

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, overrides)
    critic = CriticWorker(cfg, runtime)
    out: dict = {"init": full_params(critic.engine.model)}
    full = rollout_batch()
    layout = full.select(tensor_keys=["input_ids", "attention_mask", "position_ids", "response_mask"])
    # with 1 micro-batch of 2 rows: 4 vs 1 forwards, then 4 vs 0
    out["values"] = {name: critic.compute_values(layout[split[rank]]).tensors["values"]
                     for name, split in VALUE_SPLITS.items()}
    out["training_after_values"] = critic.engine.model.training
    out["head_dropout"] = critic.engine.model.dropout.p
    out["metrics"] = [critic.update_critic(full[split[rank]]) for split in FIRST_SPLITS]
    out["first"] = full_params(critic.engine.model)
    out["metrics"] += [critic.update_critic(full[EVEN[rank]]) for _ in range(UPDATES)]
    out["final"] = full_params(critic.engine.model)
    # 3 rows on rank 0 do not cut into 2 mini-batches: every rank raises, nobody hangs.
    try:
        critic.update_critic(full[[0, 1, 2]] if rank == 0 else full[[4, 5]])
        out["error"] = None
    except ConfigError as e:
        out["error"] = (e.key, str(e))
    teardown()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 causal LM written by save_pretrained: the critic's backbone."""
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    path = tmp_path_factory.mktemp("critic_backbone")
    build_full_model(load_config(None, [TINY_QWEN3, *FP32]).model, seed=5).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def overrides(model_dir) -> list[str]:
    return [f"model.path={model_dir}", *BASE]


@pytest.fixture(scope="module")
def two(overrides) -> list[dict]:
    return run_ranks(critic_body, 2, overrides, timeout=180)


def plain_model(model_dir, params: dict[str, torch.Tensor]):
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    config.classifier_dropout = 0.0  # not a Qwen3Config field: from_pretrained would drop the kwarg
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    assert model.dropout.p == 0.0
    model.load_state_dict(params, strict=True)
    return model


def reference_values(model_dir, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """``values[:, t]`` written out: the unsharded head's output at position t - 1, each row
    run alone on its real tokens (no padding at all)."""
    model = plain_model(model_dir, params).eval()
    b = rollout_batch().tensors
    want = torch.zeros(ROWS, T)
    with torch.no_grad():
        for r in range(ROWS):
            real = b["attention_mask"][r].nonzero().flatten()
            head = model(input_ids=b["input_ids"][r, real][None]).logits[0, :, 0]
            for j, t in enumerate(real.tolist()):
                if b["response_mask"][r, t]:
                    want[r, t] = head[j - 1]
    return want


def reference_updates(model_dir, init: dict[str, torch.Tensor], overrides: list[str]) -> dict:
    """The same updates without sharding: global mini-batch k is the union of the ranks'
    mini-batches k, run as one forward, its loss normalised by its own counts."""
    from shardwise.config import load_config
    from shardwise.engine.optim import build_optimizer, build_scheduler
    from shardwise.rl.algorithms import value_loss
    from shardwise.rl.workers.common import rl_engine_config

    cfg = load_config(None, overrides)
    train = rl_engine_config(cfg, lr=cfg.rl.critic.lr).train
    model = plain_model(model_dir, init).train()
    opt = build_optimizer(model, train.optimizer)
    sched = build_scheduler(opt, train.scheduler, train.max_steps)
    clip = cfg.rl.critic.cliprange_value
    full = rollout_batch()
    calls, first = [], None
    for call, split in enumerate(FIRST_SPLITS + [EVEN] * UPDATES):
        order = one_process_order(split, MINI)
        size = len(order) // MINI
        steps = []
        for _ in range(cfg.rl.actor.ppo_epochs):
            for k in range(MINI):
                b = full[order[k * size:(k + 1) * size]].tensors
                head = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                             position_ids=b["position_ids"]).logits[..., 0]
                values = torch.cat([torch.zeros(size, 1), head[:, :-1]], dim=1)
                mask = b["response_mask"].bool()
                loss, _ = value_loss(values, b["returns"], b["values"], mask, clip=clip, mode="token-mean")
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
                lr = sched.get_last_lr()[0]
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                v, old, ret = values.detach()[mask], b["values"][mask], b["returns"][mask]
                v_clip = old + (v - old).clamp(-clip, clip)
                clipped = ((v - old).abs() > clip) & ((v_clip - ret).square() > (v - ret).square())
                steps.append({"critic/vf_loss": loss.item(), "critic/grad_norm": float(grad_norm), "critic/lr": lr,
                              "critic/vf_clipfrac": float(clipped.float().mean()),
                              "critic/values_mean": float(v.mean())})
        calls.append({k: sum(s[k] for s in steps) / len(steps) for k in steps[0]})
        if call == len(FIRST_SPLITS) - 1:
            first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.eval()
    return {"metrics": calls, "first": first,
            "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "values_after": reference_values(model_dir, model.state_dict())}


@pytest.fixture(scope="module")
def reference(two, model_dir, overrides) -> dict:
    return reference_updates(model_dir, two[0]["init"], overrides)


def test_backbone_comes_from_model_path_and_head_is_new(two, model_dir):
    from safetensors.torch import load_file

    saved = load_file(str(model_dir / "model.safetensors"))
    init = two[0]["init"]
    backbone = [k for k in saved if k.startswith("model.")]
    assert backbone and all(torch.equal(init[k], saved[k]) for k in backbone)
    assert init["score.weight"].shape == (1, 32) and init["score.bias"].shape == (1,)
    assert "lm_head.weight" not in init
    assert float(init["score.weight"].abs().max()) > 0  # initialised, not left at zero


def test_head_init_is_seeded(two, model_dir):
    """The head is not in the folder: it comes from run.seed, not the process's RNG history."""
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model
    from shardwise.rl.workers.critic import VALUE_HEAD

    torch.manual_seed(1234)  # a different RNG state than the ranks had
    torch.rand(5)
    cfg = load_config(None, [f"model.path={model_dir}", *BASE])
    with torch.random.fork_rng():
        torch.manual_seed(cfg.run.seed)
        model = build_full_model(cfg.model, cfg.run.seed, "token_classification", **VALUE_HEAD)
    torch.testing.assert_close(model.score.weight.detach(), two[0]["init"]["score.weight"], rtol=0, atol=0)


def test_values_are_head_output_at_previous_position(two, model_dir):
    want = reference_values(model_dir, two[0]["init"])
    mask = rollout_batch().tensors["response_mask"].bool()
    assert mask.sum() > 0 and not mask[:, 0].any()
    for name, split in VALUE_SPLITS.items():
        got = torch.cat([r["values"][name] for r in two])[torch.argsort(torch.tensor(split[0] + split[1]))]
        assert got.dtype == torch.float32 and got.shape == (ROWS, T)
        assert torch.equal(got[~mask], torch.zeros(int((~mask).sum())))  # exactly 0 outside the mask
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    assert two[1]["values"]["all_none"].shape == (0, T)
    assert not two[0]["training_after_values"]  # values come from eval mode
    assert two[0]["head_dropout"] == 0.0


def test_update_two_processes_equal_unsharded(two, reference):
    assert two[1]["metrics"] == two[0]["metrics"]  # every rank reports the same global metrics
    assert len(two[0]["metrics"]) == len(FIRST_SPLITS) + UPDATES
    # fp32 on both sides, sums in another order (micro-batches of 2 rows, sharded
    # gradients); 44 Adam steps carry that on, so the final state gets 2e-6 and the
    # metrics near 0 (values_mean averages values of both signs) 1e-6 absolute.
    for call, (got, want) in enumerate(zip(two[0]["metrics"], reference["metrics"], strict=True)):
        assert set(got) == set(want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (call, key)
    # the first updates split the rows 6 / 2 (2 vs 1 micro-batches per step), then 8 / 0:
    # the same 8 steps
    # (rows packed into one row per micro-batch, rl.packing's default: another order of
    # sums again; assert_trained_params_close says why one absolute tolerance cannot do)
    steps = 2 * MINI  # ppo_epochs x mini-batches per call
    assert_trained_params_close(two[0]["first"], reference["first"], two[0]["init"], lr=5e-3,
                                steps=len(FIRST_SPLITS) * steps)
    assert_trained_params_close(two[0]["final"], reference["final"], two[0]["init"], lr=5e-3,
                                steps=(len(FIRST_SPLITS) + UPDATES) * steps)
    assert max(float((v - two[0]["init"][k]).abs().max()) for k, v in reference["first"].items()) > 1e-3


def test_value_loss_decreases_on_a_fixed_batch(two, reference):
    metrics = two[0]["metrics"]  # every call updates on the same 8 rows (split differently)
    losses = [m["critic/vf_loss"] for m in metrics]
    assert losses[-1] < 0.2 * losses[0], losses
    assert sum(b < a for a, b in itertools.pairwise(losses)) >= len(losses) // 2
    assert all(m["critic/lr"] == pytest.approx(5e-3) for m in metrics)
    assert any(m["critic/vf_clipfrac"] > 0 for m in metrics)  # some returns lie beyond the clip range
    b = rollout_batch().tensors
    mask = b["response_mask"].bool()
    before = torch.cat([r["values"]["even"] for r in two])
    err = [(v - b["returns"])[mask].square().mean() for v in (before, reference["values_after"])]
    assert err[1] < 0.5 * err[0]


def test_rows_not_dividing_into_mini_batches_raise_on_every_rank(two):
    for r in two:
        key, message = r["error"]
        assert key == "rl.actor.ppo_mini_batches" and "[3, 2]" in message and "into 2" in message
