"""slime on a three-node Ray cluster: `ray.cluster_utils.Cluster` runs three raylets on this machine.

Linux routes all of 127.0.0.0/8 to loopback, so the nodes get their own addresses, 127.0.0.1 (the head,
no slots: the drivers and the RolloutManager), 127.0.0.2 (1 CPU slot) and 127.0.0.3 (2 slots). A server
on node 127.0.0.3 that listened on 127.0.0.1 would still be reached here; one that listens on 127.0.0.3
is reached only by whoever uses that node's address, which is what these tests check.
"""

from __future__ import annotations

import socket
from argparse import Namespace

import pytest
import ray
from ray.cluster_utils import Cluster
from support.ray_head import connect_session_cluster
from support.runs import run_training, small_run_flags, write_addition_prompts

from slime.backends.sglang_utils.router import list_workers
from slime.ray.actor_group import RayTrainGroup
from slime.ray.placement_group import bind_ray_to_loopback, create_placement_groups, engine_host_problem, init_ray
from slime.ray.rollout import create_rollout_manager
from slime.utils.arguments import parse_args
from slime.utils.engine_args import engine_api_key
from slime.utils.http_utils import bearer_headers, find_free_port, get_json, post_json

NODES = {"127.0.0.2": 1, "127.0.0.3": 2}  # node IP -> CPU slots; the head (127.0.0.1) has none


@pytest.fixture(scope="module")
def cluster():
    """The three nodes, with this process connected as a driver through RAY_ADDRESS (as `ray job submit` does).

    A session's local cluster (tests/conftest.py `ray_cluster`) is stopped meanwhile and started again after.
    """
    was_connected = ray.is_initialized()
    ray.shutdown()
    bind_ray_to_loopback()  # the raylets below read it from the environment
    head = {"node_ip_address": "127.0.0.1", "num_cpus": 0, "include_dashboard": False}
    nodes = Cluster(initialize_head=True, head_node_args=head | {"dashboard_agent_listen_port": find_free_port()})
    for ip, slots in NODES.items():
        nodes.add_node(node_ip_address=ip, num_cpus=slots)
    nodes.wait_for_nodes()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", nodes.address)
        init_ray()
    yield nodes
    ray.shutdown()
    nodes.shutdown()
    if was_connected:
        connect_session_cluster()


@pytest.fixture
def prompts(tmp_path):
    return write_addition_prompts(tmp_path / "train.jsonl")


def cluster_args(tiny_model_dir, prompts, tmp_path, *flags: str):
    return parse_args([*small_run_flags(tiny_model_dir, prompts, tmp_path / "save"), "--num-rollout", "1", *flags])


@pytest.fixture
def placed(cluster):
    """`create_placement_groups(args)`, its placement group removed after the test."""
    groups = []

    def place(args):
        slices = create_placement_groups(args)
        groups.append(slices["actor"].pg or slices["rollout"].pg)
        return slices

    yield place
    for pg in groups:
        ray.util.remove_placement_group(pg)


def on_node(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()))


# Bundles are ordered by node IP and the trainer takes the first ones: with 3 bundles on nodes of 1 and 2 slots
# the layout is forced, so each case has one right answer.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "trainer_nodes", "engine_nodes"),
    [
        (["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"], ["127.0.0.2"], ["127.0.0.3"] * 2),
        (["--actor-num-nodes", "2", "--rollout-num-gpus", "1"], ["127.0.0.2", "127.0.0.3"], ["127.0.0.3"]),
    ],
    ids=["trainer-and-engines-apart", "trainer-split-over-two-nodes"],
)
def test_bundles_are_laid_out_by_node(placed, tiny_model_dir, prompts, tmp_path, flags, trainer_nodes, engine_nodes):
    slices = placed(cluster_args(tiny_model_dir, prompts, tmp_path, *flags))
    assert slices["actor"].node_ips == trainer_nodes
    assert slices["rollout"].node_ips == engine_nodes
    # On several nodes every engine listens on its node's address.
    assert [slices["rollout"].host(i) for i in range(len(engine_nodes))] == engine_nodes
    ray_nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    table = ray.util.placement_group_table(slices["actor"].pg)["bundles_to_node_id"]
    actual = [ray_nodes[table[i]] for i in slices["actor"].bundle_indices + slices["rollout"].bundle_indices]
    assert actual == trainer_nodes + engine_nodes


@pytest.mark.slow
@pytest.mark.reliability(
    "--rollout-num-gpus-per-engine larger than any node's slots, on a multi-node cluster",
    "refused before any engine starts, naming the flag and each node's slots; the placement group is removed",
)
def test_engine_larger_than_a_node_is_refused(cluster, tiny_model_dir, prompts, tmp_path):
    args = cluster_args(
        tiny_model_dir, prompts, tmp_path, "--debug-rollout-only", "--rollout-num-gpus", "3",
        "--rollout-num-gpus-per-engine", "3",
    )  # fmt: skip
    with pytest.raises(ValueError) as refused:
        create_placement_groups(args)
    message = str(refused.value)
    assert "engine 0 would span nodes 127.0.0.2, 127.0.0.3" in message
    assert "--rollout-num-gpus-per-engine 3 needs 3 CPU slots on one node" in message
    assert "127.0.0.1: 0, 127.0.0.2: 1, 127.0.0.3: 2" in message and "Use at most 2 per engine" in message
    states = [pg["state"] for pg in ray.util.placement_group_table().values()]
    assert states and all(state == "REMOVED" for state in states)


@pytest.mark.reliability(
    "engines of a multi-node cluster on a non-loopback node IP without an API key",
    "a run gets a per-job key unless --sglang-api-key gives one; args without any key are refused at placement, "
    "saying where the engines would listen and to pass --sglang-api-key",
)
def test_engine_on_a_routable_node_ip_needs_an_api_key(tiny_model_dir, prompts, tmp_path):
    generated = cluster_args(tiny_model_dir, prompts, tmp_path)
    assert engine_host_problem(generated, ["192.0.2.7"]) is None
    args = Namespace(**{**vars(generated), "sglang_api_key": None})
    problem = engine_host_problem(args, ["127.0.0.3", "192.0.2.7"])
    assert problem is not None and "listen on 192.0.2.7" in problem and "--sglang-api-key KEY" in problem
    assert "127.0.0.3" not in problem  # a loopback alias is reached from this machine only
    assert engine_host_problem(args, ["127.0.0.2", "127.0.0.3"]) is None
    keyed = cluster_args(tiny_model_dir, prompts, tmp_path, "--sglang-api-key", "k3y")
    assert engine_host_problem(keyed, ["192.0.2.7"]) is None


@pytest.mark.slow
def test_trainer_ranks_on_two_nodes_rendezvous_at_rank0s_node_ip(placed, tiny_model_dir, prompts, tmp_path):
    args = cluster_args(tiny_model_dir, prompts, tmp_path, "--actor-num-nodes", "2", "--rollout-num-gpus", "1")
    group = RayTrainGroup(args, placed(args)["actor"])
    try:
        assert [on_node(actor) for actor in group.actors] == ["127.0.0.2", "127.0.0.3"]
        (_, port), (rank1_master, rank1_port) = ray.get([a.get_master_addr_and_port.remote() for a in group.actors])
        assert (rank1_master, rank1_port) == ("127.0.0.2", port)
    finally:
        group.dispose()


@pytest.mark.slow
def test_engine_on_another_node_listens_on_that_nodes_ip(placed, tiny_model_dir, prompts, tmp_path):
    args = cluster_args(tiny_model_dir, prompts, tmp_path, "--actor-num-nodes", "2", "--rollout-num-gpus", "1")
    manager = create_rollout_manager(args, placed(args)["rollout"])
    try:
        (url,) = ray.get(manager.get_engine_urls.remote())
        host, port = url.removeprefix("http://").split(":")
        assert host == "127.0.0.3"
        assert on_node(ray.get(manager.get_engines.remote())[0]) == "127.0.0.3"
        key = bearer_headers(engine_api_key(args))  # the job's own, generated at parse time
        assert get_json(f"{url}/get_model_info", headers=key)["model_path"] == str(tiny_model_dir)
        with pytest.raises(ConnectionRefusedError):  # nothing of the engine's on the head's address
            socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        router = ray.get(manager.__ray_call__.remote(lambda self: self.router.url))
        assert [w["url"] for w in list_workers(router)] == [url]
        answer = post_json(
            f"{router}/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        )
        assert len(answer["output_ids"]) == 3
    finally:
        ray.get(manager.dispose.remote())
        ray.kill(manager)


@pytest.mark.slow
def test_train_py_across_three_nodes(cluster, tiny_model_dir, tmp_path, monkeypatch):
    """Rank 0 on 127.0.0.2, rank 1 and the engine on 127.0.0.3: the ranks rendezvous across nodes, the weights
    are broadcast to the other node, and router and trainer reach the engine at 127.0.0.3 with its API key."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")  # init_ray joins a loopback RAY_ADDRESS over loopback
    save = tmp_path / "save"
    history = run_training(
        "train.py", save,
        *small_run_flags(tiny_model_dir, write_addition_prompts(tmp_path / "train.jsonl"), save),
        "--num-rollout", "2", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--check-weight-update-equal", "--sglang-api-key", "multi-node-k3y",
        # A tiny random model never answers right; a reward that differs within every group gives a gradient.
        "--custom-rm-path", "support.rewards.alternating_reward",
    )  # fmt: skip
    assert [row["rollout_id"] for row in history] == [0, 1]
    assert history[0]["train/grad_norm"] > 0  # rollout 1 was generated by weights that differ from the first push
    # The engine on 127.0.0.3 generated rollout 1 with the weights rank 0 broadcast from 127.0.0.2 after step 0.
    assert history[1]["train/train_rollout_logprob_max_abs_diff"] <= 1e-4
