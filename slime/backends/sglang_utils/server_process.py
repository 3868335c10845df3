"""Start and stop server subprocesses (engines, the router) so that none outlives its owner.

Each server starts in a new session, so it leads its own process group; stopping it signals the whole
group, which also reaches the workers SGLang's launch_server forks. An atexit hook stops servers the
owner forgot (or could not) stop, e.g. when a Ray actor exits.

A new session also escapes the signals that end the owner's group, and atexit does not run when the
owner is killed with SIGKILL. So on Linux each server is also tied to its owner with the kernel's
parent-death signal (prctl PR_SET_PDEATHSIG = SIGKILL, set by a small shim that then execs the server
under the same pid). The kernel sends it when the *thread* that forked the child exits, not the process,
so every server is forked from one daemon thread that lives as long as the owner process. Only the
server itself gets the signal; its own children are SGLang's to stop (it watches its parent too).
Elsewhere (macOS) servers still outlive an owner killed with SIGKILL.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

# Servers started here and not stopped yet, by pid. A stopped server's group id may later be reused by an
# unrelated process group, so each server is signalled by exactly one stop.
_running_servers: dict[int, subprocess.Popen] = {}

# Runs between fork and the server's exec: ask for SIGKILL when the forking thread ends (1 is PR_SET_PDEATHSIG),
# give up if the owner died before that took effect, then become the server. `-S`: no site-packages, fast start.
_DIE_WITH_OWNER = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0: sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
_SECRET_FLAGS = ("--api-key",)


class _Spawner:
    """Runs every fork on one long-lived daemon thread, the thread PR_SET_PDEATHSIG ties the servers to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forget_thread)  # a forked child has no copy of the thread

    def _forget_thread(self) -> None:
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._thread = None

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the caller
                future.set_exception(error)

    def run(self, fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="slime-server-spawner", daemon=True)
                self._thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future.result()


_spawner = _Spawner()


def _loggable(command: list[str]) -> str:
    """The command line with secret values (API keys) masked."""
    words = list(command)
    for i, word in enumerate(words[:-1]):
        if word in _SECRET_FLAGS:
            words[i + 1] = "***"
    return " ".join(words)


def server_log_path(args: Namespace, name: str) -> Path:
    """A fresh log file path for a server: `<args.server_log_dir or $TMPDIR/slime_logs>/<name>_<time>.log`."""
    # not a flag: set only on namespaces built for servers launched on their own (tests/support/engines.py)
    log_dir = Path(getattr(args, "server_log_dir", None) or Path(tempfile.gettempdir()) / "slime_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"{name}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.log"


def launch_server_process(
    command: list[str], log_path: str | Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start `command` in its own process group with stdout and stderr appended to `log_path`.

    On Linux the server is killed by the kernel if this process dies, even by SIGKILL (see the module
    docstring). The log gets the command line with API keys masked.

    Args:
        command: Full command, e.g. [sys.executable, "-m", "slime.backends.sglang_utils.launch_router", ...].
        log_path: File that receives the server's output.
        env: Environment for the server (defaults to this process's environment).

    Returns:
        The running process; it is stopped at interpreter exit if nobody stopped it before.
    """
    launched = command
    if sys.platform == "linux":
        launched = [sys.executable, "-S", "-c", _DIE_WITH_OWNER, str(os.getpid()), *command]
    with open(log_path, "a") as log_file:
        log_file.write(f"$ {_loggable(command)}\n")
        log_file.flush()
        process = _spawner.run(
            lambda: subprocess.Popen(
                launched,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
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
