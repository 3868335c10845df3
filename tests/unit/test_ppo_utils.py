"""Tests for the RL math of slime.algorithms (re-exported by slime/utils/ppo_utils.py, imported from there
as upstream code does). Expected values are worked out by hand in comments or by a naive Python
implementation inside the test, never by calling the code under test."""

import math
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime.utils.ppo_utils import (
    aggregate_loss,
    build_token_level_rewards,
    compute_approx_kl,
    compute_cispo_loss,
    compute_entropy_from_logits,
    compute_gspo_kl,
    compute_is_weights,
    compute_log_probs,
    compute_policy_loss,
    compute_sft_loss,
    compute_value_loss,
    distributed_masked_whiten,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    masked_mean,
    masked_whiten,
    normalize_group_rewards,
    per_token_mean,
    sum_of_sample_mean,
    vanilla_tis_function,
)


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def assert_close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------

# log_ratio = log_probs - base = [0.5, -1.0, 0.0]
LOG_PROBS = [-1.0, -2.0, -0.5]
BASE_LOG_PROBS = [-1.5, -1.0, -0.5]


def test_kl_k1_is_log_ratio():
    assert_close(compute_approx_kl(t(LOG_PROBS), t(BASE_LOG_PROBS), "k1"), [0.5, -1.0, 0.0])


def test_kl_k2_is_half_squared_log_ratio():
    # 0.5^2/2 = 0.125, (-1)^2/2 = 0.5
    assert_close(compute_approx_kl(t(LOG_PROBS), t(BASE_LOG_PROBS), "k2"), [0.125, 0.5, 0.0])


@pytest.mark.parametrize("kl_type", ["k3", "low_var_kl"])
def test_kl_k3_schulman_estimator(kl_type):
    # exp(-lr) - 1 + lr: exp(-0.5) - 0.5 = 0.1065306597, exp(1) - 2 = 0.7182818285, 0
    assert_close(compute_approx_kl(t(LOG_PROBS), t(BASE_LOG_PROBS), kl_type), [0.1065306597, 0.7182818285, 0.0])


def test_kl_estimators_are_kl_of_policy_from_base_in_expectation():
    # Tokens are sampled from pi, so E_pi[k1] = E_pi[k3] = KL(pi || base) = sum pi log(pi / base).
    pi = [0.8, 0.15, 0.05]
    base = [0.1, 0.1, 0.8]
    exact = sum(p * math.log(p / b) for p, b in zip(pi, base))  # 1.586
    reverse = sum(b * math.log(b / p) for p, b in zip(pi, base))  # KL(base || pi) = 1.970, the wrong direction
    assert abs(exact - reverse) > 0.3
    log_pi, log_base = t(pi, torch.float64).log(), t(base, torch.float64).log()
    for kl_type in ("k1", "k3"):
        expectation = (t(pi, torch.float64) * compute_approx_kl(log_pi, log_base, kl_type).double()).sum().item()
        assert expectation == pytest.approx(exact, abs=1e-6)


def test_low_var_kl_clamps_and_keeps_gradients_finite():
    log_probs = t([-40.0, 0.0], torch.float32).requires_grad_()
    base = t([0.0, -40.0])
    k3 = compute_approx_kl(log_probs.detach(), base, "k3")
    assert k3[0] > 1e10 and k3[1] == pytest.approx(39.0)  # exp(40) - 41 and exp(-40) - 1 + 40
    low_var = compute_approx_kl(log_probs, base, "low_var_kl")
    assert_close(low_var.detach(), [10.0, 10.0])
    low_var.sum().backward()
    assert torch.isfinite(log_probs.grad).all()


def test_kl_importance_ratio_multiplies_before_clamp():
    kl = compute_approx_kl(t(LOG_PROBS), t(BASE_LOG_PROBS), "k2", importance_ratio=t([2.0, 0.5, 3.0]))
    assert_close(kl, [0.25, 0.25, 0.0])
    # k3 at log_ratio -3 is exp(3) - 4 = 16.0855; times 0.5 = 8.04 stays below the clamp.
    kl = compute_approx_kl(t([-3.0]), t([0.0]), "low_var_kl", importance_ratio=t([0.5]))
    assert_close(kl, [(math.exp(3) - 4) / 2], atol=1e-5)


def test_kl_unknown_type_names_the_choices():
    with pytest.raises(ValueError, match="k3"):
        compute_approx_kl(t([0.0]), t([0.0]), "kl")


# ---------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------


def ppo_kl_for(ratios):
    # ratio = exp(-ppo_kl)
    return -t(ratios).log()


def test_policy_loss_clipping_cases():
    # eps_clip = 0.2 -> lower bound 0.8, eps_clip_high = 0.3 -> upper bound 1.3
    ratios = [1.1, 1.5, 1.25, 0.5, 0.5, 1.5]
    advantages = [1.0, 1.0, 1.0, -1.0, 1.0, -1.0]
    # 1.1, A=+1: inside the range                    -> -1.1, not clipped
    # 1.5, A=+1: clipped high to 1.3                  -> max(-1.5, -1.3) = -1.3, clipped
    # 1.25, A=+1: inside the asymmetric upper range   -> -1.25 (a symmetric 0.2 would give -1.2)
    # 0.5, A=-1: clipped low to 0.8                   -> max(0.5, 0.8) = 0.8, clipped
    # 0.5, A=+1: pessimistic min picks the unclipped  -> max(-0.5, -0.8) = -0.5
    # 1.5, A=-1: pessimistic min picks the unclipped  -> max(1.5, 1.3) = 1.5
    losses, clipfrac = compute_policy_loss(ppo_kl_for(ratios), t(advantages), 0.2, 0.3)
    assert_close(losses, [-1.1, -1.3, -1.25, 0.8, -0.5, 1.5])
    assert clipfrac.dtype == torch.float32
    assert clipfrac.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_policy_loss_clipped_tokens_have_no_gradient():
    ppo_kl = ppo_kl_for([1.1, 1.5]).requires_grad_()
    losses, _ = compute_policy_loss(ppo_kl, t([1.0, 1.0]), 0.2, 0.2)
    losses.sum().backward()
    # d(-A * exp(-ppo_kl)) / d ppo_kl = A * ratio = 1.1 for the unclipped token, 0 for the clipped one.
    assert_close(ppo_kl.grad, [1.1, 0.0])


def test_dual_clip_bounds_negative_advantages_only():
    # eps_clip_c = 3:
    # ratio 5, A=-2: standard max(10, 2.6) = 10, bounded by -A*c = 6          -> 6
    # ratio 2, A=-2: standard max(4, 2.6) = 4, below the bound 6               -> 4
    # ratio 5, A=+2: standard max(-10, -2.6) = -2.6, dual clip does not apply   -> -2.6
    ppo_kl = ppo_kl_for([5.0, 2.0, 5.0])
    advantages = t([-2.0, -2.0, 2.0])
    losses, _ = compute_policy_loss(ppo_kl, advantages, 0.2, 0.3, eps_clip_c=3.0)
    assert_close(losses, [6.0, 4.0, -2.6], atol=1e-5)
    without_dual, _ = compute_policy_loss(ppo_kl, advantages, 0.2, 0.3)
    assert_close(without_dual, [10.0, 4.0, -2.6], atol=1e-5)


def test_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="eps_clip_c"):
        compute_policy_loss(t([0.0]), t([1.0]), 0.2, 0.2, eps_clip_c=1.0)


def test_gspo_sequence_ratio_and_per_token_gradients():
    log_probs = [t([-1.0, -2.0, -3.0]).requires_grad_(), t([-0.5, -0.7]).requires_grad_()]
    old_log_probs = [t([-1.2, -1.5, -3.3]), t([-0.5, -1.0])]
    loss_masks = [t([1, 1, 0], torch.long), t([1, 1], torch.long)]
    ppo_kl = compute_gspo_kl(log_probs, old_log_probs, loss_masks)
    # sample 1: old - new = [-0.2, 0.5, -0.3], masked mean of the first two = 0.15, on all 3 tokens
    # sample 2: old - new = [0.0, -0.3], mean = -0.15
    assert_close(ppo_kl.detach(), [0.15, 0.15, 0.15, -0.15, -0.15])
    # The ratio is the geometric mean of the per-token ratios over trainable tokens.
    ratio_1 = math.exp((math.log(math.exp(-1.0) / math.exp(-1.2)) + math.log(math.exp(-2.0) / math.exp(-1.5))) / 2)
    assert torch.exp(-ppo_kl[0]).item() == pytest.approx(ratio_1, abs=1e-6)
    # Straight-through: d ppo_kl_t / d log_prob_t = -1 for that token only.
    token_weights = t([1.0, 2.0, 3.0, 4.0, 5.0])
    (ppo_kl * token_weights).sum().backward()
    assert_close(log_probs[0].grad, [-1.0, -2.0, -3.0])
    assert_close(log_probs[1].grad, [-4.0, -5.0])


def test_cispo_loss_and_gradients():
    ppo_kl = ppo_kl_for([0.5, 1.0, 2.0]).requires_grad_()
    log_probs = t([-1.0, -2.0, -0.5]).requires_grad_()
    advantages = t([1.0, -1.0, 2.0])
    losses, clipfrac = compute_cispo_loss(ppo_kl, log_probs, advantages, eps_clip_high=0.2)
    # capped ratios [0.5, 1.0, 1.2]; loss = -ratio * A * logp = [0.5, -2.0, 1.2]
    assert_close(losses.detach(), [0.5, -2.0, 1.2], atol=1e-6)
    assert clipfrac.tolist() == [0.0, 0.0, 1.0]
    losses.sum().backward()
    assert_close(log_probs.grad, [-0.5, 1.0, -2.4], atol=1e-6)  # -ratio * A
    assert ppo_kl.grad is None  # the ratio is a constant in CISPO


def test_value_loss_clipped_and_unclipped():
    # value_clip = 0.2
    # v=1.0, old=0.9, R=2.0: move 0.1 inside the clip, 0.5 * 1.0^2           -> 0.5, not clipped
    # v=1.5, old=1.0, R=2.0: v_clip=1.2, max(0.5^2, 0.8^2) = 0.64 -> * 0.5    -> 0.32, clipped
    # v=1.5, old=1.0, R=1.0: v_clip=1.2, max(0.5^2, 0.2^2) = 0.25 -> * 0.5    -> 0.125, not clipped
    losses, clipfrac = compute_value_loss(t([1.0, 1.5, 1.5]), t([0.9, 1.0, 1.0]), t([2.0, 2.0, 1.0]), 0.2)
    assert_close(losses, [0.5, 0.32, 0.125], atol=1e-6)
    assert clipfrac.tolist() == [0.0, 1.0, 0.0]


# ---------------------------------------------------------------------------------------
# Log-probs and entropy
# ---------------------------------------------------------------------------------------


def naive_softmax(row):
    exps = [math.exp(x) for x in row]
    return [e / sum(exps) for e in exps]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_log_probs_matches_naive_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.randn(4, 6, dtype=torch.float64) * 3
    tokens = torch.tensor([0, 5, 2, 2])
    expected = [
        math.log(naive_softmax([x / temperature for x in row])[tok])
        for row, tok in zip(logits.tolist(), tokens.tolist())
    ]
    log_probs = compute_log_probs(logits, tokens, temperature)
    assert log_probs.dtype == torch.float32
    assert_close(log_probs, expected, atol=1e-5)


def test_compute_log_probs_rejects_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        compute_log_probs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), 0.0)


def test_entropy_matches_naive():
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 7) * 4
    expected = [[-sum(p * math.log(p) for p in naive_softmax(row)) for row in block] for block in logits.tolist()]
    assert_close(compute_entropy_from_logits(logits), expected, atol=1e-5)


def test_entropy_with_masked_vocabulary_is_finite():
    logits = t([[0.0, float("-inf"), 0.0, float("-inf")]]).requires_grad_()
    entropy = compute_entropy_from_logits(logits)
    assert_close(entropy.detach(), [math.log(2)])
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ---------------------------------------------------------------------------------------
# Rewards and advantages
# ---------------------------------------------------------------------------------------


def test_group_normalization_with_std():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1]
    normalized = normalize_group_rewards(rewards, n_samples_per_prompt=4)
    # group 1: mean 0.5, unbiased std = sqrt((4 * 0.25) / 3) = sqrt(1/3)
    scaled = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert_close(normalized[:4], [scaled, -scaled, -scaled, scaled])
    # group 2 is constant: exact zeros, no nan
    assert torch.equal(normalized[4:], torch.zeros(4))


def test_group_normalization_without_std():
    normalized = normalize_group_rewards(t([3.0, 1.0, 2.0, 2.0]), n_samples_per_prompt=2, std_normalization=False)
    assert_close(normalized, [1.0, -1.0, 0.0, 0.0])


def test_group_normalization_single_sample_groups_are_zero():
    assert torch.equal(normalize_group_rewards([1.0, -3.0], n_samples_per_prompt=1), torch.zeros(2))


def test_group_normalization_rejects_ragged_groups():
    with pytest.raises(ValueError, match="n_samples_per_prompt=4"):
        normalize_group_rewards([1.0, 2.0, 3.0], n_samples_per_prompt=4)


def test_grpo_returns_broadcast_reward():
    returns = get_grpo_returns(t([0.5, -1.0]), [torch.zeros(3), torch.zeros(2)])
    assert [r.tolist() for r in returns] == [[0.5, 0.5, 0.5], [-1.0, -1.0]]


def naive_reinforce_plus_plus(rewards, kl, masks, kl_coef, gamma):
    all_returns = []
    for reward, kl_row, mask_row in zip(rewards, kl, masks):
        token_rewards = [-kl_coef * k if m else 0.0 for k, m in zip(kl_row, mask_row)]
        last = max(i for i, m in enumerate(mask_row) if m)
        token_rewards[last] += reward
        returns, running = [0.0] * len(token_rewards), 0.0
        for i in reversed(range(len(token_rewards))):
            running = token_rewards[i] + gamma * running
            returns[i] = running
        all_returns.append(returns)
    return all_returns


def test_reinforce_plus_plus_returns_by_hand():
    # kl_coef 0.5, kl [0.2, 0.4, 0.2], mask [1, 0, 1], reward 1, gamma 0.5:
    # token rewards [-0.1, 0 (masked), -0.1 + 1 = 0.9]
    # G2 = 0.9, G1 = 0 + 0.5 * 0.9 = 0.45, G0 = -0.1 + 0.5 * 0.45 = 0.125
    returns = get_reinforce_plus_plus_returns(
        t([1.0]), [t([0.2, 0.4, 0.2])], [t([1, 0, 1], torch.long)], kl_coef=0.5, gamma=0.5
    )
    assert_close(returns[0], [0.125, 0.45, 0.9])


def test_reinforce_plus_plus_returns_match_naive_loop():
    torch.manual_seed(2)
    lengths = [5, 1, 9, 300]
    kl = [torch.rand(n) for n in lengths]
    masks = [t([1, 1, 0, 1, 0], torch.long), t([1], torch.long), t([0, 1, 1, 0, 0, 1, 1, 0, 0], torch.long)]
    masks.append((torch.rand(300) > 0.3).long())
    rewards = [1.0, -0.5, 2.0, 0.7]
    returns = get_reinforce_plus_plus_returns(t(rewards), kl, masks, kl_coef=0.1, gamma=0.9)
    expected = naive_reinforce_plus_plus(rewards, [k.tolist() for k in kl], [m.tolist() for m in masks], 0.1, 0.9)
    for got, want in zip(returns, expected):
        assert_close(got, want, atol=1e-5)


def test_token_level_rewards_reject_fully_masked_sample():
    with pytest.raises(ValueError, match="sample 1"):
        build_token_level_rewards([1.0, 1.0], [torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.zeros(2)], 0.1)


def test_reinforce_plus_plus_baseline_advantages():
    # reward - 0.5 * kl on trainable tokens: [0.5 - 0.05, 0.5 (masked)], [-0.5 - 0.15]
    advantages = get_reinforce_plus_plus_baseline_advantages(
        t([0.5, -0.5]), [t([0.1, 0.2]), t([0.3])], [t([1, 0], torch.long), t([1], torch.long)], kl_coef=0.5
    )
    assert_close(advantages[0], [0.45, 0.5])
    assert_close(advantages[1], [-0.65])


# ---------------------------------------------------------------------------------------
# Importance weights
# ---------------------------------------------------------------------------------------

# Per-token ratios train / rollout; the 1.8 of sample B is masked out.
IS_RATIOS = [[0.6, 1.5, 3.0], [0.25, 1.8]]
IS_MASKS = [[1, 1, 1], [1, 0]]


def is_inputs(ratios=IS_RATIOS, masks=IS_MASKS):
    rollout = [torch.randn(len(r)) for r in ratios]
    train = [lp + t(r).log() for lp, r in zip(rollout, ratios)]
    return train, rollout, [t(m, torch.long) for m in masks]


def naive_is_weights(ratios, masks, level, mode, lower, upper):
    result = []
    for ratio_row, mask_row in zip(ratios, masks):
        kept = [r for r, m in zip(ratio_row, mask_row) if m]
        if level == "token":
            raw = list(ratio_row)
        elif level == "sequence":
            raw = [math.prod(kept)] * len(ratio_row)
        else:
            raw = [math.prod(kept) ** (1 / len(kept))] * len(ratio_row)
        if mode == "truncate":
            result.append([min(w, upper) for w in raw])
        elif mode == "clip":
            result.append([min(max(w, lower), upper) for w in raw])
        else:
            result.append([w if lower <= w <= upper else 0.0 for w in raw])
    return result


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "clip"])
def test_is_weights_every_level_and_mode(level, mode):
    train, rollout, masks = is_inputs()
    weights, metrics = compute_is_weights(train, rollout, masks, level=level, mode=mode, lower=0.5, upper=2.0)
    expected = naive_is_weights(IS_RATIOS, IS_MASKS, level, mode, 0.5, 2.0)
    for got, want in zip(weights, expected):
        assert_close(got, want, atol=1e-5)
    assert not any(w.requires_grad for w in weights)
    assert metrics["is_veto_fraction"].item() == 0.0


def test_is_weights_hand_values():
    train, rollout, masks = is_inputs()
    # sequence level: sample A 0.6 * 1.5 * 3.0 = 2.7 -> truncated to 2; sample B only 0.25 counts
    weights, _ = compute_is_weights(train, rollout, masks, level="sequence", mode="truncate", upper=2.0)
    assert_close(weights[0], [2.0, 2.0, 2.0], atol=1e-5)
    assert_close(weights[1], [0.25, 0.25], atol=1e-5)
    # geometric: 2.7 ** (1/3) = 1.3925 inside [0.5, 2]; default lower = 1 / upper = 0.5 masks B's 0.25
    weights, _ = compute_is_weights(train, rollout, masks, level="geometric", mode="mask", upper=2.0)
    assert_close(weights[0], [1.392477] * 3, atol=1e-5)
    assert_close(weights[1], [0.0, 0.0])


def test_is_weights_mask_bounds_are_inclusive():
    # ratio exactly 1 (equal log-probs) with lower = upper = 1 stays in the closed interval
    log_probs = [t([-0.3, -2.0])]
    weights, _ = compute_is_weights(log_probs, log_probs, [t([1, 1])], mode="mask", lower=1.0, upper=1.0)
    assert weights[0].tolist() == [1.0, 1.0]


def test_is_weights_token_truncate_metrics():
    train, rollout, masks = is_inputs()
    _, metrics = compute_is_weights(train, rollout, masks, level="token", mode="truncate", upper=2.0)
    # trainable tokens: 0.6, 1.5, 3.0, 0.25 -> only 3.0 is changed (to 2.0)
    assert metrics["is_clipfrac"].item() == pytest.approx(0.25)
    assert metrics["is_raw_weight_mean"].item() == pytest.approx((0.6 + 1.5 + 3.0 + 0.25) / 4, abs=1e-5)
    assert metrics["is_weight_mean"].item() == pytest.approx((0.6 + 1.5 + 2.0 + 0.25) / 4, abs=1e-5)


def test_is_weights_veto_zeroes_whole_sample():
    # Sample C has a ratio 0.01 on a masked-out token: it must not veto.
    train, rollout, masks = is_inputs(IS_RATIOS + [[1.0, 0.01]], IS_MASKS + [[1, 0]])
    weights, metrics = compute_is_weights(
        train, rollout, masks, level="token", mode="truncate", upper=2.0, veto_threshold=0.3
    )
    assert_close(weights[0], [0.6, 1.5, 2.0], atol=1e-5)
    assert weights[1].tolist() == [0.0, 0.0]  # 0.25 < 0.3 on a trainable token
    assert_close(weights[2], [1.0, 0.01], atol=1e-5)
    assert metrics["is_veto_fraction"].item() == pytest.approx(1 / 3)


def test_is_weights_batch_normalize():
    train, rollout, masks = is_inputs()
    weights, _ = compute_is_weights(
        train, rollout, masks, level="token", mode="truncate", upper=2.0, batch_normalize=True
    )
    # masked mean before normalizing: (0.6 + 1.5 + 2.0 + 0.25) / 4 = 1.0875
    assert_close(weights[0], [0.6 / 1.0875, 1.5 / 1.0875, 2.0 / 1.0875], atol=1e-5)
    assert_close(weights[1], [0.25 / 1.0875, 1.8 / 1.0875], atol=1e-5)
    masked_sum = sum((w * m).sum() for w, m in zip(weights, masks))
    assert masked_sum.item() / 4 == pytest.approx(1.0, abs=1e-6)


def test_is_weights_reject_unknown_level_and_mode():
    train, rollout, masks = is_inputs()
    with pytest.raises(ValueError, match="level"):
        compute_is_weights(train, rollout, masks, level="tokens")
    with pytest.raises(ValueError, match="mode"):
        compute_is_weights(train, rollout, masks, mode="cap")
    with pytest.raises(ValueError, match="veto_threshold"):
        compute_is_weights(train, rollout, masks, veto_threshold=0.0)


def test_vanilla_tis_function_scales_policy_loss():
    train, rollout, masks = is_inputs()
    args = Namespace(tis_clip=2.0, tis_clip_low=0.0)
    pg_loss = t([1.0, -1.0, 2.0, 1.0, 1.0])
    weighted, out_masks, metrics = vanilla_tis_function(
        args,
        pg_loss=pg_loss,
        train_log_probs=train,
        rollout_log_probs=rollout,
        loss_masks=masks,
        total_lengths=[10, 7],
        response_lengths=[3, 2],
    )
    # weights clamp(ratio, 0, 2): [0.6, 1.5, 2.0], [0.25, 1.8]
    assert_close(weighted, [0.6, -1.5, 4.0, 0.25, 1.8], atol=1e-5)
    assert out_masks is masks
    assert set(metrics) == {"tis_raw_weight_mean", "tis_clipfrac", "tis_veto_fraction", "tis_weight_mean"}


# ---------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------


def test_masked_mean():
    values = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 0, 1], [0, 0, 0]], torch.long)
    assert masked_mean(values, mask).item() == pytest.approx(2.0)  # (1 + 3) / 2
    assert_close(masked_mean(values, mask, dim=1), [2.0, 0.0])


def test_masked_whiten():
    values = t([1.0, 2.0, 3.0, 100.0])
    mask = t([1, 1, 1, 0])
    # mean 2, population variance (1 + 0 + 1) / 3 = 2/3; the masked-out 100 does not count
    scale = 1 / math.sqrt(2 / 3 + 1e-8)
    assert_close(masked_whiten(values, mask), [-scale, 0.0, scale, 98 * scale], atol=1e-5)
    assert_close(masked_whiten(values, mask, shift_mean=False), [2 - scale, 2.0, 2 + scale, 2 + 98 * scale], atol=1e-5)


def test_distributed_masked_whiten_without_process_group_is_local():
    values, mask = t([1.0, 5.0, -2.0]), t([1, 1, 0])
    assert torch.equal(distributed_masked_whiten(values, mask), masked_whiten(values, mask))


def _whiten_on_rank(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    values = [t([1.0, 2.0]), t([3.0, 50.0])][rank]
    mask = [t([1, 1]), t([1, 0])][rank]
    torch.save(distributed_masked_whiten(values, mask, shift_mean=False), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_distributed_masked_whiten_uses_global_statistics(tmp_path):
    mp.spawn(_whiten_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    gathered = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in range(2)])
    expected = masked_whiten(t([1.0, 2.0, 3.0, 50.0]), t([1, 1, 1, 0]), shift_mean=False)
    assert_close(gathered, expected, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Loss aggregation and SFT
# ---------------------------------------------------------------------------------------

LOSSES = [t([1.0, 2.0, 3.0, 4.0]), t([10.0])]
MASKS = [t([1, 1, 1, 0], torch.long), t([1], torch.long)]


def test_sum_of_sample_mean_weighs_samples_equally():
    # sample means: (1 + 2 + 3) / 3 = 2 and 10 -> mean 6
    assert sum_of_sample_mean(LOSSES, MASKS).item() == pytest.approx(6.0)
    assert sum_of_sample_mean(LOSSES, MASKS, num_samples=4).item() == pytest.approx(3.0)  # 12 / 4
    assert aggregate_loss(LOSSES, MASKS, per_token=False).item() == pytest.approx(6.0)


def test_per_token_mean_weighs_tokens_equally():
    # (1 + 2 + 3 + 10) / 4 = 4
    assert per_token_mean(LOSSES, MASKS).item() == pytest.approx(4.0)
    assert per_token_mean(LOSSES, MASKS, num_tokens=8).item() == pytest.approx(2.0)  # 16 / 8
    assert aggregate_loss(LOSSES, MASKS, per_token=True).item() == pytest.approx(4.0)


def test_sample_with_empty_mask_contributes_zero():
    losses = [t([5.0, 5.0]), t([2.0])]
    masks = [t([0, 0]), t([1])]
    assert sum_of_sample_mean(losses, masks).item() == pytest.approx(1.0)  # (0 + 2) / 2
    assert per_token_mean(losses, masks).item() == pytest.approx(2.0)


def test_sft_loss_per_sample_and_per_token():
    log_probs = [t([-1.0, -2.0, -3.0]), t([-4.0])]
    masks = [t([1, 1, 0], torch.long), t([1], torch.long)]
    # per sample: (1 + 2) / 2 = 1.5 and 4 -> 2.75; per token: (1 + 2 + 4) / 3
    assert compute_sft_loss(log_probs, masks).item() == pytest.approx(2.75)
    assert compute_sft_loss(log_probs, masks, per_token=True).item() == pytest.approx(7 / 3)
