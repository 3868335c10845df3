"""Upstream's `slime.observability.metric_utils`: the step a plugin's metrics are logged at."""

from __future__ import annotations


def compute_rollout_step(args, rollout_id: int) -> int:
    """The x-axis value of rollout `rollout_id`: `rollout_id`, or the optimizer steps before it with
    `--wandb-always-use-train-step` (the axes slime's tracker plots against, `slime.utils.tracking.Tracker`)."""
    if not args.wandb_always_use_train_step:
        return rollout_id
    steps = args.num_steps_per_rollout
    if steps is None:
        steps = args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
    return rollout_id * steps
