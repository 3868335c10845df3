"""Start and stop server subprocesses (engines, the router) so that none outlives its owner.

Each server starts in a new session, so it leads its own process group; stopping it signals the whole
group, which also reaches the workers SGLang's launch_server forks. An atexit hook stops servers the
owner forgot (or could not) stop, e.g. when a Ray actor exits.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import tempfile
import time
from argparse import Namespace
from pathlib import Path

# Servers started here and not stopped yet, by pid. A stopped server's group id may later be reused by an
# unrelated process group, so each server is signalled by exactly one stop.
_running_servers: dict[int, subprocess.Popen] = {}


def server_log_path(args: Namespace, name: str) -> Path:
    """A fresh log file path for a server: `<args.server_log_dir or $TMPDIR/slime_logs>/<name>_<time>.log`."""
    log_dir = Path(getattr(args, "server_log_dir", None) or Path(tempfile.gettempdir()) / "slime_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"{name}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.log"


def launch_server_process(
    command: list[str], log_path: str | Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start `command` in its own process group with stdout and stderr appended to `log_path`.

    Args:
        command: Full command, e.g. [sys.executable, "-m", "sglang_router.launch_router", ...].
        log_path: File that receives the server's output.
        env: Environment for the server (defaults to this process's environment).

    Returns:
        The running process; it is stopped at interpreter exit if nobody stopped it before.
    """
    with open(log_path, "a") as log_file:
        log_file.write(f"$ {' '.join(command)}\n")
        log_file.flush()
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    _running_servers[process.pid] = process
    return process


def stop_server_process(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """Terminate a server started by `launch_server_process` and everything in its process group.

    Sends SIGTERM to the group, waits up to `timeout` seconds for the server to exit, then SIGKILLs
    whatever is left of the group. Safe to call more than once.
    """
    if _running_servers.pop(process.pid, None) is None:
        return  # already stopped, or not started by launch_server_process
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    # Children may outlive a server that exited on its own; the group id outlives the leader.
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def _signal_group(process_group_id: int, sig: signal.Signals) -> None:
    try:
        os.killpg(process_group_id, sig)
    except ProcessLookupError:
        pass  # the whole group is already gone


@atexit.register
def _stop_all_servers() -> None:
    for process in list(_running_servers.values()):
        stop_server_process(process)
