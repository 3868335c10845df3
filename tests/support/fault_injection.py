"""Faults a user's plugin could cause, injected through slime's own extension points (end-to-end tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
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


def kill_an_engine_before_the_push_of_rollout_1(args, rollout_id, data):
    """--rollout-data-postprocess-path hook (training rank 0): after rollout 1 was generated, before the weight push
    that follows its training, SIGKILL one CPU engine server of this run (found by its --model-path)."""
    if rollout_id != 1 or int(os.environ.get("RANK", "0")) != 0:
        return
    servers = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "slime.backends.cpu_engine" in cmdline and args.hf_checkpoint in cmdline:
            servers.append(process.info["pid"])
    _kill_and_wait(max(servers))


def exit_trainer_once_in_rollout_1(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: the training process dies on rollout 1, once per --save folder."""
    marker = Path(args.save) / "trainer_killed_once"
    if rollout_id == 1 and not marker.exists():
        marker.write_text("")
        os._exit(1)


def _start_a_stubborn_process() -> psutil.Process:
    """A process that ignores SIGTERM, in a session of its own (a group signal misses it): what a user's reward code
    or tool might leave behind, or a worker hung in its exit."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    process = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return psutil.Process(process.pid)


def leave_a_stubborn_process(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: in rollout 0, training rank 0 starts `_start_a_stubborn_process` and
    writes [pid, create time] to `{--save}/stubborn.json`; only the job reaper stops it."""
    if rollout_id == 0 and int(os.environ.get("RANK", "0")) == 0:
        process = _start_a_stubborn_process()
        (Path(args.save) / "stubborn.json").write_text(json.dumps([process.pid, process.create_time()]))


def _driver_process() -> psutil.Process:
    """The train.py / train_async.py process above this one (a local Ray cluster's processes descend from it)."""
    for process in psutil.Process().parents():
        if any(Path(part).name in ("train.py", "train_async.py") for part in process.cmdline()):
            return process
    raise RuntimeError("no train.py or train_async.py process among the ancestors of this process")


def kill_driver_once_in_rollout_2(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: SIGKILL the driver while rollout 2 trains, once per --save folder.

    It first writes `{--save}/killed_job.json`: [pid, create time] of the driver and of every process under it
    (Ray's, the trainers', the engines'), so a test can check that the whole job goes with the driver.
    """
    record = Path(args.save) / "killed_job.json"
    if rollout_id != 2 or record.exists():
        return
    driver = _driver_process()
    _start_a_stubborn_process()  # a descendant of the driver too: it must go with the job
    time.sleep(1.0)  # the job reaper notes the job's processes every 0.5 s
    job = []
    for process in [driver, *driver.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):  # one that ends meanwhile is no longer part of the job
            job.append([process.pid, process.create_time()])
    record.write_text(json.dumps(job))
    _kill_and_wait(driver.pid)
