"""`run_driver`'s restart loop in this process, with a training function that fails the way a dead job process
does (no cluster needed: the loop reacts to the exception, and a failed attempt that set nothing up has nothing
to close), and the wait on training ranks that ends when a process they depend on dies (on the session's Ray
cluster). The end-to-end restarts from a real death are in tests/e2e/test_chaos.py."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
from support.ray_head import connect_session_cluster
from support.runs import small_run_flags, write_addition_prompts

from slime.ray import actor_group
from slime.ray.actor_group import JobProcessDied, wait_while_alive
from slime.ray.driver import run_driver
from slime.utils.job_reaper import PIDS_FILE_ENV

DEATH = "training rank 0 of the actor (1 ranks) died during training on rollout 1"


def attempts_of(train_error: Exception, argv: list[str]) -> tuple[list[tuple], str]:
    """Run `run_driver` with a training function that raises `train_error`; the (load, start_rollout_id) of each
    attempt and the driver's last line."""
    attempts = []

    def train(args):
        attempts.append((args.load, args.start_rollout_id))
        raise train_error

    connected = ray.is_initialized()
    try:
        with pytest.raises(SystemExit) as ended:
            run_driver(train, argv)  # its exit ends the Ray job it ran in
    finally:
        stop_job_reaper(os.environ[PIDS_FILE_ENV])
    if connected:
        connect_session_cluster()  # for this process's later tests on the session cluster
    return attempts, str(ended.value)


def stop_job_reaper(pids_file: str) -> None:
    """End the job reaper `run_driver` started (`pids_file` names its folder): it watches this test process, which
    outlives the run, and would poll /proc twice a second until the session ends."""
    if not pids_file:  # none started: run_driver failed before it
        return
    folder = Path(pids_file).parent
    if not folder.name.startswith("slime_job_"):  # not a folder start_job_reaper made: leave it
        return
    for process in psutil.process_iter(["cmdline"]):
        if str(folder) in (process.info["cmdline"] or []):
            process.terminate()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def flags(tiny_model_dir, tmp_path, monkeypatch) -> list[str]:
    monkeypatch.setenv(PIDS_FILE_ENV, "")  # run_driver's job reaper points it at its file: restored after the test
    prompts = write_addition_prompts(tmp_path / "prompts.jsonl")
    return [*small_run_flags(tiny_model_dir, prompts, tmp_path / "run"), "--num-rollout", "3"]


@pytest.mark.reliability(
    "a trainer rank or the rollout manager dies in every attempt, with --use-fault-tolerance --max-restarts 2",
    "the run restarts from --save twice (each restart logged as 'restart k of --max-restarts 2'), then ends naming "
    "the death",
)
def test_restarts_from_save_at_most_max_restarts_times(flags, tmp_path, caplog):
    argv = [*flags, "--use-fault-tolerance", "--max-restarts", "2", "--start-rollout-id", "0"]
    with caplog.at_level(logging.WARNING, logger="slime.ray.driver"):
        attempts, last_line = attempts_of(JobProcessDied(DEATH), argv)
    save = str(tmp_path / "run")
    # The first attempt as given; each restart resumes from --save, at the step its checkpoint names.
    assert attempts == [(None, 0), (save, None), (save, None)]
    assert last_line == f"slime: JobProcessDied: {DEATH}"
    restarts = [r.getMessage() for r in caplog.records if "restart " in r.getMessage()]
    assert [m.split("; ")[-1].split(" from")[0] for m in restarts] == [
        "restart 1 of --max-restarts 2",
        "restart 2 of --max-restarts 2",
    ]


def test_other_failures_and_runs_without_the_flag_are_not_restarted(flags):
    # Without --use-fault-tolerance a death ends the run at once (what the flag would do is in its message).
    attempts, last_line = attempts_of(JobProcessDied(DEATH), flags)
    assert attempts == [(None, None)] and last_line == f"slime: JobProcessDied: {DEATH}"
    # A bug in the training function is no death: restarting would only repeat it.
    attempts, last_line = attempts_of(ValueError("bad reward"), [*flags, "--use-fault-tolerance"])
    assert attempts == [(None, None)] and last_line == "slime: ValueError: bad reward"


@ray.remote(num_cpus=0)
class Sleeper:
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@pytest.mark.reliability(
    "the rollout manager dies while the trainer pushes weights to its engines (or connects to them)",
    "the driver notices within seconds (JobProcessDied, restartable) instead of waiting out the collective's "
    "30-minute timeout",
)
def test_a_peer_that_dies_ends_the_wait_on_ranks(ray_cluster, monkeypatch):
    monkeypatch.setattr(actor_group, "_PEER_CHECK_INTERVAL_S", 0.3)
    rank, peer = Sleeper.remote(), Sleeper.remote()
    peer.sleep.remote(60)  # busy through the whole wait below: its pings answer late, which is not death
    assert wait_while_alive([rank.sleep.remote(2)], ("busy peer", peer), "a short call") is None

    ref = rank.sleep.remote(60)
    threading.Timer(1.0, ray.kill, args=(peer,)).start()  # now it dies, busy as it is
    with pytest.raises(JobProcessDied, match="the rollout manager died during a weight update"):
        wait_while_alive([ref], ("rollout manager", peer), "a weight update")
    assert not ray.wait([ref], timeout=0)[0]  # it ended before the ranks' call did
    ray.kill(rank)
