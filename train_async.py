"""Asynchronous RL training: generation and training run at the same time.

With the default rollout, rollout k+1 is generated while the trainer trains on rollout k (one step
ahead); weights are pushed every `--update-weights-interval` rollouts, after the in-flight rollout has
finished, so each batch is at most one update behind the policy that trains on it.

With `--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async` a
background loop generates all the time; each batch is asked for only when the trainer is about to
train on it, after the push before it, so `--max-weight-staleness` judges it against the weights that
train on it. A push interrupts generation only while it lasts.

Engines and trainer run at the same time, so they cannot share devices: `--colocate` is refused.
"""

from __future__ import annotations

import logging
import os

import ray

from slime.ray.driver import (
    create_training_run,
    finish,
    log_step,
    run_driver,
    save_checkpoint,
    train_one_rollout,
    update_weights,
)
from slime.ray.progress import get_with_progress
from slime.utils.arguments.validation import cpu_thread_counts
from slime.utils.misc import should_run_periodic_action
from slime.utils.perf import PhaseTimer


def train(args) -> None:
    if args.multi_lora_n_adapters > 1:
        raise SystemExit(
            f"train_async.py does not train several adapters (--multi-lora-n-adapters {args.multi_lora_n_adapters}): "
            "use train.py"
        )
    if args.colocate:
        raise SystemExit(
            "train_async.py generates while it trains, so engines and trainer cannot share devices: "
            "drop --colocate, or use train.py for colocated training"
        )
    if args.debug_rollout_only:
        raise SystemExit("--debug-rollout-only has nothing to overlap: use train.py --debug-rollout-only")
    trainer_threads, engine_threads = cpu_thread_counts(args)
    if trainer_threads + engine_threads > (os.cpu_count() or 1):
        logging.getLogger("slime").warning(
            "%d trainer threads + %d CPU engine threads exceed the %d cores, and here they run at the same time; "
            "oversubscribed threads slow everything down. Lower --train-num-threads / --cpu-engine-num-threads",
            trainer_threads, engine_threads, os.cpu_count(),
        )  # fmt: skip
    run = create_training_run(args)
    manager = run.rollout_manager
    if args.eval_interval and not args.skip_eval_before_train:
        run.tracker.log(run.start_rollout_id, get_with_progress(manager, manager.eval.remote(run.start_rollout_id)))

    next_batch = manager.generate.remote(run.start_rollout_id, run.dp_size)
    in_background = None  # known once the first batch is back
    for rollout_id in range(run.start_rollout_id, run.num_rollout):
        timer = PhaseTimer()  # perf/<phase>_time of the phases below; they add up to perf/step_time
        with timer.phase("train_wait"):  # the trainer idle, waiting for its batch
            batch = get_with_progress(manager, next_batch)
        if in_background is None:
            in_background = ray.get(manager.generates_in_background.remote())
        has_next = rollout_id + 1 < run.num_rollout
        if has_next and not in_background:
            next_batch = manager.generate.remote(rollout_id + 1, run.dp_size)

        metrics = dict(batch.metrics)
        with timer.phase("train"):
            metrics |= train_one_rollout(run, rollout_id, batch.data_refs)
        if should_run_periodic_action(rollout_id, args.save_interval, run.num_rollout_per_epoch, run.num_rollout):
            with timer.phase("save"):
                save_checkpoint(run, rollout_id)
        if (rollout_id + 1) % args.update_weights_interval == 0:
            if has_next and not in_background:
                with timer.phase("train_wait"):
                    ray.wait([next_batch])  # never swap weights under a running one-step-ahead rollout
            with timer.phase("update_weights"):
                metrics |= update_weights(run)
        if should_run_periodic_action(rollout_id, args.eval_interval, run.num_rollout_per_epoch):
            with timer.phase("eval"):
                metrics |= get_with_progress(manager, manager.eval.remote(rollout_id))
        if has_next and in_background:
            next_batch = manager.generate.remote(rollout_id + 1, run.dp_size)
        log_step(run, rollout_id, metrics | timer.metrics())

    finish(run)


if __name__ == "__main__":
    run_driver(train)
