"""The local Ray cluster slime starts listens on loopback only and requires token authentication."""

from __future__ import annotations

import ipaddress

import psutil
import pytest
import ray


def _cluster_processes() -> list[psutil.Process]:
    """This session's GCS, raylet and every process the raylet started (workers, agents)."""
    node = ray._private.worker._global_node
    roots = [info.process.pid for infos in node.all_processes.values() for info in infos if info.process is not None]
    processes = []
    for pid in roots:
        try:
            root = psutil.Process(pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return processes


@pytest.mark.reliability(
    "another host connects to the local Ray cluster slime starts",
    "GCS, raylet and workers listen on 127.0.0.1 only; token authentication is on",
)
def test_local_cluster_listens_on_loopback_with_token_auth(ray_cluster):
    from ray._raylet import AuthenticationMode, get_authentication_mode

    @ray.remote(num_cpus=0)
    def node_ip() -> str:
        return ray.util.get_node_ip_address()

    assert ray.get(node_ip.remote()) == "127.0.0.1"
    listening = set()
    for process in _cluster_processes():
        try:
            connections = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        listening |= {(process.name(), c.laddr.ip) for c in connections if c.status == psutil.CONN_LISTEN}
    assert any(name == "gcs_server" for name, _ in listening), f"GCS not found among {listening}"
    exposed = {(name, ip) for name, ip in listening if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback}
    assert not exposed, f"Ray processes listen beyond loopback: {sorted(exposed)}"
    assert get_authentication_mode() == AuthenticationMode.TOKEN
