"""The rollout manager with upstream's on-policy-distillation shape: a reward function returns a dict, the
`--custom-reward-post-process-path` function turns it into numbers, and the rollout's figures come after it."""

from __future__ import annotations

import pytest
import ray
import torch

from slime.ray.rollout import RolloutManager
from slime.utils.arguments import parse_args
from slime.utils.types import Sample, Status

MODULE = __name__
SCORES = [1.0, 0.0, 0.0, 0.0]


def legacy_rollout(args, rollout_id, data_source, evaluation=False):
    """Upstream's older contract: a bare list of groups. Each reward is the teacher's answer, a dict."""
    samples = [
        Sample(index=i, group_index=i // 2, tokens=[5, 6, 7, 8], response_length=2, status=Status.COMPLETED,
               reward={"score": score, "teacher_log_probs": [-0.5 * i, -0.25]}, rollout_id=rollout_id)
        for i, score in enumerate(SCORES)
    ]  # fmt: skip
    return [samples[:2], samples[2:]]


def teacher_post_process(args, samples):
    """Like upstream's on_policy_distillation.post_process_rewards: store the teacher's log-probs, return numbers."""
    raw = [sample.get_reward_value(args) for sample in samples]  # the dicts themselves (no --reward-key)
    for sample, reward in zip(samples, raw, strict=True):
        sample.teacher_log_probs = torch.tensor(reward["teacher_log_probs"])
    scores = [reward["score"] for reward in raw]
    return scores, [2 * s for s in scores]


def returns_dicts(args, samples):
    rewards = [sample.reward for sample in samples]
    return rewards, rewards


def manager_args(model_dir, *extra: str):
    return parse_args(
        ["--hf-checkpoint", str(model_dir), "--disable-rollout-global-dataset", "--num-rollout", "1",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--debug-train-only", "--log-passrate",
         "--rollout-function-path", f"{MODULE}.legacy_rollout", *extra]
    )  # fmt: skip


def test_dict_rewards_reach_the_post_process_before_the_figures(tiny_model_dir, ray_cluster):
    args = manager_args(tiny_model_dir, "--custom-reward-post-process-path", f"{MODULE}.teacher_post_process")
    batch = RolloutManager(args, None).generate(0)
    assert batch.metrics["rollout/reward"] == pytest.approx(sum(SCORES) / 4)
    assert batch.metrics["rollout/pass@1"] == pytest.approx(0.25)  # groups [1, 0] and [0, 0]
    (shard,) = [ray.get(ref) for ref in batch.data_refs]
    assert shard["raw_reward"] == SCORES and shard["rewards"] == [2 * s for s in SCORES]
    assert [t.tolist() for t in shard["teacher_log_probs"]] == [[-0.5 * i, -0.25] for i in range(4)]


def test_dict_rewards_without_a_post_process_or_key_fail_clearly(tiny_model_dir, ray_cluster):
    with pytest.raises(ValueError, match="pass --reward-key"):
        RolloutManager(manager_args(tiny_model_dir), None).generate(0)
    bad = manager_args(tiny_model_dir, "--custom-reward-post-process-path", f"{MODULE}.returns_dicts")
    with pytest.raises(ValueError, match="must hold one number per sample"):
        RolloutManager(bad, None).generate(0)
