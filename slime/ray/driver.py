"""Setup and per-step pieces shared by train.py and train_async.py (their loops stay in those files)."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from slime.ray.actor_group import RayTrainGroup
from slime.ray.placement_group import create_placement_groups
from slime.ray.rollout import create_rollout_manager
from slime.utils.tracking import Tracker, configure_logging


@dataclass
class TrainingRun:
    """Everything a driver loop needs."""

    args: object
    rollout_manager: object
    actor: RayTrainGroup | None
    critic: RayTrainGroup | None
    tracker: Tracker
    start_rollout_id: int
    num_rollout: int
    num_rollout_per_epoch: int

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks: the rollout is split into this many shards."""
        return self.actor.dp_size if self.actor is not None else 1


def create_training_run(args) -> TrainingRun:
    """Place devices, start engines and trainers, resume from `--load`, push the first weights."""
    configure_logging()
    slices = create_placement_groups(args)
    rollout_manager = create_rollout_manager(args, slices["rollout"])
    num_rollout, num_rollout_per_epoch = ray.get(rollout_manager.get_num_rollout.remote())
    args.num_rollout = num_rollout

    actor = critic = None
    start_rollout_id = args.start_rollout_id or 0
    if not args.debug_rollout_only:
        actor = RayTrainGroup(args, slices["actor"], role="actor")
        critic = RayTrainGroup(args, slices["actor"], role="critic") if args.use_critic else None
        loaded_next_rollout_id = actor.init(with_ref=args.use_kl_loss or args.kl_coef != 0)
        if critic is not None:
            critic.init()
        if args.start_rollout_id is None:
            start_rollout_id = loaded_next_rollout_id
        if start_rollout_id > 0:
            ray.get(rollout_manager.load.remote(start_rollout_id - 1))
        engines, engine_urls = ray.get([rollout_manager.get_engines.remote(), rollout_manager.get_engine_urls.remote()])
        if engines:
            actor.connect_rollout_engines(engines, engine_urls)
            if args.offload_train:
                actor.offload()
            if args.offload_rollout:
                ray.get(rollout_manager.onload.remote())
            actor.update_weights()
    elif args.load:
        ray.get(rollout_manager.load.remote())

    return TrainingRun(
        args=args,
        rollout_manager=rollout_manager,
        actor=actor,
        critic=critic,
        tracker=Tracker(args),
        start_rollout_id=start_rollout_id,
        num_rollout=num_rollout,
        num_rollout_per_epoch=num_rollout_per_epoch,
    )


def train_one_rollout(run: TrainingRun, rollout_id: int, data_refs: list) -> dict[str, float]:
    """Critic first (its values feed the actor's GAE), then the actor unless still in critic-only steps."""
    if run.critic is None:
        return ray.get(run.actor.async_train(rollout_id, data_refs))[0]
    values_refs = run.critic.compute_values(data_refs)
    critic_handles = run.critic.async_train(rollout_id, data_refs)
    metrics: dict[str, float] = {}
    if rollout_id >= run.args.num_critic_only_steps:
        metrics |= ray.get(run.actor.async_train(rollout_id, data_refs, values_refs=values_refs))[0]
    metrics |= {f"critic/{k.split('/', 1)[-1]}": v for k, v in ray.get(critic_handles)[0].items()}
    return metrics


def save_checkpoint(run: TrainingRun, rollout_id: int) -> None:
    """Trainer weights/optimizer (and critic), then the data-source position of this rollout."""
    run.actor.save_model(rollout_id)
    if run.critic is not None:
        run.critic.save_model(rollout_id)
    ray.get(run.rollout_manager.save.remote(rollout_id))


def finish(run: TrainingRun) -> None:
    run.tracker.finish()
    ray.get(run.rollout_manager.dispose.remote())
