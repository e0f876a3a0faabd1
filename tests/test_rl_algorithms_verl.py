"""Every advantage estimator, policy loss and loss aggregation mode of
`shardwise.rl.algorithms` against verl 0.9.1's own function (`verl.trainer.ppo.core_algos`).

verl is installed without its dependencies (make test does it, with the few that
core_algos imports: omegaconf, tensordict, codetiming, orjson, pyvers); where it is
required (``SHARDWISE_REQUIRED_MODULES=verl``) a missing verl fails the module.

Inputs: ragged masks (rows of 0..T tokens), holes inside a response (multi-turn: tool
output between the model's turns), groups of one, groups with all-equal rewards and
ratios far outside any clip (log-ratios up to +-30). Tolerance: fp32, 1e-5 relative to the
largest magnitude of the compared tensor (sums and means of O(1) terms round at a few
ulps of their largest term). Where verl leaves values at masked positions that nothing
reads (GAE, REINFORCE++, ReMax), the comparison is under the mask; shardwise has 0 there.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dist.common import missing_optional

from shardwise.rl import algorithms as alg

if importlib.util.find_spec("verl") is None:
    missing_optional("verl", 'verl is not installed; pip install --no-deps "verl==0.9.1" and its core_algos imports')
try:
    import verl.trainer.ppo.core_algos as verl
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig
except ImportError as e:  # verl without what core_algos imports
    missing_optional("verl", f"verl.trainer.ppo.core_algos does not import: {e}")

B, T = 12, 9


def close(ours, theirs, where=None, what=""):
    ours, theirs = torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(theirs, dtype=torch.float32)
    if where is not None:
        ours, theirs = ours[where], theirs[where]
    scale = max(float(theirs.abs().max()) if theirs.numel() else 0.0, 1e-6)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def masks(seed: int) -> torch.Tensor:
    """Ragged rows (one empty, one full) and holes inside responses."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, T
    m = (torch.arange(T)[None, :] < lengths[:, None]).float()
    m[2, 2:4] = 0  # a tool's answer between two turns
    m[5, 1] = 0
    return m


# Groups: six of two, then rows 0-3 as one group of four... (varied sizes, groups of one).
INDEX = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d", "d", "e", "f"], dtype=object)


def outcome_rewards(seed: int, mask: torch.Tensor, equal_group: bool = True) -> torch.Tensor:
    """A score on each row's last response token (0 elsewhere); group d all-equal."""
    g = torch.Generator().manual_seed(seed + 100)
    score = torch.randn(B, generator=g)
    if equal_group:
        score[6:10] = 0.75  # exact in binary: its std is exactly 0 in any summation order
    r = torch.zeros(B, T)
    for i in range(B):
        nz = torch.nonzero(mask[i]).flatten()
        if len(nz):
            r[i, nz[-1]] = score[i]
    return r


# --------------------------------------------------------------------- estimators

GROUP_ESTIMATORS = ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline", "opo",
                    "gpg"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_estimators_equal_verl(name, seed):
    mask = masks(seed)
    rewards = outcome_rewards(seed, mask)
    for norm in (True, False):
        kw = {"norm_adv_by_std_in_grpo": norm} if "grpo" in name else {}
        want = verl.get_adv_estimator_fn(name)(token_level_rewards=rewards.clone(), response_mask=mask, index=INDEX,
                                               config={"norm_adv_by_std_in_grpo": norm}, **kw)
        got = alg.get_adv_estimator_fn(name)(token_level_rewards=rewards.clone(), response_mask=mask, index=INDEX,
                                             config={"norm_adv_by_std_in_grpo": norm}, **kw)
        for o, t, what in zip(got, want, ("advantages", "returns")):
            close(o, t, what=f"{name} norm={norm} {what}")


def test_grpo_passk_equals_verl_and_refuses_a_group_of_one():
    mask = masks(3)
    index = np.array([i // 3 for i in range(B)])
    rewards = outcome_rewards(3, mask, equal_group=False)
    for norm in (True, False):
        cfg = {"norm_adv_by_std_in_grpo": norm}
        want = verl.get_adv_estimator_fn("grpo_passk")(rewards.clone(), mask, index, config=cfg)
        got = alg.get_adv_estimator_fn("grpo_passk")(rewards.clone(), mask, index, config=cfg)
        close(got[0], want[0], what=f"grpo_passk norm={norm}")
        assert int((got[0].abs().sum(-1) > 0).sum()) <= len(set(index))  # one row per group at most
    with pytest.raises(ValueError, match="at least 2 samples"):
        alg.get_adv_estimator_fn("grpo_passk")(rewards, mask, INDEX, config={})
    with pytest.raises(ValueError):
        verl.get_adv_estimator_fn("grpo_passk")(rewards, mask, INDEX, config={})


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_token_level_estimators_equal_verl(gamma):
    mask = masks(4)
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(B, T, generator=g) * mask
    values = torch.randn(B, T, generator=g)
    inside = mask.bool()
    want = verl.get_adv_estimator_fn("gae")(rewards, values, mask, gamma, 0.95)
    got = alg.get_adv_estimator_fn("gae")(token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma,
                                          lam=0.95)
    close(got[0], want[0], inside, "gae advantages")
    close(got[1], want[1], inside, "gae returns")
    want = verl.get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, config=SimpleNamespace(gamma=gamma))
    got = alg.get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, config={"gamma": gamma})
    close(got[0], want[0], inside, "reinforce_plus_plus advantages")
    close(got[1], want[1], inside, "reinforce_plus_plus returns")
    baselines = torch.randn(B, generator=g)
    want = verl.get_adv_estimator_fn("remax")(rewards, baselines, mask)
    got = alg.get_adv_estimator_fn("remax")(token_level_rewards=rewards, reward_baselines=baselines, response_mask=mask)
    close(got[0], want[0], inside, "remax advantages")
    close(got[1], want[1], inside, "remax returns")
    assert not got[0][~inside].any()


def test_the_trainers_form_is_the_verl_form():
    """What the trainer calls (ADVANTAGE_ESTIMATORS, shardwise's form) gives verl's numbers."""
    from shardwise.registry import ADVANTAGE_ESTIMATORS

    mask = masks(5)
    rewards = outcome_rewards(5, mask)
    got, _ = alg.call_estimator(ADVANTAGE_ESTIMATORS.get("grpo"), rewards, mask.bool(), values=None,
                                group_ids=list(INDEX), gamma=1.0, lam=1.0, norm_adv_by_std=False)
    want, _ = verl.compute_grpo_outcome_advantage(rewards.clone(), mask, INDEX, norm_adv_by_std_in_grpo=False)
    close(got, want, what="grpo via the registry")


ESTIMATORS = ["gae", "grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline", "remax", "opo", "gpg"]


def test_the_controllers_advantage_step_equals_verl_for_every_estimator(tmp_path):
    """Every estimator through the trainer's own step (`Controller.advantages` on a Batch in
    the workers' layout: prompt positions ahead of the response, holes in it, the rows'
    ``uid``, the critic's ``values``, REMAX's ``reward_baselines``) with rl.gamma / rl.lam /
    rl.norm_adv_by_std from the config: verl's function on the same tensors."""
    from shardwise.config import load_config
    from shardwise.data.batch import Batch
    from shardwise.data.tokenizer import build_char_tokenizer
    from shardwise.rl.trainer import Controller

    tok = build_char_tokenizer(tmp_path / "tok")
    prompt = torch.zeros(B, 3)
    mask = torch.cat([prompt, masks(6)], 1)
    rewards = torch.cat([prompt, outcome_rewards(6, masks(6))], 1)
    g = torch.Generator().manual_seed(6)
    values, baselines = torch.randn(B, T + 3, generator=g), torch.randn(B, generator=g)
    pairs = np.array([str(i // 2) for i in range(B)], dtype=object)  # grpo_passk: groups of two
    inside = mask.bool()
    for name in ESTIMATORS:
        index = pairs if name == "grpo_passk" else INDEX
        batch = Batch.from_dict({"response_mask": mask, "token_level_scores": rewards, "values": values,
                                 "reward_baselines": baselines}, {"uid": list(index)})
        for norm in (True, False):
            cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "train.global_batch_size=1", f"rl.advantage={name}",
                                     "rl.gamma=0.9", "rl.lam=0.95", f"rl.norm_adv_by_std={str(norm).lower()}",
                                     *(["rl.algorithm=ppo", "rl.critic.enabled=true"] if name == "gae" else [])])
            out, metrics = Controller(cfg, 1, [{"prompt": "1", "response": "1"}], tok, str(tmp_path / "tok"),
                                      None).advantages(batch)
            fn = verl.get_adv_estimator_fn(name)
            if name == "gae":
                want = fn(rewards, values, mask, 0.9, 0.95)
            elif name == "reinforce_plus_plus":
                want = fn(rewards, mask, config=SimpleNamespace(gamma=0.9))
            elif name == "remax":
                want = fn(rewards, baselines, mask)
            else:
                kw = {"norm_adv_by_std_in_grpo": norm} if name.startswith("grpo") else {}
                want = fn(token_level_rewards=rewards.clone(), response_mask=mask, index=index,
                          config={"norm_adv_by_std_in_grpo": norm}, **kw)
            for key, theirs in zip(("advantages", "returns"), want):
                close(out.tensors[key], theirs, inside, f"{name} norm={norm} {key}")
            assert metrics["advantages/abs_mean"] == pytest.approx(float(alg.masked_mean(
                out.tensors["advantages"].abs(), inside)))


# --------------------------------------------------------------------- aggregation

@pytest.mark.parametrize("mode", alg.AGG_MODES)
def test_agg_loss_equals_verl(mode):
    mask = masks(6)
    loss_mat = torch.randn(B, T, generator=torch.Generator().manual_seed(6))
    close(alg.agg_loss(loss_mat, mask, mode), verl.agg_loss(loss_mat, mask, mode), what=mode)
    # global counts: micro-batches of a global batch on dp ranks (verl's FSDP path)
    kw = {"dp_size": 2, "batch_num_tokens": 37, "global_batch_size": 15, "loss_scale_factor": 16}
    close(alg.agg_loss(loss_mat, mask, mode, **kw), verl.agg_loss(loss_mat, mask, mode, **kw), what=f"{mode} global")


def test_micro_batches_add_up_to_the_global_batch():
    mask = masks(7)
    loss_mat = torch.randn(B, T, generator=torch.Generator().manual_seed(7))
    tokens, seqs = alg.mask_counts(mask)
    for mode in alg.AGG_MODES:
        whole = alg.aggregate_loss(loss_mat, mask, mode, scale_factor=T)
        parts = sum(alg.aggregate_loss(loss_mat[s], mask[s], mode, tokens, seqs, T) for s in (slice(0, 5), slice(5, B)))
        close(parts, whole, what=mode)


# --------------------------------------------------------------------- policy losses

LOSSES = ["vanilla", "ppo_clip", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "cispo", "clip_cov", "kl_cov",
          "geo_mean", "dro"]
VERL_NAME = {"ppo_clip": "vanilla"}  # shardwise's name for verl's vanilla (both accepted)
# Options that make each loss do something on these inputs (clip_cov / kl_cov pick 20% of
# the tokens, where verl's default 2e-4 picks one).
OPTIONS = {"clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": -1.0, "clip_cov_ub": 5.0},
           "kl_cov": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}, "dro": {"dro_beta": 0.3}}


def loss_inputs(seed: int, extreme: bool):
    g = torch.Generator().manual_seed(seed)
    mask = masks(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    spread = 30.0 if extreme else 0.3
    old = logp - spread * torch.randn(B, T, generator=g).clamp(-1, 1)
    old = old.clamp(max=0.0) if not extreme else old
    adv = torch.randn(B, T, generator=g)
    weights = torch.rand(B, T, generator=g) * 2
    return old, logp, adv, mask, weights


def verl_config(name: str, low: float, high: float, info: dict) -> ActorConfig:
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1,
                      clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0, tau_pos=1.0,
                      tau_neg=1.05, policy_loss=PolicyLossConfig(loss_mode=name, **OPTIONS.get(name, {})))
    cfg.global_batch_info.update(info)
    return cfg


def our_config(name: str, low: float, high: float, info: dict) -> dict:
    return {"clip_ratio": 0.2, "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": 3.0, "tau_pos": 1.0,
            "tau_neg": 1.05, "policy_loss": OPTIONS.get(name, {}), "global_batch_info": dict(info)}


@pytest.mark.parametrize("extreme", [False, True], ids=["near", "extreme_ratios"])
@pytest.mark.parametrize("name", LOSSES)
def test_policy_losses_equal_verl(name, extreme):
    old, logp, adv, mask, weights = loss_inputs(8 + extreme, extreme)
    clips = [(0.2, 0.28)] if name not in ("dppo_tv", "dppo_kl") else [(0.2, 0.28), (0.05, 0.1)]
    modes = alg.AGG_MODES if name == "vanilla" else ("token-mean", "seq-mean-token-sum-norm")
    infos = [{}, {"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 20, "loss_scale_factor": T}]
    if name == "geo_mean":
        infos = [{}]  # verl's geo_mean takes the micro-batch's mean whatever the global counts
    for (low, high), mode, info, w in ((c, m, i, w) for c in clips for m in modes for i in infos
                                       for w in (None, weights)):
        what = f"{name} {mode} clip={low},{high} info={bool(info)} weights={w is not None}"
        theirs_lp = logp.clone().requires_grad_(True)
        ours_lp = logp.clone().requires_grad_(True)
        torch.manual_seed(0)  # clip_cov draws its tokens from torch's global generator
        want, want_m = verl.get_policy_loss_fn(VERL_NAME.get(name, name))(old, theirs_lp, adv, mask, mode,
                                                     verl_config(name, low, high, info), w)
        torch.manual_seed(0)
        got, got_m = alg.get_policy_loss_fn(name)(old, ours_lp, adv, mask, mode, our_config(name, low, high, info), w)
        close(got.detach(), want.detach(), what=f"{what} loss")
        assert set(got_m) == set(want_m), what
        for k in want_m:
            close(got_m[k], want_m[k], what=f"{what} {k}")
        # the gradients too: each loss differs from verl only where the mask is 0, which
        # verl multiplies by 0 and shardwise never reads
        want.backward()
        got.backward()
        close(ours_lp.grad, theirs_lp.grad, mask.bool(), f"{what} grad")


def test_masked_positions_are_never_read():
    """NaN where the mask is 0 changes no loss (verl would return NaN)."""
    old, logp, adv, mask, _ = loss_inputs(10, False)
    poisoned = [torch.where(mask.bool(), x, torch.nan) for x in (old, logp, adv)]
    for name in LOSSES:
        cfg = our_config(name, 0.2, 0.28, {})
        torch.manual_seed(0)
        clean, _ = alg.get_policy_loss_fn(name)(old, logp, adv, mask, "token-mean", cfg)
        torch.manual_seed(0)
        dirty, _ = alg.get_policy_loss_fn(name)(*poisoned, mask, "token-mean", cfg)
        close(dirty, clean, what=name)


def test_a_plain_mapping_and_verls_actor_config_read_alike():
    old, logp, adv, mask, _ = loss_inputs(11, False)
    for name in ("ppo_clip", "cispo", "dro", "sapo"):
        a, _ = alg.get_policy_loss_fn(name)(old, logp, adv, mask, "token-mean", our_config(name, 0.2, 0.28, {}))
        b, _ = alg.get_policy_loss_fn(name)(old, logp, adv, mask, "token-mean", verl_config(name, 0.2, 0.28, {}))
        assert float(a) == float(b), name
    with pytest.raises(ValueError, match="dro_beta"):
        alg.get_policy_loss_fn("dro")(old, logp, adv, mask, "token-mean", {"policy_loss": {}})
