"""RayTrainGroup: one training actor per rank, driven together.

Every method fans a call out to all ranks and returns the Ray object refs (`async_*`) or waits.
The driver splits each rollout into one shard per data-parallel rank; with Megatron's tensor,
pipeline or context parallelism several ranks share a data-parallel rank and get the same shard.
"""

from __future__ import annotations

import importlib
from typing import Any

import ray

from slime.ray.placement_group import PlacementSlice

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


# --train-backend -> (module, class) of its training actor, imported only in the rank's own process: a run needs only
# its own backend's dependencies (megatron-core is optional), and the driver none of them.
BACKEND_ACTORS = {
    "fsdp": ("slime.backends.fsdp_utils.actor", "FSDPTrainRayActor"),
    "megatron": ("slime.backends.megatron_utils.actor", "MegatronTrainRayActor"),
}


def backend_actor_name(train_backend: str) -> str:
    if train_backend not in BACKEND_ACTORS:
        raise ValueError(f"unknown --train-backend {train_backend!r}; choose {' or '.join(BACKEND_ACTORS)}")
    return BACKEND_ACTORS[train_backend][1]


def backend_actor_class(train_backend: str) -> type:
    """The training actor class of `--train-backend`, imported."""
    name = backend_actor_name(train_backend)
    return getattr(importlib.import_module(BACKEND_ACTORS[train_backend][0]), name)


class TrainRank:
    """One training rank as a Ray actor: builds the backend's actor inside its own process, so the driver, which only
    holds handles, never imports the backend (its transformers and torch.distributed modules: ~4 s of a busy core per
    run). The remote methods forward to it; other attributes (e.g. `device`, for `__ray_call__`) read through."""

    def __init__(self, train_backend: str, world_size: int, rank: int, master_addr, master_port):
        self.backend = backend_actor_class(train_backend)(world_size, rank, master_addr, master_port)

    def __getattr__(self, name: str):
        if name == "backend":  # not set yet: __init__ failed
            raise AttributeError(name)
        return getattr(self.backend, name)

    def get_master_addr_and_port(self):
        return self.backend.get_master_addr_and_port()

    def init(self, args, role: str, with_ref: bool = False) -> int:
        return self.backend.init(args, role, with_ref)

    def train(self, rollout_id: int, data_ref, **kwargs):
        return self.backend.train(rollout_id, data_ref, **kwargs)

    def compute_values(self, data_ref):
        return self.backend.compute_values(data_ref)

    def save_model(self, rollout_id: int, update_tracker: bool = True):
        return self.backend.save_model(rollout_id, update_tracker)

    def connect_rollout_engines(self, engines, engine_urls):
        return self.backend.connect_rollout_engines(engines, engine_urls)

    def update_weights(self):
        return self.backend.update_weights()

    def check_weights_equal(self):
        return self.backend.check_weights_equal()

    def offload(self):
        return self.backend.offload()

    def onload(self):
        return self.backend.onload()


def model_parallel_sizes(args) -> tuple[int, int, int]:
    """(tensor, pipeline, context) parallel sizes of the trainer: Megatron's flags, all 1 under FSDP."""
    if args.train_backend != "megatron":
        return 1, 1, 1
    return args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size


def data_parallel_rank(rank: int, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """The data-parallel rank of training rank `rank` under Megatron's default rank order.

    megatron-core's `initialize_model_parallel(order="tp-cp-ep-dp-pp")` numbers ranks with the tensor
    rank fastest, then context, then data, then pipeline (expert parallelism is carved out of the data
    ranks for expert layers only, so it does not move dense data-parallel ranks):
    `rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`.

    Args:
        rank: Global training rank.
        world_size: Number of training ranks.
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        cp: Context-parallel size.

    Returns:
        The data-parallel rank, in `[0, world_size // (tp * pp * cp))`.
    """
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(
            f"{world_size} training ranks do not split into model-parallel groups of tensor {tp} x pipeline {pp} "
            f"x context {cp}: make --actor-num-nodes x --actor-num-gpus-per-node a multiple of {model_parallel}"
        )
    return (rank // (tp * cp)) % (world_size // model_parallel)


def data_parallel_ranks(args, world_size: int) -> list[int]:
    """The data-parallel rank of every training rank (identity under FSDP); see `data_parallel_rank`."""
    tp, pp, cp = model_parallel_sizes(args)
    return [data_parallel_rank(rank, world_size, tp, pp, cp) for rank in range(world_size)]


class JobProcessDied(RuntimeError):
    """A trainer rank (or the rollout manager) died: the run cannot go on with the processes it has; with
    `--use-fault-tolerance` the driver restarts the job from its last checkpoint."""


# How often a wait with a `peer` checks that the peer is alive.
_PEER_CHECK_INTERVAL_S = 2.0


def wait_while_alive(refs: list, peer: tuple[str, Any], what: str) -> None:
    """Wait until every ref is ready, unless `peer` (`(name, actor)`) dies first: then raise JobProcessDied.

    The peer is pinged every few seconds; a busy peer answers late and counts as alive meanwhile.
    """
    name, actor = peer
    ping = actor.__ray_ready__.remote()
    while len(ray.wait(refs, num_returns=len(refs), timeout=_PEER_CHECK_INTERVAL_S)[0]) < len(refs):
        if not ray.wait([ping], timeout=0)[0]:
            continue
        try:
            ray.get(ping)
        except ray.exceptions.RayActorError as e:
            raise JobProcessDied(
                f"the {name} died during {what}; restart the run from the last checkpoint (--load), which "
                "--use-fault-tolerance does on its own"
            ) from e
        ping = actor.__ray_ready__.remote()


def _answers(actor) -> bool:
    """False only when the actor is dead (a live rank still busy in a collective counts as alive)."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        pass
    return True


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
        self.dp_ranks = data_parallel_ranks(args, world_size)
        self.dp_size = max(self.dp_ranks) + 1
        # A bundle may hold an actor rank, a critic rank (PPO) and, colocated, an engine (0.2).
        share = 0.4 if args.colocate or args.use_critic else 1.0
        env_vars = {"NCCL_CUMEM_ENABLE": "0", **(args.train_env_vars or {})}
        if actor_slice.use_gpu:
            env_vars["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        else:
            env_vars |= {name: str(args.train_num_threads) for name in THREAD_ENV_VARS}
        # Named after the backend's class, so its processes are `ray::FSDPTrainRayActor`, without importing it here.
        rank_class = type(backend_actor_name(args.train_backend), (TrainRank,), {"__doc__": TrainRank.__doc__})
        remote_cls = ray.remote(rank_class)

        def make(rank: int, master_addr: str | None, master_port: int | None):
            options: dict[str, Any] = {"num_cpus": share, "runtime_env": {"env_vars": env_vars}}
            if actor_slice.use_gpu:
                options["num_gpus"] = share
            if actor_slice.pg is not None:
                options["scheduling_strategy"] = actor_slice.strategy(rank)
            return remote_cls.options(**options).remote(args.train_backend, world_size, rank, master_addr, master_port)

        rank0 = make(0, None, None)
        self.actors = [rank0]
        if world_size == 1:  # no rendezvous to hand out: the driver goes on while the rank starts (a critic, too)
            return
        master_addr, master_port = ray.get(rank0.get_master_addr_and_port.remote())
        if actor_slice.multi_node:
            # Rank 0 names 127.0.0.1 on CPU; the ranks reach it at its node's IP (its store listens on every address).
            master_addr = actor_slice.node_ips[0]
        self.actors += [make(rank, master_addr, master_port) for rank in range(1, world_size)]

    def __len__(self) -> int:
        return len(self.actors)

    def wait(self, refs: list, what: str, rollout_manager: Any = None) -> list:
        """`ray.get(refs)` of per-rank calls; a rank that died is named in a JobProcessDied.

        Args:
            refs: One object ref per rank, in rank order.
            what: What the ranks were doing, for the message ("training on rollout 3").
            rollout_manager: Given when the ranks work with its engines (a weight push, connecting to them): checked
                every few seconds, its death also ends the wait, with a JobProcessDied. A collective with engines
                that are gone may otherwise wait out its 30-minute timeout.
        """
        if rollout_manager is not None:
            peer = ("rollout manager", rollout_manager)
            wait_while_alive(refs, peer, f"{what}, which the {self.role}'s ranks still wait on")
        try:
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:
                raise  # a rank whose process never started: its own error says why
            # A rank's death also fails its peers' collectives: name the ranks that are gone.
            dead = [rank for rank, actor in enumerate(self.actors) if not _answers(actor)]
            if not dead:
                raise
            ranks = ("rank " if len(dead) == 1 else "ranks ") + ", ".join(map(str, dead))
            resume = f"--load {self.args.save}" if self.args.save else "--load <your --save folder>"
            raise JobProcessDied(
                f"training {ranks} of the {self.role} ({len(self.actors)} ranks) died during {what}; its log is in "
                f"Ray's session logs (/tmp/ray/session_latest/logs). Resume from the last checkpoint with {resume}"
            ) from e

    def init(self, with_ref: bool = False) -> int:
        """Build models on every rank (loading `--load`); returns the rollout id to start from."""
        return self.wait(self.async_init(with_ref), "init")[0]

    def async_init(self, with_ref: bool = False) -> list:
        """Start `init` on every rank; `wait(refs, "init")[0]` is its result. The actor and the critic build theirs
        at once this way."""
        return [actor.init.remote(self.args, self.role, with_ref) for actor in self.actors]

    def rank_shards(self, data_refs: list) -> list:
        """Each rank's shard: `data_refs[d]` belongs to data-parallel rank `d` (one per `dp_size`)."""
        if len(data_refs) != self.dp_size:
            raise ValueError(f"{len(data_refs)} data shards for {self.dp_size} data-parallel ranks")
        return [data_refs[dp_rank] for dp_rank in self.dp_ranks]

    def async_train(self, rollout_id: int, data_refs: list, **kwargs) -> list:
        """Start training on rollout `rollout_id`; every rank gets the shard of its data-parallel rank."""
        shards = self.rank_shards(data_refs)
        return [actor.train.remote(rollout_id, ref, **kwargs) for actor, ref in zip(self.actors, shards, strict=True)]

    def compute_values(self, data_refs: list) -> list:
        """Critic only: per-rank value estimates for the actor's advantages (PPO)."""
        shards = self.rank_shards(data_refs)
        return [actor.compute_values.remote(ref) for actor, ref in zip(self.actors, shards, strict=True)]

    def save_model(self, rollout_id: int, update_tracker: bool = True) -> None:
        """Every rank writes its part of checkpoint `rollout_id` (the tracker too unless `update_tracker` is False)."""
        refs = [actor.save_model.remote(rollout_id, update_tracker) for actor in self.actors]
        self.wait(refs, f"saving rollout {rollout_id}")

    def connect_rollout_engines(self, engines: list, engine_urls: list[str], rollout_manager: Any = None) -> None:
        """Form the ranks' weight-update links with the engines (see `update_weights` for `rollout_manager`)."""
        refs = [actor.connect_rollout_engines.remote(engines, engine_urls) for actor in self.actors]
        self.wait(refs, "connecting to the engines", rollout_manager)

    def update_weights(self, rollout_manager: Any = None) -> None:
        """Push the trainer's weights to the engines; a no-op under `--debug-train-only` (there are none).

        Args:
            rollout_manager: The engines' owner; if it dies during the push (its engines with it) the push ends
                with a JobProcessDied rather than waiting on engines that are gone.
        """
        if self.args.debug_train_only:
            return
        self.wait([actor.update_weights.remote() for actor in self.actors], "a weight update", rollout_manager)

    def check_weights_equal(self) -> float:
        """Largest gap between any engine's and the trainer's probe log-probs (raises past the tolerance)."""
        results = ray.get([actor.check_weights_equal.remote() for actor in self.actors])
        return float(results[0]["max_abs_diff"])

    def offload(self) -> dict[str, float]:
        """Free the ranks' training memory; returns `perf/actor_offload_freed_gb`, summed over the ranks."""
        freed = ray.get([actor.offload.remote() for actor in self.actors])
        return {"perf/actor_offload_freed_gb": sum(freed) / 2**30}

    def onload(self) -> None:
        ray.get([actor.onload.remote() for actor in self.actors])

    def dispose(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
