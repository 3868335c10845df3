"""slime.algorithms registries: user registrations by dotted module, RLOO, Dr. GRPO aggregation, abs KL,
dual-clip metric, parse-time rules. Expected values come from plain Python loops in the tests."""

from __future__ import annotations

import random
import sys
from argparse import Namespace

import pytest
import torch

from slime import algorithms
from slime.algorithms.advantages import compute_advantages_and_returns, group_baseline_rewards
from slime.algorithms.aggregation import LOSS_AGGREGATIONS, StepNormalizer
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.policy_losses import POLICY_LOSSES
from slime.algorithms.registry import Registry
from slime.utils.arguments import ArgumentValidationError, parse_args

BASE = [
    "--train-backend", "fsdp", "--rollout-backend", "cpu", "--hf-checkpoint", "/models/tiny",
    "--prompt-data", "/data/train.jsonl", "--rollout-batch-size", "4", "--num-rollout", "1",
]  # fmt: skip
CAPTURED: dict[int, dict] = {}


def capture(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: what the trainer computed before its optimizer step."""
    CAPTURED[rollout_id] = {key: list(data[key]) for key in ("log_probs", "advantages")}


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


# ---------------------------------------------------------------------------------------------
# User registrations, end to end
# ---------------------------------------------------------------------------------------------


def test_user_module_names_are_choices_only_once_imported():
    assert "support.user_algorithms" not in sys.modules  # nothing imported it behind the flag's back
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse_args([*BASE, "--n-samples-per-prompt", "2", "--advantage-estimator", "doubled_reward"])
    args = parse_args(
        [*BASE, "--n-samples-per-prompt", "2", "--custom-algorithm-module", "support.user_algorithms",
         "--advantage-estimator", "doubled_reward", "--loss-type", "plain_reinforce"]
    )  # fmt: skip
    assert (args.advantage_estimator, args.loss_type) == ("doubled_reward", "plain_reinforce")
    assert "doubled_reward" in algorithms.ADVANTAGE_ESTIMATORS and "plain_reinforce" in POLICY_LOSSES


def test_user_estimator_and_policy_loss_train_one_step(tiny_model_dir):
    """A registered estimator and policy loss drive a real FSDP step, under Dr. GRPO aggregation."""
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
    from slime.backends.fsdp_utils.model import gather_full_state_dict

    horizon = 16
    args = parse_args(
        ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "unused.jsonl", "--num-rollout", "1",
         "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--micro-batch-size", "2", "--lr", "1e-2",
         "--custom-algorithm-module", "support.user_algorithms", "--advantage-estimator", "doubled_reward",
         "--loss-type", "plain_reinforce", "--loss-agg-mode", "seq-mean-token-sum-norm",
         "--rollout-max-response-len", str(horizon), "--rollout-data-postprocess-path", f"{__name__}.capture"]
    )  # fmt: skip
    rng = random.Random(0)
    tokens, lengths, masks = [], [], []
    for _ in range(6):
        length = rng.randint(2, 9)
        tokens.append([rng.randrange(320) for _ in range(rng.randint(2, 6) + length)])
        lengths.append(length)
        masks.append([0] + [1] * (length - 1))  # a masked first token, as a tool output would be
    rewards = [1.0, -0.5, 0.25, 2.0, -1.0, 0.0]
    data = {
        "tokens": tokens, "response_lengths": lengths, "rewards": rewards, "raw_reward": list(rewards),
        "truncated": [0] * 6, "loss_masks": masks, "sample_indices": list(range(6)), "num_steps": 1,
    }  # fmt: skip

    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(args, "actor")
    before = gather_full_state_dict(actor.model)
    metrics = actor.train(7, data)
    after = gather_full_state_dict(actor.model)

    captured = CAPTURED[7]
    for advantage, reward, length in zip(captured["advantages"], rewards, lengths):
        assert advantage.tolist() == [2.0 * reward] * length  # the user estimator ran
    # Dr. GRPO: sum over samples and trainable tokens of -A * log p, over (samples * horizon).
    total, mean_log_prob = 0.0, 0.0
    for log_probs, reward, mask in zip(captured["log_probs"], rewards, masks):
        values = log_probs.tolist()
        total += sum(-2.0 * reward * lp * m for lp, m in zip(values, mask))
        mean_log_prob += sum(lp * m for lp, m in zip(values, mask)) / sum(mask) / 6  # metrics: per-sample mean
    assert metrics["train/pg_loss"] == pytest.approx(total / (6 * horizon), abs=1e-5)
    assert metrics["train/mean_log_prob"] == pytest.approx(mean_log_prob, abs=1e-5)  # the user loss's metric
    assert metrics["train/grad_norm"] > 0
    assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.reliability(
    "--custom-algorithm-module naming a module that does not import", "error naming the module and the flag"
)
def test_unimportable_algorithm_module_is_named():
    with pytest.raises(ArgumentValidationError, match="--custom-algorithm-module no_such_pkg.algos: cannot import"):
        parse_args([*BASE, "--n-samples-per-prompt", "2", "--custom-algorithm-module", "no_such_pkg.algos"])


@pytest.mark.reliability("two different functions registered under one name", "ValueError naming both")
def test_registry_refuses_a_second_function_under_a_taken_name():
    registry = Registry("widget", "--widget")
    registry.add("a", 1, "pkg.first")
    registry.add("a", 1, "pkg.first")  # the same function again (a module imported twice) is fine
    with pytest.raises(ValueError, match="already registered by pkg.first; pkg.second must use another name"):
        registry.add("a", 2, "pkg.second")
    with pytest.raises(ValueError, match="unknown widget 'b' for --widget; registered: a"):
        registry.get("b")


def test_registries_hold_the_built_in_names():
    assert algorithms.ADVANTAGE_ESTIMATORS.names()[:7] == [
        "grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
    ]  # fmt: skip
    assert POLICY_LOSSES.names()[:3] == ["policy_loss", "gspo", "cispo"]
    assert algorithms.KL_ESTIMATORS.names() == ["k1", "k2", "k3", "low_var_kl", "abs"]
    assert LOSS_AGGREGATIONS.names()[:4] == [
        "seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ]  # fmt: skip


def test_ppo_utils_keeps_the_upstream_names():
    from slime.utils import ppo_utils

    for name in ("compute_approx_kl", "compute_policy_loss", "get_grpo_returns", "chunked_gae",
                 "get_advantages_and_returns_batch", "sum_of_sample_mean", "vanilla_tis_function"):  # fmt: skip
        assert getattr(ppo_utils, name).__module__.startswith("slime.algorithms."), name


# ---------------------------------------------------------------------------------------------
# RLOO
# ---------------------------------------------------------------------------------------------


def rloo_args(n: int, **overrides) -> Namespace:
    defaults = dict(advantage_estimator="rloo", n_samples_per_prompt=n, disable_rewards_normalization=False)
    return Namespace(**{**defaults, **overrides})


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    rewards = [1.0, 0.0, 0.5, 2.0, 3.0, -1.0, 0.2, 0.2, 0.2]
    n = 3
    expected = []
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n]
        for i, r in enumerate(group):
            others = [g for j, g in enumerate(group) if j != i]
            expected.append(r - sum(others) / len(others))
    # group 0: 1 - 0.25 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0; group 2 is constant: exact zeros
    assert expected[:3] == pytest.approx([0.75, -0.75, 0.0])
    got = group_baseline_rewards(rloo_args(n), rewards)
    assert got == pytest.approx(expected, abs=1e-6)
    assert got[6:] == [0.0, 0.0, 0.0]
    assert group_baseline_rewards(rloo_args(n, disable_rewards_normalization=True), rewards) == rewards


def test_rloo_advantage_is_the_baselined_reward_on_every_token():
    args = rloo_args(
        2, kl_loss_type="k1", normalize_advantages=False, custom_advantage_function_path=None, use_opd=False
    )
    data = {"rewards": group_baseline_rewards(args, [3.0, 1.0]), "loss_masks": [torch.ones(3), torch.ones(2)]}
    compute_advantages_and_returns(args, data)
    # 3 - 1 = 2 and 1 - 3 = -2, on each response token
    assert [a.tolist() for a in data["advantages"]] == [[2.0, 2.0, 2.0], [-2.0, -2.0]]
    assert [r.tolist() for r in data["returns"]] == [[2.0, 2.0, 2.0], [-2.0, -2.0]]


# ---------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------

VALUES = [[1.0, 2.0, 3.0], [4.0, -2.0], [0.5, 0.5, 0.5, 0.5]]
MASKS = [[1, 1, 0], [1, 1], [0, 1, 1, 1]]


def hand_aggregate(mode: str, num_samples: int, horizon: int | None = None) -> float:
    sums = [sum(v * m for v, m in zip(vs, ms)) for vs, ms in zip(VALUES, MASKS)]
    counts = [sum(ms) for ms in MASKS]
    if mode == "seq-mean-token-sum":
        return sum(sums) / num_samples
    if mode == "seq-mean-token-sum-norm":
        return sum(sums) / (num_samples * horizon)
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c in zip(sums, counts)) / num_samples
    return sum(sums) / sum(counts)  # token-mean


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean", "token-mean"])
def test_aggregations_match_hand_values_and_split_over_micro_batches(mode):
    # sums: 3, 2, 1.5 -> 6.5; seq-mean-token-sum = 6.5 / 3; Dr. GRPO with horizon 8 = 6.5 / 24
    expected = hand_aggregate(mode, num_samples=3, horizon=8)
    if mode == "seq-mean-token-sum-norm":
        assert expected == pytest.approx(6.5 / 24)
    tokens = sum(map(sum, MASKS))
    normalizer = StepNormalizer(3, tokens, mode=mode, horizon=8)
    values = [torch.tensor(v) for v in VALUES]
    masks = [torch.tensor(m) for m in MASKS]
    assert normalizer.reduce(values, masks).item() == pytest.approx(expected, abs=1e-6)
    # Two micro-batches: their shares add up to the step's value.
    split = normalizer.reduce(values[:1], masks[:1]) + normalizer.reduce(values[1:], masks[1:])
    assert split.item() == pytest.approx(expected, abs=1e-6)


def test_metrics_stay_means_under_sum_aggregations():
    normalizer = StepNormalizer(3, 7, mode="seq-mean-token-sum")
    ones = [torch.ones(len(v)) for v in VALUES]
    assert normalizer.mean(ones, [torch.tensor(m) for m in MASKS]).item() == pytest.approx(1.0)


def test_loss_agg_mode_defaults_from_calculate_per_token_loss():
    assert parse_args([*BASE, "--n-samples-per-prompt", "2"]).loss_agg_mode == "seq-mean-token-mean"
    args = parse_args([*BASE, "--n-samples-per-prompt", "2", "--calculate-per-token-loss"])
    assert args.loss_agg_mode == "token-mean"


@pytest.mark.reliability(
    "Dr. GRPO aggregation without a response-length budget", "refused at parse time naming --rollout-max-response-len"
)
def test_dr_grpo_aggregation_needs_a_response_budget():
    argv = [*BASE, "--n-samples-per-prompt", "2", "--loss-agg-mode", "seq-mean-token-sum-norm"]
    with pytest.raises(ArgumentValidationError, match="--rollout-max-response-len"):
        parse_args(argv)
    assert parse_args([*argv, "--rollout-max-response-len", "64"]).loss_agg_mode == "seq-mean-token-sum-norm"


@pytest.mark.reliability("--calculate-per-token-loss with another --loss-agg-mode", "refused at parse time naming both")
def test_conflicting_aggregation_flags_are_refused():
    with pytest.raises(ArgumentValidationError, match="--calculate-per-token-loss.*--loss-agg-mode"):
        parse_args([*BASE, "--n-samples-per-prompt", "2", "--calculate-per-token-loss", "--loss-agg-mode",
                    "seq-mean-token-sum"])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# KL, dual clip
# ---------------------------------------------------------------------------------------------


def test_abs_kl_is_the_magnitude_of_the_log_ratio():
    log_probs, base = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5]  # log ratios 0.5, -1, 0
    kl = compute_approx_kl(torch.tensor(log_probs), torch.tensor(base), "abs")
    assert kl.tolist() == pytest.approx([abs(a - b) for a, b in zip(log_probs, base)])
    assert parse_args([*BASE, "--n-samples-per-prompt", "2", "--kl-loss-type", "abs"]).kl_loss_type == "abs"


def test_dual_clip_reports_pg_clipfrac_lower():
    # eps_clip_c = 3: ratio 5 & A=-2 -> standard 10 > bound 6 (dual clip active); ratio 2 & A=-2 -> 4 < 6;
    # A=+2 never dual-clipped.
    ratios, advantages = [5.0, 2.0, 5.0], [-2.0, -2.0, 2.0]
    args = Namespace(eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=3.0)
    old = torch.zeros(3)
    log_probs = torch.tensor(ratios).log()  # ratio = exp(log_probs - old)
    losses, metrics = POLICY_LOSSES.get("policy_loss")(args, log_probs, old, torch.tensor(advantages), [])
    assert losses.tolist() == pytest.approx([6.0, 4.0, -2.6], abs=1e-5)
    assert metrics["pg_clipfrac_lower"].tolist() == [1.0, 0.0, 0.0]
    _, without = POLICY_LOSSES.get("policy_loss")(Namespace(eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=None),
                                                  log_probs, old, torch.tensor(advantages), [])  # fmt: skip
    assert "pg_clipfrac_lower" not in without


# ---------------------------------------------------------------------------------------------
# One sample per prompt
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.reliability(
    "a group-baseline estimator with --n-samples-per-prompt 1", "refused at parse time: all advantages would be 0"
)
def test_group_baseline_with_one_sample_per_prompt_is_refused(estimator):
    with pytest.raises(ArgumentValidationError, match="--n-samples-per-prompt is 1: every advantage would be 0"):
        parse_args([*BASE, "--advantage-estimator", estimator])
    # Raw rewards, a critic, or no policy loss: something is learned.
    assert parse_args([*BASE, "--advantage-estimator", estimator, "--disable-rewards-normalization"])
    assert parse_args([*BASE, "--advantage-estimator", "ppo"]).use_critic
    assert parse_args([*BASE, "--loss-type", "sft_loss"]).loss_type == "sft_loss"
