"""Synchronous RL training: generate → reward → train → push weights, one rollout at a time.

    python train.py --hf-checkpoint ... --prompt-data ... [flags]          # starts a local Ray
    ray job submit -- python train.py ...                                  # on an existing cluster

Trainer and engines are colocated (`--colocate`: they take turns on the same devices, offloading
in between) or disaggregated (separate devices).
"""

from __future__ import annotations

import ray

from slime.ray.driver import (
    create_training_run,
    finish,
    generate_rollout,
    log_step,
    run_driver,
    save_checkpoint,
    train_one_rollout,
    update_weights,
)
from slime.ray.progress import get_with_progress
from slime.utils.misc import should_run_periodic_action
from slime.utils.perf import PhaseTimer


def train(args) -> None:
    run = create_training_run(args)
    manager, actor = run.rollout_manager, run.actor
    if args.eval_interval and not args.skip_eval_before_train:
        run.tracker.log(run.start_rollout_id, get_with_progress(manager, manager.eval.remote(run.start_rollout_id)))

    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        timer = PhaseTimer()  # perf/<phase>_time of the phases below; they add up to perf/step_time
        with timer.phase("generate"):
            batch = generate_rollout(run, rollout_id)
        metrics = dict(batch.metrics)

        if actor is not None:
            if args.offload_rollout or args.offload_train:
                with timer.phase("offload"):
                    if args.offload_rollout:
                        metrics |= ray.get(manager.offload.remote())
                    if args.offload_train:
                        actor.onload()
            with timer.phase("train"):
                metrics |= train_one_rollout(run, rollout_id, batch.data_refs)
            if should_run_periodic_action(rollout_id, args.save_interval, run.num_rollout_per_epoch, run.num_rollout):
                with timer.phase("save"):
                    save_checkpoint(run, rollout_id)
            if args.offload_rollout or args.offload_train:
                with timer.phase("offload"):
                    if args.offload_train:
                        metrics |= actor.offload()
                    if args.offload_rollout:
                        metrics |= ray.get(manager.onload.remote())
            with timer.phase("update_weights"):
                metrics |= update_weights(run)

        if should_run_periodic_action(rollout_id, args.eval_interval, run.num_rollout_per_epoch):
            with timer.phase("eval"):
                metrics |= get_with_progress(manager, manager.eval.remote(rollout_id))
        log_step(run, rollout_id, metrics | timer.metrics())

    finish(run)


if __name__ == "__main__":
    run_driver(train)
