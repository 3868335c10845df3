"""Reserve devices for the trainer and the engines in one Ray placement group.

On GPU every bundle is one GPU (plus a CPU); on CPU it is one logical CPU slot, and the thread
budget of whatever runs on it is set explicitly by that process. Bundles are ordered by node, so
trainer ranks on one node are neighbours and every engine sits on one node. On a one-node cluster
engines listen on 127.0.0.1; on several nodes each engine listens on its node's IP, where the
router and the trainer reach it, and then needs `--sglang-api-key` unless that IP is loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field
from urllib.parse import urlparse

import ray
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.backends.sglang_utils.engine_actor import is_loopback_host
from slime.utils import job_reaper
from slime.utils.engine_args import engine_api_key

logger = logging.getLogger(__name__)


@dataclass
class PlacementSlice:
    """A run of bundles in the shared placement group, in device order."""

    pg: PlacementGroup | None
    bundle_indices: list[int] = field(default_factory=list)
    use_gpu: bool = False
    gpu_ids: list[int] = field(default_factory=list)  # node-local GPU id of each bundle (GPU only)
    node_ips: list[str] = field(default_factory=list)  # IP of the node holding each bundle
    multi_node: bool = False  # the cluster's nodes have more than one IP

    def __len__(self) -> int:
        return len(self.bundle_indices)

    def host(self, i: int) -> str:
        """Address a server on the i-th bundle listens on: 127.0.0.1 on a one-node cluster, else its node's IP."""
        return self.node_ips[i] if self.multi_node else "127.0.0.1"

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
    ~/.ray/auth_token), so it takes no jobs from the network. It gets at least `num_cpus` logical CPUs:
    bundles are slots, not cores, and the real thread budget is set per process. A RAY_ADDRESS on
    loopback (a cluster started with `--node-ip-address 127.0.0.1`) is joined over loopback, and outside
    `ray job submit` the workers of a joined cluster get this process's PYTHONPATH.

    Args:
        num_cpus: Fewest logical CPUs of a local cluster.
        init_kwargs: Passed to `ray.init` for a local cluster (e.g. `log_to_driver=False`).
    """
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        if is_loopback_host(urlparse(address if "://" in address else f"//{address}").hostname or ""):
            bind_ray_to_loopback()  # else Ray rewrites the loopback address and waits for a GCS that is not there
        runtime_env = None
        if RAY_JOB_CONFIG_JSON_ENV_VAR not in os.environ:
            # The workers of a running cluster do not see this shell's environment: PYTHONPATH, where user plugins
            # are found, and the job reaper's pid file, where they register (under `ray job submit` the job's
            # runtime env is the one that applies, and Ray ends the job's workers itself).
            env_vars = {
                name: os.environ[name] for name in ("PYTHONPATH", job_reaper.PIDS_FILE_ENV) if os.environ.get(name)
            }
            if env_vars:
                runtime_env = {"env_vars": env_vars}
            if job_reaper.PIDS_FILE_ENV in env_vars:
                runtime_env["worker_process_setup_hook"] = "slime.utils.job_reaper.register_this_process"
        ray.init(address=address, runtime_env=runtime_env)
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


def _ip_order(ip: str) -> tuple:
    try:
        return (0, ipaddress.ip_address(ip))  # numerically: 10.0.0.9 before 10.0.0.10
    except ValueError:
        return (1, ip)


def _node_slots(use_gpu: bool) -> dict[str, int]:
    """Slots (GPUs, or logical CPUs) of the alive nodes by node IP; nodes that share an IP share one machine, and
    their slots add up."""
    kind = "GPU" if use_gpu else "CPU"
    slots: dict[str, int] = {}
    for node in ray.nodes():
        if node["Alive"]:
            ip = node["NodeManagerAddress"]
            slots[ip] = slots.get(ip, 0) + int(node["Resources"].get(kind, 0))
    return slots


@ray.remote(num_cpus=0)
def _bundle_gpu_id() -> int:
    gpu_ids = ray.get_gpu_ids()
    return int(gpu_ids[0]) if gpu_ids else 0


def _bundle_locations(pg: PlacementGroup, num_bundles: int, use_gpu: bool) -> list[tuple[str, int]]:
    """(node IP, node-local GPU id or 0) of every bundle; the GPU ids come from a task on each bundle."""
    node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    bundle_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    ips = [node_ips[bundle_nodes[i]] for i in range(num_bundles)]
    if not use_gpu:
        return [(ip, 0) for ip in ips]
    strategies = [
        PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i) for i in range(num_bundles)
    ]
    gpu_ids = ray.get([_bundle_gpu_id.options(num_gpus=0.01, scheduling_strategy=s).remote() for s in strategies])
    return list(zip(ips, gpu_ids, strict=True))


def engine_placement_problem(
    engine_node_ips: list[str], gpus_per_engine: int, node_slots: dict[str, int], use_gpu: bool
) -> str | None:
    """Why the engines cannot run where their bundles landed, or None: an engine's bundles must share one node.

    Args:
        engine_node_ips: Node IP of each rollout bundle, engine `e` on `[e * g, (e + 1) * g)`.
        gpus_per_engine: `g`, `--rollout-num-gpus-per-engine`.
        node_slots: Slots of each node (from `_node_slots`), for the message.
        use_gpu: Whether the slots are GPUs.
    """
    for e in range(0, len(engine_node_ips), gpus_per_engine):
        nodes = sorted(set(engine_node_ips[e : e + gpus_per_engine]), key=_ip_order)
        if len(nodes) > 1:
            unit = "GPUs" if use_gpu else "CPU slots"
            sizes = ", ".join(f"{ip}: {n}" for ip, n in sorted(node_slots.items(), key=lambda item: _ip_order(item[0])))
            return (
                f"engine {e // gpus_per_engine} would span nodes {', '.join(nodes)}: --rollout-num-gpus-per-engine "
                f"{gpus_per_engine} needs {gpus_per_engine} {unit} on one node and slime starts every engine on one "
                f"node (nodes' {unit}: {sizes}). Use at most {max(node_slots.values(), default=0)} per engine, and "
                "make --actor-num-nodes x --actor-num-gpus-per-node (unless --colocate) and each node's slots "
                "multiples of it"
            )
    return None


def engine_host_problem(args, hosts: list[str]) -> str | None:
    """Why engines may not listen on `hosts`, or None: an engine on a non-loopback address needs an API key.

    Args:
        args: Reads `sglang_api_key` (through `engine_api_key`).
        hosts: The address each engine will listen on (`PlacementSlice.host`).
    """
    exposed = sorted({host for host in hosts if not is_loopback_host(host)}, key=_ip_order)
    if not exposed or engine_api_key(args):
        return None
    return (
        f"engines would listen on {', '.join(exposed)}, where the other nodes of this multi-node Ray cluster reach "
        "them, without an API key: engines accept weight pushes from anyone who can reach them. Pass "
        "--sglang-api-key KEY (the router and the trainer send it)"
    )


def create_placement_groups(args) -> dict[str, PlacementSlice]:
    """Create the placement group and split it into the "actor" and "rollout" slices.

    colocate: trainer and engines share the same `max(actor, rollout)` bundles.
    disaggregated: trainer bundles first, engine bundles after them (bundles in node IP, then GPU order).

    Raises:
        RuntimeError: the cluster cannot hold the bundles (after `--distributed-timeout-minutes`).
        ValueError: an engine's bundles landed on two nodes, or engines would listen on a non-loopback
            node IP without `--sglang-api-key`; the placement group is removed first.
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
    timeout = 60 * args.distributed_timeout_minutes
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        raise RuntimeError(
            f"Ray could not reserve {num_bundles} bundles of {bundle} within {timeout} s; cluster has "
            f"{ray.cluster_resources()}. Lower --actor-num-gpus-per-node / --rollout-num-gpus or add nodes."
        )
    locations = _bundle_locations(pg, num_bundles, use_gpu)
    order = sorted(range(num_bundles), key=lambda i: (_ip_order(locations[i][0]), locations[i][1]))
    gpu_ids = [locations[i][1] for i in order] if use_gpu else []
    node_ips = [locations[i][0] for i in order]
    node_slots = _node_slots(use_gpu)
    multi_node = len(node_slots) > 1  # by IP: raylets sharing one machine's address are one host

    def part(start: int, size: int) -> PlacementSlice:
        end = start + size
        return PlacementSlice(pg, order[start:end], use_gpu, gpu_ids[start:end], node_ips[start:end], multi_node)

    slices = {"actor": part(0, num_actor), "rollout": part(rollout_offset, num_rollout)}
    rollout, per_engine = slices["rollout"], args.rollout_num_gpus_per_engine
    if num_rollout and not args.rollout_external_engine_addrs:
        problem = engine_placement_problem(rollout.node_ips, per_engine, node_slots, use_gpu)
        problem = problem or engine_host_problem(args, [rollout.host(i) for i in range(0, num_rollout, per_engine)])
        if problem:
            ray.util.remove_placement_group(pg)
            raise ValueError(problem)
    logger.info(
        "placement group: %d bundles of %s (colocate=%s) on nodes %s", num_bundles, bundle, args.colocate, node_ips
    )
    return slices
