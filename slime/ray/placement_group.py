"""Reserve devices for the trainer and the engines in one Ray placement group.

On GPU every bundle is one GPU (plus a CPU); on CPU it is one logical CPU slot, and the thread
budget of whatever runs on it is set explicitly by that process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


@dataclass
class PlacementSlice:
    """A run of bundles in the shared placement group, in device order."""

    pg: PlacementGroup | None
    bundle_indices: list[int] = field(default_factory=list)
    use_gpu: bool = False
    gpu_ids: list[int] = field(default_factory=list)  # node-local GPU id of each bundle (GPU only)

    def __len__(self) -> int:
        return len(self.bundle_indices)

    def strategy(self, i: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy that pins an actor to the i-th bundle of this slice."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.bundle_indices[i],
            placement_group_capture_child_tasks=True,
        )


def init_ray(num_cpus: int | None = None, **init_kwargs) -> None:
    """Connect to the cluster in RAY_ADDRESS (as under `ray job submit`), or start a local one.

    A local cluster listens on 127.0.0.1 only and requires Ray's token authentication (Ray 2.60
    turns it on for a new local cluster unless RAY_AUTH_MODE says otherwise, and keeps the token in
    ~/.ray/auth_token), so it takes no jobs from the network. It gets at least `num_cpus` logical CPUs: bundles are slots, not cores, and the real
    thread budget is set per process.

    Args:
        num_cpus: Fewest logical CPUs of a local cluster.
        init_kwargs: Passed to `ray.init` for a local cluster (e.g. `log_to_driver=False`).
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        logger.warning(
            "RAY_AUTH_MODE=%s: the local Ray cluster runs without token authentication", os.environ["RAY_AUTH_MODE"]
        )
    bind_ray_to_loopback()
    logical_cpus = max(os.cpu_count() or 1, num_cpus or 0)
    ray.init(
        address="local",
        num_cpus=logical_cpus,
        include_dashboard=False,
        logging_level=logging.WARNING,
        _node_ip_address="127.0.0.1",
        **init_kwargs,
    )


def bind_ray_to_loopback() -> None:
    """Make the Ray processes this process starts (GCS, raylet, workers) listen on 127.0.0.1 only.

    Ray turns a loopback node address into the machine's interface address unless its "no multi-host
    cluster" switch is off, and then its servers listen on every interface. The switch is read from
    the environment by each Ray process at import, so it is set there for the processes to come and
    on the already-imported module of this one.
    """
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


@ray.remote(num_cpus=0)
def _bundle_location() -> tuple[str, int]:
    gpu_ids = ray.get_gpu_ids()
    return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else 0


def _sorted_bundles(pg: PlacementGroup, num_bundles: int, use_gpu: bool) -> tuple[list[int], list[int]]:
    """Bundle indices ordered by (node ip, GPU id), so ranks on one node get neighbouring GPUs,
    and the GPU id of each bundle in that order."""
    if not use_gpu:
        return list(range(num_bundles)), []
    locations = ray.get(
        [
            _bundle_location.options(
                num_gpus=0.01,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(num_bundles)
        ]
    )
    order = sorted(range(num_bundles), key=lambda i: locations[i])
    return order, [locations[i][1] for i in order]


def create_placement_groups(args) -> dict[str, PlacementSlice]:
    """Create the placement group and split it into the "actor" and "rollout" slices.

    colocate: trainer and engines share the same `max(actor, rollout)` bundles.
    disaggregated: trainer bundles first, engine bundles after them.
    """
    num_actor = 0 if args.debug_rollout_only else args.actor_num_nodes * args.actor_num_gpus_per_node
    num_rollout = 0 if args.debug_train_only else args.rollout_num_gpus
    if args.colocate:
        num_bundles, rollout_offset = max(num_actor, num_rollout), 0
    else:
        num_bundles, rollout_offset = num_actor + num_rollout, num_actor

    init_ray(num_cpus=num_bundles + 1)
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if num_bundles == 0:
        return {"actor": PlacementSlice(None), "rollout": PlacementSlice(None)}

    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    timeout = 60 * getattr(args, "distributed_timeout_minutes", 10)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        raise RuntimeError(
            f"Ray could not reserve {num_bundles} bundles of {bundle} within {timeout} s; cluster has "
            f"{ray.cluster_resources()}. Lower --actor-num-gpus-per-node / --rollout-num-gpus or add nodes."
        )
    order, gpu_ids = _sorted_bundles(pg, num_bundles, use_gpu)
    logger.info("placement group: %d bundles of %s (colocate=%s)", num_bundles, bundle, args.colocate)
    return {
        "actor": PlacementSlice(pg, order[:num_actor], use_gpu, gpu_ids[:num_actor]),
        "rollout": PlacementSlice(
            pg,
            order[rollout_offset : rollout_offset + num_rollout],
            use_gpu,
            gpu_ids[rollout_offset : rollout_offset + num_rollout],
        ),
    }
