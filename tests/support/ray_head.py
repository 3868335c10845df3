"""Ray clusters of the tests: the session cluster of a test process (`connect_session_cluster`, which its driver
runs join too), and the pieces of a `ray start --head` node on 127.0.0.1 with free ports, stopped by its process id
(never `ray stop`, which would stop every Ray on the machine, another test worker's too)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from slime.utils.http_utils import find_free_port

START_PORT_FLAGS = (
    "--port", "--dashboard-port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port",
    "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
)  # fmt: skip
WORKER_PORTS = (10002, 19999)  # `ray start`'s default --min-worker-port / --max-worker-port


@functools.cache
def _interpreter_bin() -> Path:
    """A folder with `python` and `ray` for the interpreter running the tests. The `ray` script on PATH may belong to
    another Python (a venv made with --system-site-packages has none of its own), whose Ray workers would import
    another installed slime than the one under test."""
    folder = Path(tempfile.mkdtemp(prefix="slime-test-bin-"))
    (folder / "python").symlink_to(sys.executable)
    (folder / "python3").symlink_to(sys.executable)
    ray = folder / "ray"
    ray.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ray.scripts.scripts "$@"\n')
    ray.chmod(0o755)
    return folder


def with_test_interpreter(env: dict[str, str]) -> dict[str, str]:
    """`env` with `python` and `ray` on PATH meaning the interpreter that runs the tests."""
    return env | {"PATH": os.pathsep.join([str(_interpreter_bin()), env.get("PATH", os.defpath)])}


def free_start_ports() -> dict[str, int]:
    """A free port for each of `ray start`'s component ports, none inside its default worker port range."""
    ports: dict[str, int] = {}
    for flag in START_PORT_FLAGS:
        while flag not in ports or WORKER_PORTS[0] <= ports[flag] <= WORKER_PORTS[1]:
            ports[flag] = find_free_port(exclude=set(ports.values()))
    return ports


def stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` (it drains the node and stops what it started), then SIGKILL to any
    descendant still alive 15 s later."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
    _, alive = psutil.wait_procs(tree, timeout=15)
    for leftover in alive:
        leftover.kill()


def connect_session_cluster() -> None:
    """Connect this test process to its local Ray cluster (tests/conftest.py `ray_cluster`), starting a new one when
    a test ended it: `run_driver` shuts Ray down when its run ends, as train.py's process does, and the multi-node
    tests swap in a cluster of their own. A fixture that already ran is not run again, so they restore it here."""
    from slime.ray.placement_group import init_ray

    init_ray(num_cpus=16, log_to_driver=False)  # a no-op while connected; 16 slots: driver runs join it too
