"""Samples → train data dict → per-rank shards."""

from argparse import Namespace

import pytest
import torch

from slime.ray.rollout import rollout_metrics, samples_to_train_data, split_train_data_by_dp
from slime.utils.seqlen_balancing import balanced_partitions
from slime.utils.types import Sample, Status


def make_args(**overrides):
    defaults = dict(
        advantage_estimator="grpo",
        n_samples_per_prompt=2,
        reward_key=None,
        custom_reward_post_process_path=None,
        disable_rewards_normalization=False,
        disable_grpo_std_normalization=False,
        global_batch_size=4,
        balance_data=False,
        keep_old_actor=False,
        use_dynamic_global_batch_size=False,
    )
    return Namespace(**{**defaults, **overrides})


def make_samples(rewards, response_lengths=None):
    response_lengths = response_lengths or [2] * len(rewards)
    samples = []
    for i, (reward, length) in enumerate(zip(rewards, response_lengths, strict=True)):
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                tokens=[1, 2, 3] + list(range(10, 10 + length)),
                response_length=length,
                reward=reward,
                rollout_log_probs=[-0.5] * length,
                status=Status.TRUNCATED if i == 0 else Status.COMPLETED,
            )
        )
    return samples


def test_grpo_rewards_are_group_normalized():
    data = samples_to_train_data(make_args(), make_samples([1.0, 0.0, 1.0, 1.0]))
    # group 0: mean 0.5, unbiased std sqrt(0.5) -> ±0.5 / 0.70710678; group 1 is constant -> zeros
    expected = [0.5 / 0.5**0.5, -0.5 / 0.5**0.5, 0.0, 0.0]
    assert data["rewards"] == pytest.approx(expected, abs=1e-5)
    assert data["raw_reward"] == [1.0, 0.0, 1.0, 1.0]
    assert data["truncated"] == [1, 0, 0, 0]
    assert data["loss_masks"] == [[1, 1]] * 4
    assert data["rollout_log_probs"] == [[-0.5, -0.5]] * 4


def test_baseline_estimator_subtracts_mean_only_and_ppo_keeps_raw():
    samples = make_samples([3.0, 1.0, 0.0, 0.0])
    baseline = samples_to_train_data(make_args(advantage_estimator="reinforce_plus_plus_baseline"), samples)
    assert baseline["rewards"] == pytest.approx([1.0, -1.0, 0.0, 0.0])
    ppo = samples_to_train_data(make_args(advantage_estimator="ppo"), samples)
    assert ppo["rewards"] == [3.0, 1.0, 0.0, 0.0]


def test_loss_mask_length_mismatch_is_an_error():
    samples = make_samples([1.0, 0.0])
    samples[1].loss_mask = [1]
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        samples_to_train_data(make_args(global_batch_size=2), samples)


def test_split_round_robin_keeps_each_step_together():
    data = {"tokens": [[0] * n for n in range(1, 9)], "response_lengths": list(range(1, 9))}
    shards = split_train_data_by_dp(make_args(global_batch_size=4), data, dp_size=2)
    # step 0 = samples 0..3, step 1 = samples 4..7; rank r takes every other sample of each step
    assert [len(t) for t in shards[0]["tokens"]] == [1, 3, 5, 7]
    assert [len(t) for t in shards[1]["tokens"]] == [2, 4, 6, 8]
    assert shards[0]["num_steps"] == 2


def test_split_rejects_indivisible_batches():
    data = {"tokens": [[0]] * 6, "response_lengths": [1] * 6}
    with pytest.raises(ValueError, match="--global-batch-size 4"):
        split_train_data_by_dp(make_args(global_batch_size=4), data, dp_size=2)


def test_dynamic_global_batch_size_trains_what_the_rollout_returned_in_one_step():
    # 7 samples (a generate function fanned out) over 2 ranks: one step of 6, the last sample dropped.
    data = {"tokens": [[i] for i in range(7)], "response_lengths": [1] * 7}
    shards = split_train_data_by_dp(make_args(use_dynamic_global_batch_size=True), data, dp_size=2)
    assert [shard["tokens"] for shard in shards] == [[[0], [2], [4]], [[1], [3], [5]]]
    assert [shard["num_steps"] for shard in shards] == [1, 1]
    with pytest.raises(ValueError, match="needs --use-dynamic-global-batch-size"):
        split_train_data_by_dp(make_args(), data, dp_size=2)
    with pytest.raises(ValueError, match="1 samples for 2 ranks"):
        split_train_data_by_dp(
            make_args(use_dynamic_global_batch_size=True), {"tokens": [[0]], "response_lengths": [1]}, 2
        )


def test_balanced_partitions_equal_counts_and_close_sums():
    lengths = [100, 1, 1, 1, 90, 2, 3, 4]
    parts = balanced_partitions(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [len(p) for p in parts] == [4, 4]
    sums = [sum(lengths[i] for i in p) for p in parts]
    # the two long samples must land on different ranks
    assert abs(sums[0] - sums[1]) <= 12
    assert {0, 4} & set(parts[0]) and {0, 4} & set(parts[1])


def test_balance_data_split_uses_token_counts():
    lengths = [100, 90, 1, 1]
    data = {"tokens": [[0] * n for n in lengths], "response_lengths": lengths}
    shards = split_train_data_by_dp(make_args(global_batch_size=4, balance_data=True), data, dp_size=2)
    totals = [sum(len(t) for t in shard["tokens"]) for shard in shards]
    assert sorted(totals) == [91, 101]
    assert torch.tensor([len(s["tokens"]) for s in shards]).tolist() == [2, 2]


def test_unfinished_sample_counts_as_reward_zero_and_is_not_trained_on():
    """A custom rollout may return a sample the engine aborted (or that failed) without scoring it."""
    samples = make_samples([1.0, None, 0.0, 1.0])
    samples[1].status = Status.ABORTED
    samples[3].remove_sample = True  # e.g. set by --rollout-sample-filter-path
    data = samples_to_train_data(make_args(), samples)
    assert data["raw_reward"] == [1.0, 0.0, 0.0, 1.0]
    assert data["loss_masks"] == [[1, 1], [0, 0], [1, 1], [0, 0]]
    metrics = rollout_metrics(samples, None, 1.0)
    assert metrics["rollout/reward"] == 0.5 and metrics["rollout/unfinished"] == 0.25


@pytest.mark.reliability("rollout function returns a finished sample with no reward", "ValueError naming the sample")
def test_unscored_finished_sample_is_an_error():
    samples = make_samples([1.0, None])
    with pytest.raises(ValueError, match=r"sample 1 \(completed\) has no reward.*--custom-rm-path"):
        samples_to_train_data(make_args(global_batch_size=2), samples)


@pytest.mark.parametrize("flags", [["--global-batch-size", "2"], ["--num-steps-per-rollout", "2"]])
def test_dynamic_global_batch_size_refuses_a_fixed_batch_or_several_steps(flags):
    from slime.utils.arguments import ArgumentValidationError, parse_args

    base = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "1"]
    base += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    args = parse_args([*base, "--use-dynamic-global-batch-size"])
    assert (args.global_batch_size, args.num_steps_per_rollout) == (4, 1)  # one step: LR schedule and step count
    with pytest.raises(ArgumentValidationError, match="trains each rollout in one step of its own size"):
        parse_args([*base, "--use-dynamic-global-batch-size", *flags])
