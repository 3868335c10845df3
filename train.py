"""Synchronous RL training: generate → reward → train → push weights, one rollout at a time.

    python train.py --hf-checkpoint ... --prompt-data ... [flags]          # starts a local Ray
    ray job submit -- python train.py ...                                  # on an existing cluster

Trainer and engines are colocated (`--colocate`, taking turns on the same devices with offload)
or disaggregated (separate devices).
"""

from __future__ import annotations

import time

import ray

from slime.ray.actor_group import RayTrainGroup
from slime.ray.placement_group import create_placement_groups
from slime.ray.rollout import create_rollout_manager
from slime.utils.arguments import parse_args
from slime.utils.misc import should_run_periodic_action
from slime.utils.tracking import Tracker, configure_logging


def train(args) -> None:
    configure_logging()
    slices = create_placement_groups(args)
    rollout_manager = create_rollout_manager(args, slices["rollout"])
    num_rollout, num_rollout_per_epoch = ray.get(rollout_manager.get_num_rollout.remote())
    args.num_rollout = num_rollout
    tracker = Tracker(args)

    actor = critic = None
    start_rollout_id = args.start_rollout_id or 0
    if not args.debug_rollout_only:
        actor = RayTrainGroup(args, slices["actor"], role="actor")
        critic = RayTrainGroup(args, slices["actor"], role="critic") if args.use_critic else None
        loaded_rollout_id = actor.init(with_ref=args.use_kl_loss or args.kl_coef != 0)
        if critic is not None:
            critic.init()
        if args.start_rollout_id is None:
            start_rollout_id = loaded_rollout_id
        if start_rollout_id > 0:
            ray.get(rollout_manager.load.remote(start_rollout_id - 1))
        engines, engine_urls = ray.get([rollout_manager.get_engines.remote(), rollout_manager.get_engine_urls.remote()])
        actor.connect_rollout_engines(engines, engine_urls)
        if args.offload_train:
            actor.offload()
        if args.offload_rollout:
            ray.get(rollout_manager.onload.remote())
        actor.update_weights()
        if args.check_weight_update_equal:
            actor.check_weights_equal()
    elif args.load:
        ray.get(rollout_manager.load.remote())

    dp_size = len(actor) if actor is not None else 1
    for rollout_id in range(start_rollout_id, num_rollout):
        step_started = time.time()
        metrics: dict[str, float] = {}
        if rollout_id == start_rollout_id and args.eval_interval and not args.skip_eval_before_train:
            tracker.log(rollout_id, ray.get(rollout_manager.eval.remote(rollout_id)))

        batch = ray.get(rollout_manager.generate.remote(rollout_id, dp_size))
        metrics |= batch.metrics
        if actor is not None:
            if args.offload_rollout:
                ray.get(rollout_manager.offload.remote())
            if args.offload_train:
                actor.onload()
            metrics |= train_one_rollout(args, rollout_id, batch.data_refs, actor, critic)

            if should_run_periodic_action(rollout_id, args.save_interval, num_rollout_per_epoch, num_rollout):
                actor.save_model(rollout_id)
                if critic is not None:
                    critic.save_model(rollout_id)
                ray.get(rollout_manager.save.remote(rollout_id))

            if args.offload_train:
                actor.offload()
            if args.offload_rollout:
                ray.get(rollout_manager.onload.remote())
            actor.update_weights()

        if should_run_periodic_action(rollout_id, args.eval_interval, num_rollout_per_epoch):
            metrics |= ray.get(rollout_manager.eval.remote(rollout_id))
        metrics["perf/step_time"] = time.time() - step_started
        tracker.log(rollout_id, metrics)

    tracker.finish()
    ray.get(rollout_manager.dispose.remote())


def train_one_rollout(args, rollout_id: int, data_refs: list, actor, critic) -> dict[str, float]:
    """Critic first (its values feed the actor's GAE), then the actor unless still in critic-only steps."""
    metrics: dict[str, float] = {}
    if critic is not None:
        values_refs = critic.compute_values(data_refs)
        critic_handles = critic.async_train(rollout_id, data_refs)
        if rollout_id >= args.num_critic_only_steps:
            metrics |= ray.get(actor.async_train(rollout_id, data_refs, values=values_refs))[0]
        metrics |= {f"critic/{k}": v for k, v in ray.get(critic_handles)[0].items()}
    else:
        metrics |= ray.get(actor.async_train(rollout_id, data_refs))[0]
    return metrics


if __name__ == "__main__":
    train(parse_args())
