"""Built-in group filters for dynamic sampling (DAPO).

A group whose responses all earn the same reward has zero advantage under GRPO and teaches nothing;
these filters drop such groups (and broken ones) before they reach the trainer. Every filter has the
signature `f(args, samples, **kwargs) -> DynamicFilterOutput`, where `samples` are the responses to one
prompt, and reads rewards with `--reward-key` when rewards are dicts. Filters read their settings with defaults:
the `dynamic_sampling_*` thresholds are not slime flags (a user sets them on `args`), and user filters call these
with namespaces of their own.
"""

from __future__ import annotations

from slime.utils.types import Sample, Status

from .base_types import DynamicFilterOutput

_BROKEN_STATUSES = (Status.ABORTED, Status.FAILED)


def _rewards(args, samples: list[Sample]) -> list[float] | DynamicFilterOutput:
    """Scalar rewards of the group, or a drop verdict when the group is empty or some sample was never scored."""
    if not samples:
        return DynamicFilterOutput(keep=False, reason="empty group")
    unscored = [sample.index for sample in samples if sample.reward is None]
    if unscored:
        return DynamicFilterOutput(keep=False, reason=f"no reward for samples with index {unscored}")
    return [sample.get_reward_value(args.reward_key) for sample in samples]


def check_reward_nonzero_std(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep the group only if its rewards are not all equal (reward std > 0); a one-sample group is dropped."""
    rewards = _rewards(args, samples)
    if isinstance(rewards, DynamicFilterOutput):
        return rewards
    if max(rewards) > min(rewards):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"all {len(rewards)} rewards equal {rewards[0]}")


def check_reward_nonzero_std_with_fallback(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """`check_reward_nonzero_std`, but a group it drops is kept when the batch could not be filled without it
    (`keep_when_insufficient`): prefers groups with a reward spread without drawing another round of prompts."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    # Only a scored group may stand in; an empty or unscored one is never trained on.
    output.keep_when_insufficient = not isinstance(_rewards(args, samples), DynamicFilterOutput)
    return output


def check_reward_not_all_zero(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drop the group when every reward is 0 (no response earned anything)."""
    rewards = _rewards(args, samples)
    if isinstance(rewards, DynamicFilterOutput):
        return rewards
    if any(reward != 0 for reward in rewards):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason="all rewards are 0")


def check_pass_rate_in_range(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep the group when its pass rate lies strictly between a lower and an upper bound.

    A sample passes when its reward is at least `args.dynamic_sampling_pass_threshold` (default 1.0,
    i.e. fully correct for 0/1 and ±1 rewards). The bounds are `args.dynamic_sampling_min_pass_rate`
    (default 0.0) and `args.dynamic_sampling_max_pass_rate` (default 1.0), both exclusive, so the defaults
    drop prompts that are always solved or never solved.

    Args:
        args: Reads the three fields above and `reward_key`.
        samples: The responses to one prompt, with rewards.

    Returns:
        The verdict; the drop reason gives the pass rate and the range.
    """
    rewards = _rewards(args, samples)
    if isinstance(rewards, DynamicFilterOutput):
        return rewards
    threshold = getattr(args, "dynamic_sampling_pass_threshold", 1.0)
    low = getattr(args, "dynamic_sampling_min_pass_rate", 0.0)
    high = getattr(args, "dynamic_sampling_max_pass_rate", 1.0)
    pass_rate = sum(reward >= threshold for reward in rewards) / len(rewards)
    if low < pass_rate < high:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"pass rate {pass_rate:.3f} not in ({low}, {high})")


def check_no_aborted(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drop the group when any of its samples was aborted or failed (its reward would be meaningless)."""
    broken = [(sample.index, Status(sample.status).value) for sample in samples if sample.status in _BROKEN_STATUSES]
    if broken:
        return DynamicFilterOutput(keep=False, reason=f"aborted or failed samples (index, status): {broken}")
    return DynamicFilterOutput(keep=True)
