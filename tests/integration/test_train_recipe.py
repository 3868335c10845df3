"""The per-rollout recipe written once in `TrainRayActor` (slime/backends/train_actor.py), seen through FSDP."""

from __future__ import annotations

from support.fsdp import make_args, make_rollout, new_actor

CALLS: list[tuple] = []


def record_step(args, rollout_id, step_id, model, optimizer, lr_scheduler):
    """A --custom-megatron-before-train-step-hook-path hook: what it was given, and the optimizer's step count."""
    CALLS.append((rollout_id, step_id, model, optimizer, lr_scheduler, len(optimizer.state)))


def test_before_train_step_hook_runs_before_every_optimizer_step(tiny_model_dir):
    CALLS.clear()
    hook = ("--custom-megatron-before-train-step-hook-path", f"{__name__}.record_step")
    actor = new_actor(make_args(tiny_model_dir, "--lr", "1e-3", *hook, num_steps=2))
    actor.train(3, make_rollout(8, seed=1, num_steps=2))
    assert [(rollout_id, step_id) for rollout_id, step_id, *_ in CALLS] == [(3, 0), (3, 1)]
    for _, _, model, optimizer, lr_scheduler, _ in CALLS:
        assert model is actor.model and optimizer is actor.optimizer and lr_scheduler is actor.lr_scheduler
    # Before the step: no optimizer state at the first call, the first step's state at the second.
    assert CALLS[0][-1] == 0 and CALLS[1][-1] > 0
