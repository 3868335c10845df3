"""Dynamic-sampling filters of slime.rollout.filter_hub on small hand-made groups."""

import pytest
from support.flags import slime_flags

from slime.rollout.filter_hub import DynamicFilterOutput
from slime.rollout.filter_hub.dynamic_sampling_filters import (
    check_no_aborted,
    check_pass_rate_in_range,
    check_reward_nonzero_std,
    check_reward_not_all_zero,
)
from slime.utils.types import Sample, Status


def group(*rewards, statuses=None):
    statuses = statuses or [Status.COMPLETED] * len(rewards)
    return [Sample(index=i, reward=r, status=s) for i, (r, s) in enumerate(zip(rewards, statuses, strict=True))]


@pytest.mark.parametrize(
    "rewards, keep",
    [
        ((1.0, 0.0, 1.0, 1.0), True),
        ((0.0, 0.0, 0.0, 0.0), False),
        ((1.0, 1.0, 1.0, 1.0), False),
        ((-1.0, -1.0), False),
        ((0.25, 0.5), True),
        ((1.0,), False),  # one sample has no spread
    ],
)
def test_nonzero_std(rewards, keep):
    verdict = check_reward_nonzero_std(slime_flags(), group(*rewards))
    assert isinstance(verdict, DynamicFilterOutput)
    assert verdict.keep is keep
    assert (verdict.reason is None) is keep


def test_nonzero_std_reason_and_reward_key():
    verdict = check_reward_nonzero_std(slime_flags(), group(0.0, 0.0, 0.0))
    assert verdict.reason == "all 3 rewards equal 0.0"

    dict_rewards = group({"score": 1.0, "acc": True}, {"score": -1.0, "acc": False})
    assert check_reward_nonzero_std(slime_flags(reward_key="score"), dict_rewards).keep is True
    same_score = group({"score": 1.0, "len": 3}, {"score": 1.0, "len": 9})
    assert check_reward_nonzero_std(slime_flags(reward_key="score"), same_score).keep is False
    assert check_reward_nonzero_std(slime_flags(reward_key="len"), same_score).keep is True
    with pytest.raises(ValueError, match="--reward-key"):
        check_reward_nonzero_std(slime_flags(), same_score)


def test_unscored_or_empty_groups_are_dropped():
    verdict = check_reward_nonzero_std(slime_flags(), group(1.0, None, 0.0, None))
    assert verdict.keep is False
    assert verdict.reason == "no reward for samples with index [1, 3]"
    assert check_reward_not_all_zero(slime_flags(), []).keep is False


def test_not_all_zero():
    assert check_reward_not_all_zero(slime_flags(), group(0.0, 0.0, 0.0)).keep is False
    assert check_reward_not_all_zero(slime_flags(), group(0.0, 0.1, 0.0)).keep is True
    assert check_reward_not_all_zero(slime_flags(), group(1.0, 1.0)).keep is True
    assert check_reward_not_all_zero(slime_flags(), group(-1.0, -1.0)).keep is True  # DAPO's -1 is not 0


def test_pass_rate_in_range_defaults_drop_solved_and_unsolved():
    args = slime_flags()
    assert check_pass_rate_in_range(args, group(1.0, 1.0, 1.0, 1.0)).keep is False  # pass rate 1
    assert check_pass_rate_in_range(args, group(0.0, 0.0, 0.0, 0.0)).keep is False  # pass rate 0
    assert check_pass_rate_in_range(args, group(1.0, 0.0, 0.0, 0.0)).keep is True  # 1/4
    assert check_pass_rate_in_range(args, group(1.0, -1.0, -1.0)).keep is True  # DAPO scores, 1/3
    # 0.5 is below the default pass threshold 1.0, so nobody passed.
    verdict = check_pass_rate_in_range(args, group(0.5, 0.5, 0.0))
    assert verdict.keep is False
    assert verdict.reason == "pass rate 0.000 not in (0.0, 1.0)"


def test_pass_rate_in_range_configurable():
    # Passing means reward >= 0.5; rewards 0.9, 0.6, 0.2, 0.0 give 2 passes of 4 = 0.5.
    rewards = group(0.9, 0.6, 0.2, 0.0)
    args = slime_flags(dynamic_sampling_pass_threshold=0.5, dynamic_sampling_min_pass_rate=0.25)
    assert check_pass_rate_in_range(args, rewards).keep is True
    args.dynamic_sampling_max_pass_rate = 0.5  # bounds are exclusive: 0.5 is out
    verdict = check_pass_rate_in_range(args, rewards)
    assert verdict.keep is False
    assert verdict.reason == "pass rate 0.500 not in (0.25, 0.5)"
    args.dynamic_sampling_min_pass_rate, args.dynamic_sampling_max_pass_rate = 0.5, 0.75
    assert check_pass_rate_in_range(args, rewards).keep is False  # 0.5 is not above 0.5 either


def test_no_aborted():
    ok = group(1.0, 0.0, statuses=[Status.COMPLETED, Status.TRUNCATED])
    assert check_no_aborted(slime_flags(), ok) == DynamicFilterOutput(keep=True)
    broken = group(1.0, None, 0.0, None, statuses=[Status.COMPLETED, Status.ABORTED, Status.COMPLETED, Status.FAILED])
    verdict = check_no_aborted(slime_flags(), broken)
    assert verdict.keep is False
    assert verdict.reason == "aborted or failed samples (index, status): [(1, 'aborted'), (3, 'failed')]"
