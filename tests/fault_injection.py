"""Faults a user's plugin could cause, injected through slime's own extension points (end-to-end tests)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil

from slime.rollout.sglang_rollout import generate

SAMPLES_PER_ROLLOUT = 4  # --rollout-batch-size 2 x --n-samples-per-prompt 2 in these tests
_calls = 0


def _server_pid(url: str) -> int:
    port = urlparse(url).port
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            return connection.pid
    raise RuntimeError(f"no process listens on {url}")


def _kill_and_wait(pid: int) -> None:
    """SIGKILL `pid` and wait until it has exited (a big process takes a while to be torn down)."""
    process = psutil.Process(pid)
    os.kill(pid, signal.SIGKILL)
    try:
        while process.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
    except psutil.NoSuchProcess:
        pass


async def kill_second_engine_in_rollout_1(args, sample, sampling_params):
    """The default generate, but the first request of rollout 1 SIGKILLs engine 1's server first."""
    global _calls
    if _calls == SAMPLES_PER_ROLLOUT:
        _kill_and_wait(_server_pid(args.rollout_engine_urls[1]))
    _calls += 1
    return await generate(args, sample, sampling_params)


def exit_trainer_once_in_rollout_1(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: the training process dies on rollout 1, once per --save folder."""
    marker = Path(args.save) / "trainer_killed_once"
    if rollout_id == 1 and not marker.exists():
        marker.write_text("")
        os._exit(1)
