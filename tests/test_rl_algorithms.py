"""RL maths checked against hand-computed values (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.rl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_in_reward,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    mask_counts,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    rollout_mismatch,
    tis_weights,
    value_loss,
)

NAN = float("nan")


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype if isinstance(actual, torch.Tensor) else torch.float64)
    actual = torch.as_tensor(actual, dtype=expected.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# ------------------------------------------------------------------ masked statistics

# valid values 1, 2, 3, 4 (100 and NaN sit at masked positions)
X = [[1.0, 2.0, 100.0], [3.0, NAN, 4.0]]
M = [[1, 1, 0], [1, 0, 1]]


def test_masked_mean_ignores_masked_values_even_nan():
    x, m = t(X), t(M)
    close(masked_mean(x, m), 2.5)  # (1+2+3+4)/4
    close(masked_mean(x, m, dim=-1), [1.5, 3.5])  # (1+2)/2, (3+4)/2
    close(masked_mean(x, m.bool(), dim=0), [2.0, 2.0, 4.0])  # (1+3)/2, 2/1, 4/1
    # no valid position: 0, not NaN
    close(masked_mean(x, torch.zeros(2, 3)), 0.0)


def test_masked_mean_gradient_is_finite_with_nan_at_masked_positions():
    x = t(X).requires_grad_()
    masked_mean(x, t(M)).backward()
    close(x.grad, [[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]])


def test_masked_var_unbiased_and_biased():
    x, m = t(X), t(M)
    # deviations from 2.5: -1.5, -0.5, 0.5, 1.5 -> squares sum to 5
    close(masked_var(x, m), 5 / 3)
    close(masked_var(x, m, unbiased=False), 5 / 4)
    # one valid value: variance 0 rather than 0/0
    close(masked_var(x, t([[1, 0, 0], [0, 0, 0]])), 0.0)


def test_masked_whiten():
    x, m = t(X), t(M)
    s = math.sqrt(5 / 3)  # 1.290994
    # (x - 2.5) / 1.290994; masked positions 0
    close(masked_whiten(x, m), [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 0.0, 1.5 / s]])
    close(masked_whiten(x, m, shift_mean=False), [[-1.5 / s + 2.5, -0.5 / s + 2.5, 0.0], [0.5 / s + 2.5, 0.0, 1.5 / s + 2.5]])


def test_mask_counts():
    tokens, seqs = mask_counts(t([[1, 1, 0], [0, 0, 0], [0, 1, 0]]))
    assert (int(tokens), int(seqs)) == (3, 2)


# ------------------------------------------------------------------ GAE


def whiten_ref(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / math.sqrt(std**2 + 1e-8) for v in values]


def test_gae_gamma1_lam1_is_return_minus_value():
    r = t([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    v = t([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    adv, ret = gae_advantages(r, v, torch.ones(2, 3), gamma=1.0, lam=1.0)
    # gamma = lam = 1: raw advantage = reward-to-go - value
    # row 0: 1 - 0.5 = 0.5 at every token; row 1: 2 - 1 = 1
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])  # raw + values
    # whiten [0.5]*3 + [1]*3: mean 0.75, deviations +-0.25,
    # unbiased var 6 * 0.0625 / 5 = 0.075, std 0.273861 -> +-0.912871
    close(adv, [[-0.912871] * 3, [0.912871] * 3])


@pytest.mark.parametrize(
    "gamma, lam, raw",
    [
        # r = [1, 0, 2], v = [0.5, 1, 0]
        # gamma .5, lam 1:
        #   t2: delta = 2 + .5*0 - 0 = 2                adv = 2
        #   t1: delta = 0 + .5*0 - 1 = -1 (next v = 0)  adv = -1 + .5*1*2 = 0
        #   t0: delta = 1 + .5*1 - .5 = 1               adv = 1 + .5*0 = 1
        (0.5, 1.0, [1.0, 0.0, 2.0]),
        # gamma 1, lam .5:
        #   t2: delta = 2                 adv = 2
        #   t1: delta = 0 + 0 - 1 = -1    adv = -1 + .5*2 = 0
        #   t0: delta = 1 + 1 - .5 = 1.5  adv = 1.5 + .5*0 = 1.5
        (1.0, 0.5, [1.5, 0.0, 2.0]),
        # gamma .5, lam .5 (gamma*lam = .25):
        #   t2: delta = 2                   adv = 2
        #   t1: delta = -1                  adv = -1 + .25*2 = -0.5
        #   t0: delta = 1 + .5 - .5 = 1     adv = 1 + .25*(-0.5) = 0.875
        (0.5, 0.5, [0.875, -0.5, 2.0]),
    ],
)
def test_gae_discounting(gamma, lam, raw):
    r = t([[1.0, 0.0, 2.0]])
    v = t([[0.5, 1.0, 0.0]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=gamma, lam=lam)
    close(ret, [[raw[0] + 0.5, raw[1] + 1.0, raw[2] + 0.0]])
    close(adv, [whiten_ref(raw)])


def test_gae_gamma_lam_both_below_one():
    r = t([[0.0, 0.0, 1.0]])
    v = t([[0.2, 0.4, 0.5]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # gamma*lam = 0.72
    # t2: delta = 1 - .5 = .5                   adv = .5
    # t1: delta = .9*.5 - .4 = .05              adv = .05 + .72*.5 = .41
    # t0: delta = .9*.4 - .2 = .16              adv = .16 + .72*.41 = .4552
    raw = [0.4552, 0.41, 0.5]
    close(ret, [[0.4552 + 0.2, 0.41 + 0.4, 0.5 + 0.5]])
    close(adv, [whiten_ref(raw)])


def test_gae_masked_positions_pass_through_and_change_nothing():
    mask = t([[1, 0, 1, 0], [1, 1, 1, 1]])
    r = t([[1.0, 5.0, 2.0, 3.0], [0.0, 0.0, 1.0, 0.0]])
    v = t([[0.5, 9.0, 1.0, 7.0], [0.1, 0.2, 0.3, 0.4]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.5, lam=1.0)
    # row 0, masked positions 1 and 3 are skipped:
    #   t3 (masked): carries next_value 0, adv 0
    #   t2: delta = 2 + .5*0 - 1 = 1                 adv = 1, next_value = 1
    #   t1 (masked): carries next_value 1 and adv 1
    #   t0: delta = 1 + .5*1 - .5 = 1 (next v is t2's) adv = 1 + .5*1*1 = 1.5
    # returns = raw + v at valid tokens: 1.5 + .5 = 2, 1 + 1 = 2; 0 where masked
    close(ret[0], [2.0, 0.0, 2.0, 0.0])
    # anything, NaN included, at masked positions leaves every result unchanged
    r2, v2 = r.clone(), v.clone()
    r2[0, 1], v2[0, 1], r2[0, 3], v2[0, 3] = -100.0, 100.0, NAN, float("inf")
    adv2, ret2 = gae_advantages(r2, v2, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv2, adv, rtol=0, atol=0)
    torch.testing.assert_close(ret2, ret, rtol=0, atol=0)
    assert adv[0, 1] == 0 and adv[0, 3] == 0
    # ... while changing a valid value does change them
    v2[0, 2] = 0.0
    adv3, _ = gae_advantages(r2, v2, mask, gamma=0.5, lam=1.0)
    assert not torch.allclose(adv3, adv)


def test_gae_whitening_is_over_the_mask_only():
    mask = t([[1, 0, 1]])
    adv, _ = gae_advantages(t([[1.0, 5.0, 2.0]]), t([[0.5, 9.0, 1.0]]), mask, gamma=0.5, lam=1.0)
    # raw at valid tokens: t2 = 2 - 1 = 1; t0 = 1 + .5*1 - .5 + .5*1 = 1.5
    # mean 1.25, unbiased var (.0625 + .0625)/1 = .125, std .353553 -> +-0.707107
    close(adv, [[0.707107, 0.0, -0.707107]])


# ------------------------------------------------------------------ GRPO / RLOO


# scores (masked token sums): row0 0+0+1 = 1; row1 .5+1.5 = 2 (the 7 is masked);
# row2 6; row3 3 (alone in group "b")
GRPO_R = [[0.0, 0.0, 1.0], [0.5, 1.5, 7.0], [6.0, 0.0, 0.0], [0.0, 3.0, 0.0]]
GRPO_M = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
GROUPS = ["a", "a", "a", "b"]


def test_grpo_group_mean_unbiased_std_and_singleton():
    adv = grpo_advantages(t(GRPO_R), t(GRPO_M), GROUPS)
    # group a: scores 1, 2, 6; mean 3; deviations -2, -1, 3
    # unbiased var (4 + 1 + 9) / 2 = 7, std sqrt(7) = 2.6457513
    s = math.sqrt(7) + 1e-6
    # group b has one row: mean 0, std 1 -> 3 / (1 + 1e-6)
    b = 3 / (1 + 1e-6)
    close(adv, [[-2 / s] * 3, [-1 / s, -1 / s, 0.0], [3 / s, 0.0, 0.0], [b] * 3], atol=1e-6)


def test_grpo_without_std_normalisation():
    adv = grpo_advantages(t(GRPO_R), t(GRPO_M), GROUPS, norm_by_std=False)
    # score - group mean; the singleton's mean is 0
    close(adv, [[-2.0] * 3, [-1.0, -1.0, 0.0], [3.0, 0.0, 0.0], [3.0] * 3])


def test_grpo_equal_scores_give_zero_and_ids_may_be_a_tensor():
    r = t([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [5.0, 0.0]])
    adv = grpo_advantages(r, torch.ones(4, 2), torch.tensor([7, 7, 9, 9]))
    # group 7: scores 1, 1 -> std 0, advantage 0 / (0 + eps) = 0
    # group 9: scores 2, 5; mean 3.5; std sqrt((2.25 + 2.25)/1) = 2.1213203
    s = math.sqrt(4.5) + 1e-6
    close(adv, [[0.0, 0.0], [0.0, 0.0], [-1.5 / s] * 2, [1.5 / s] * 2], atol=1e-6)
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        grpo_advantages(r, torch.ones(4, 2), [1, 1, 2])


def test_rloo_leave_one_out_baseline():
    adv = rloo_advantages(t(GRPO_R), t(GRPO_M), GROUPS)
    # group a (scores 1, 2, 6): 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5
    # group b has one row: baseline 0, advantage = score = 3
    close(adv, [[-3.0] * 3, [-1.5, -1.5, 0.0], [4.5, 0.0, 0.0], [3.0] * 3])


# ------------------------------------------------------------------ REINFORCE++


@pytest.mark.parametrize(
    "gamma, expected",
    [
        # row0 r = [1, 0, 2]: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5
        # row1 r = [0, 4 (masked), 1]: G2 = 1, G1 carried, G0 = 0 + .5*1 = .5
        # valid G: 1.5, 1, 2, .5, 1; mean 1.2; deviations .3 -.2 .8 -.7 -.2
        # squares sum 1.3, unbiased var .325, std .5700877
        (0.5, [[0.526235, -0.350823, 1.403293], [-1.227881, 0.0, -0.350823]]),
        # gamma 1: row0 G = [3, 2, 2]; row1 G = [1, -, 1]; mean 1.8
        # deviations 1.2 .2 .2 -.8 -.8, squares sum 2.8, var .7, std .83666
        (1.0, [[1.434274, 0.239046, 0.239046], [-0.956183, 0.0, -0.956183]]),
    ],
)
def test_reinforce_plus_plus(gamma, expected):
    r = t([[1.0, 0.0, 2.0], [0.0, 4.0, 1.0]])
    mask = t([[1, 1, 1], [1, 0, 1]])
    close(reinforce_plus_plus_advantages(r, mask, gamma=gamma), expected)


# ------------------------------------------------------------------ KL


LOGP = [-1.0, -2.0]
REF = [-1.5, -1.0]


@pytest.mark.parametrize(
    "kinds, expected",
    [
        # logp - ref = [.5, -1]
        (("k1", "kl"), [0.5, -1.0]),
        # .5 * [.25, 1]
        (("k2", "mse"), [0.125, 0.5]),
        # d = ref - logp = [-.5, 1]; exp(d) - d - 1 = [.6065307 + .5 - 1, 2.7182818 - 2]
        (("k3", "low_var_kl"), [0.1065307, 0.7182818]),
    ],
)
def test_kl_kinds_and_aliases(kinds, expected):
    for kind in kinds:
        close(kl_penalty(t(LOGP), t(REF), kind), expected)


def test_k3_is_clamped_at_extreme_inputs():
    logp = t([0.0, -50.0, -math.inf, -1.0]).requires_grad_()
    ref = t([-50.0, 0.0, 0.0, -1.0])
    kl = kl_penalty(logp, ref, "k3")
    # d = -50 -> clamped to -20: exp(-20) + 20 - 1 = 19.0 -> clamped to 10
    # d = 50 -> 20: exp(20) - 21 = 4.85e8 -> 10
    # d = inf -> 20 (without the clamp: inf - inf = NaN) -> 10
    # d = 0 -> 0
    close(kl, [10.0, 10.0, 10.0, 0.0])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    close(logp.grad, [0.0, 0.0, 0.0, 0.0])


def test_unknown_kl_kind_lists_valid_and_nearest():
    with pytest.raises(ValueError, match=r"valid: k1, kl, k2, mse, k3, low_var_kl; did you mean 'low_var_kl'"):
        kl_penalty(t(LOGP), t(REF), "lowvar_kl")


def test_apply_kl_in_reward():
    scores = t([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    logp = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, NAN]])
    ref = t([[-1.5, -1.0, -0.5], [-2.0, -3.0, -2.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards, mean_kl = apply_kl_in_reward(scores, logp, ref, mask, coef=0.1, kind="kl")
    # k1 = logp - ref: row0 [.5, 0, -.5]; row1 [0, 1, masked]
    # rewards = scores - .1 * kl; the masked score (2) is left as it is
    close(rewards, [[-0.05, 0.0, 1.05], [0.0, -0.1, 2.0]])
    # mean over sequences of token means: (0 + .5) / 2
    assert isinstance(mean_kl, float)
    assert mean_kl == pytest.approx(0.25)


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    c.update(100.0, 1000)
    assert c.value == 0.05


def test_adaptive_kl_controller_updates():
    c = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # 9/6 - 1 = .5 -> clipped to .2; factor 1 + .2*256/10000 = 1.00512
    c.update(9.0, 256)
    assert c.value == pytest.approx(0.100512, rel=1e-12)
    # 3/6 - 1 = -.5 -> -.2; factor 1 - .2*512/10000 = .98976 -> .100512*.98976
    c.update(3.0, 512)
    assert c.value == pytest.approx(0.09948275712, rel=1e-12)
    # 6.6/6 - 1 = .1 (inside the clip); factor 1 + .1*1000/10000 = 1.01
    c.update(6.6, 1000)
    assert c.value == pytest.approx(0.09948275712 * 1.01, rel=1e-12)
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 100)


# ------------------------------------------------------------------ loss aggregation

LOSS = [[1.0, 2.0, NAN], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
LOSS_M = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # row 2 has no valid token


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences (row 2 is empty)
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
    ],
)
def test_aggregate_modes(mode, expected):
    close(aggregate_loss(t(LOSS), t(LOSS_M), mode), expected)


def test_aggregate_with_global_counts():
    loss, mask = t(LOSS), t(LOSS_M)
    close(aggregate_loss(loss, mask, "token-mean", global_tokens=14), 7 / 14)
    close(aggregate_loss(loss, mask, "seq-mean-token-sum", global_seqs=7), 7 / 7)
    close(aggregate_loss(loss, mask, "seq-mean-token-mean", global_seqs=11), 5.5 / 11)
    # each mode reads only its own count
    close(aggregate_loss(loss, mask, "token-mean", global_seqs=100), 7 / 3)


def test_unknown_aggregation_mode():
    with pytest.raises(ValueError, match="did you mean 'seq-mean-token-mean'"):
        aggregate_loss(t(LOSS), t(LOSS_M), "seq-mean-token-means")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_sum_to_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.rand(8, 5, generator=gen, dtype=torch.float64)
    lengths = [5, 1, 3, 0, 2, 4, 5, 1]  # row 3 is empty
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths], dtype=torch.float64)
    whole = aggregate_loss(loss, mask, mode)
    tokens, seqs = mask_counts(mask)
    assert (int(tokens), int(seqs)) == (21, 7)
    micro = [slice(0, 1), slice(1, 6), slice(6, 8)]
    summed = sum(
        aggregate_loss(loss[s], mask[s], mode, global_tokens=tokens, global_seqs=seqs) for s in micro
    )
    torch.testing.assert_close(summed, whole, rtol=1e-12, atol=1e-12)
    # the global counts are what make this work: local means averaged do not match here
    naive = sum(aggregate_loss(loss[s], mask[s], mode) for s in micro) / len(micro)
    assert abs(float(naive) - float(whole)) > 1e-3


# ------------------------------------------------------------------ policy loss


def ppo_case():
    # one row; old_logp = 0 so ratio = exp(logp)
    ratio = [1.5, 1.5, 0.5, 0.5, 4.0, 1.0]
    adv = [1.0, -1.0, 1.0, -1.0, -2.0, 5.0]
    logp = torch.tensor([[math.log(r) for r in ratio[:5]] + [NAN]], dtype=torch.float64)
    old = torch.zeros(1, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])  # the last token is padding
    return old, logp, torch.tensor([adv], dtype=torch.float64), mask


def test_policy_loss_clip_and_dual_clip():
    old, logp, adv, mask = ppo_case()
    logp.requires_grad_()
    loss, metrics = policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    # clip range [.8, 1.2]; pg1 = -A*ratio, pg2 = -A*clamp(ratio), term = max(pg1, pg2)
    # t0 A=+1 r=1.5: pg1 -1.5, pg2 -1.2 -> -1.2 (clipped)
    # t1 A=-1 r=1.5: pg1  1.5, pg2  1.2 -> 1.5; dual min(1.5, 3) = 1.5
    # t2 A=+1 r=.5:  pg1 -.5,  pg2 -.8  -> -.5
    # t3 A=-1 r=.5:  pg1  .5,  pg2  .8  -> .8 (clipped); dual min(.8, 3) = .8
    # t4 A=-2 r=4:   pg1  8,   pg2 2.4  -> 8; dual min(8, 2*3) = 6 (dual clip active)
    # token-mean over 5 tokens: (-1.2 + 1.5 - .5 + .8 + 6) / 5 = 1.32
    close(loss, 1.32, atol=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 5)  # t0, t3
    assert metrics["clipfrac_lower"] == pytest.approx(1 / 5)  # t4
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 1.5 + 0.5 + 0.5 + 4) / 5)
    # approx_kl = mean(old - logp) = -(2 ln 1.5 + 2 ln .5 + ln 4) / 5 = -2 ln 1.5 / 5
    assert metrics["approx_kl"] == pytest.approx(-2 * math.log(1.5) / 5)
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    # d term / d logp = -A * ratio where pg1 is the chosen branch, 0 where clipped;
    # t1: 1.5/5 = .3; t2: -.5/5 = -.1; padding NaN gets a 0 gradient
    close(logp.grad, [[0.0, 0.3, -0.1, 0.0, 0.0, 0.0]], atol=1e-12)


def test_policy_loss_asymmetric_clip():
    old, logp, adv, mask = ppo_case()
    loss, metrics = policy_loss(old, logp, adv, mask, clip_low=0.4, clip_high=0.28, clip_c=10.0)
    # clip range [.6, 1.28]
    # t0 A=+1 r=1.5: max(-1.5, -1.28) = -1.28 (clipped)
    # t1 A=-1 r=1.5: max(1.5, 1.28) = 1.5
    # t2 A=+1 r=.5:  max(-.5, -.6) = -.5
    # t3 A=-1 r=.5:  max(.5, .6) = .6 (clipped)
    # t4 A=-2 r=4:   max(8, 2.56) = 8; dual min(8, 20) = 8 (inactive)
    # (-1.28 + 1.5 - .5 + .6 + 8) / 5 = 8.32 / 5
    close(loss, 8.32 / 5, atol=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 5)
    assert metrics["clipfrac_lower"] == 0.0


def test_policy_loss_seq_mode_and_global_tokens():
    old, logp, adv, mask = ppo_case()
    # one sequence: seq-mean-token-sum is the token sum 6.6
    loss, _ = policy_loss(old, logp, adv, mask, mode="seq-mean-token-sum")
    close(loss, 6.6, atol=1e-12)
    loss, _ = policy_loss(old, logp, adv, mask, global_tokens=10)
    close(loss, 0.66, atol=1e-12)


def test_truncated_importance_weights_scale_each_token_of_the_policy_loss():
    old, logp, adv, mask = ppo_case()
    # the rollout engine's log-probs: ratios old/rollout of 2, 1, 0.5, 1 and e^5 (truncated at 3)
    rollout = old - torch.tensor([[math.log(2.0), 0.0, math.log(0.5), 0.0, 5.0, 0.0]], dtype=old.dtype)
    w = tis_weights(old, rollout, mask, cap=3.0)
    close(w, [[2.0, 1.0, 0.5, 1.0, 3.0, 1.0]], atol=1e-12)  # 1 on the padded token
    # the per-token terms of test_policy_loss_clip_and_dual_clip: -1.2, 1.5, -.5, .8, 6
    loss, _ = policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0, token_weights=w)
    close(loss, (-1.2 * 2 + 1.5 - 0.5 * 0.5 + 0.8 + 6 * 3) / 5, atol=1e-12)
    plain, _ = policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0,
                           token_weights=torch.ones_like(w))
    close(plain, 1.32, atol=1e-12)


def test_rollout_mismatch_reports_difference_and_importance_ratio():
    old = torch.tensor([[0.0, -1.0, -2.0, -3.0]], dtype=torch.float64)
    rollout = torch.tensor([[0.0, -1.5, -1.0, 123.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0]])  # the prompt token and the padding do not count
    m = rollout_mismatch(old, rollout, mask)
    assert m["rollout/log_prob_diff_abs_mean"] == pytest.approx(0.75)
    assert m["rollout/log_prob_diff_abs_max"] == pytest.approx(1.0)
    assert m["rollout/importance_ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1.0)) / 2)
    assert m["rollout/importance_ratio_max"] == pytest.approx(math.exp(0.5))
    assert rollout_mismatch(old, rollout, torch.zeros_like(mask)) == {}


# ------------------------------------------------------------------ value loss


def test_value_loss_clipping():
    values = torch.tensor([[1.0, 1.0, 0.2, NAN]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[2.0, 0.0, 1.0, 5.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, returns, old, mask, clip=0.5)
    # v_clip = clamp(v, old - .5, old + .5)
    # t0 v=1 R=2: v_clip .5; (1-2)^2 = 1, (.5-2)^2 = 2.25 -> 2.25 (clipped term larger)
    # t1 v=1 R=0: v_clip .5; 1, .25 -> 1
    # t2 v=.2 R=1: inside the clip; .64, .64 -> .64
    # loss = .5 * (2.25 + 1 + .64) / 3 = .6483333
    close(loss, 0.5 * 3.89 / 3, atol=1e-12)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # t0: the clipped term is flat in v -> 0; t1: .5 * 2*(1-0) / 3 = 1/3;
    # t2: .5 * 2*(.2-1) / 3 = -.8/3; padding 0
    close(values.grad, [[0.0, 1 / 3, -0.8 / 3, 0.0]], atol=1e-12)


# ------------------------------------------------------------------ entropy


def test_entropy_matches_direct_formula():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64) * 3
    p = logits.exp() / logits.exp().sum(-1, keepdim=True)
    direct = -(p * p.log()).sum(-1)
    ent = entropy_from_logits(logits)
    assert ent.shape == (2, 3)
    torch.testing.assert_close(ent, direct, rtol=1e-12, atol=1e-12)


def test_entropy_is_stable_for_large_logits_and_upcasts_bf16():
    # two equal logits of 1000 (exp overflows): entropy ln 2; one dominant logit: ~0
    logits = torch.tensor([[[1000.0, 1000.0, -1000.0], [1000.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    ent = entropy_from_logits(logits)
    assert ent.dtype == torch.float32
    close(ent, [[math.log(2), 0.0]], atol=1e-6)
