"""RayTrainGroup: one training actor per data-parallel rank, driven together.

Every method fans a call out to all ranks and returns the Ray object refs (`async_*`) or waits.
"""

from __future__ import annotations

from typing import Any

import ray

from slime.ray.placement_group import PlacementSlice

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _actor_class(train_backend: str):
    # Imported lazily: a run only needs its own backend's dependencies (megatron-core is optional).
    if train_backend == "fsdp":
        from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

        return FSDPTrainRayActor
    if train_backend == "megatron":
        from slime.backends.megatron_utils.actor import MegatronTrainRayActor

        return MegatronTrainRayActor
    raise ValueError(f"unknown --train-backend {train_backend!r}; choose fsdp or megatron")


class RayTrainGroup:
    """The training ranks of one role ("actor" or "critic").

    Args:
        args: Parsed arguments.
        actor_slice: The bundles of the trainer (one per rank).
        role: "actor" or "critic".
    """

    def __init__(self, args, actor_slice: PlacementSlice, role: str = "actor"):
        self.args = args
        self.role = role
        world_size = len(actor_slice)
        if world_size == 0:
            raise ValueError("no bundles for the trainer: set --actor-num-nodes and --actor-num-gpus-per-node")
        # Colocated trainers share each bundle with an engine (which takes 0.2 of it).
        share = 0.4 if args.colocate else 0.8 if args.use_critic else 1.0
        env_vars = {"NCCL_CUMEM_ENABLE": "0", **(args.train_env_vars or {})}
        if actor_slice.use_gpu:
            env_vars["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        else:
            env_vars |= {name: str(args.train_num_threads) for name in THREAD_ENV_VARS}
        remote_cls = ray.remote(_actor_class(args.train_backend))

        def make(rank: int, master_addr: str | None, master_port: int | None):
            options: dict[str, Any] = {"num_cpus": share, "runtime_env": {"env_vars": env_vars}}
            if actor_slice.use_gpu:
                options["num_gpus"] = share
            if actor_slice.pg is not None:
                options["scheduling_strategy"] = actor_slice.strategy(rank)
            return remote_cls.options(**options).remote(world_size, rank, master_addr, master_port)

        rank0 = make(0, None, None)
        master_addr, master_port = ray.get(rank0.get_master_addr_and_port.remote())
        self.actors = [rank0] + [make(rank, master_addr, master_port) for rank in range(1, world_size)]

    def __len__(self) -> int:
        return len(self.actors)

    def init(self, with_ref: bool = False) -> int:
        """Build models on every rank (loading `--load`); returns the rollout id to start from."""
        start_ids = ray.get([actor.init.remote(self.args, self.role, with_ref) for actor in self.actors])
        return start_ids[0]

    def async_train(self, rollout_id: int, data_refs: list, **kwargs) -> list:
        """Start training on rollout `rollout_id`; `data_refs[rank]` is that rank's shard."""
        if len(data_refs) != len(self.actors):
            raise ValueError(f"{len(data_refs)} data shards for {len(self.actors)} training ranks")
        return [
            actor.train.remote(rollout_id, ref, **kwargs) for actor, ref in zip(self.actors, data_refs, strict=True)
        ]

    def compute_values(self, data_refs: list) -> list:
        """Critic only: per-rank value estimates for the actor's advantages (PPO)."""
        return [actor.compute_values.remote(ref) for actor, ref in zip(self.actors, data_refs, strict=True)]

    def save_model(self, rollout_id: int) -> None:
        ray.get([actor.save_model.remote(rollout_id) for actor in self.actors])

    def connect_rollout_engines(self, engines: list, engine_urls: list[str]) -> None:
        ray.get([actor.connect_rollout_engines.remote(engines, engine_urls) for actor in self.actors])

    def update_weights(self) -> None:
        ray.get([actor.update_weights.remote() for actor in self.actors])

    def offload(self) -> None:
        ray.get([actor.sleep.remote() for actor in self.actors])

    def onload(self) -> None:
        ray.get([actor.wake_up.remote() for actor in self.actors])

    def dispose(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
