"""Synchronous RL training: generate → reward → train → push weights, one rollout at a time.

    python train.py --hf-checkpoint ... --prompt-data ... [flags]          # starts a local Ray
    ray job submit -- python train.py ...                                  # on an existing cluster

Trainer and engines are colocated (`--colocate`: they take turns on the same devices, offloading
in between) or disaggregated (separate devices).
"""

from __future__ import annotations

import time

import ray

from slime.ray.driver import create_training_run, finish, run_driver, save_checkpoint, train_one_rollout, update_weights
from slime.utils.misc import should_run_periodic_action


def train(args) -> None:
    run = create_training_run(args)
    manager, actor = run.rollout_manager, run.actor
    if args.eval_interval and not args.skip_eval_before_train:
        run.tracker.log(run.start_rollout_id, ray.get(manager.eval.remote(run.start_rollout_id)))

    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        step_started = time.time()
        batch = ray.get(manager.generate.remote(rollout_id, run.dp_size))
        metrics = dict(batch.metrics)

        if actor is not None:
            if args.offload_rollout:
                ray.get(manager.offload.remote())
            if args.offload_train:
                actor.onload()
            metrics |= train_one_rollout(run, rollout_id, batch.data_refs)
            if should_run_periodic_action(rollout_id, args.save_interval, run.num_rollout_per_epoch, run.num_rollout):
                save_checkpoint(run, rollout_id)
            if args.offload_train:
                actor.offload()
            if args.offload_rollout:
                ray.get(manager.onload.remote())
            metrics |= update_weights(run)

        if should_run_periodic_action(rollout_id, args.eval_interval, run.num_rollout_per_epoch):
            metrics |= ray.get(manager.eval.remote(rollout_id))
        metrics["perf/step_time"] = time.time() - step_started
        run.tracker.log(rollout_id, metrics)

    finish(run)


if __name__ == "__main__":
    run_driver(train)
