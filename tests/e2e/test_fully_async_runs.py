"""train_async.py with the fully async rollout end to end: staleness bounds 0 (drop) and 1 (regenerate) checked
from the dumped samples, and a kill -9 of the driver followed by --load that trains every prompt exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from support.runs import (
    REPO,
    TESTS,
    rollout_rows,
    run_driver_script,
    saved_samples,
    small_run_flags,
    write_addition_prompts,
)

from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils import run_dir
from slime.utils.arguments import parse_args

FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def run_fully_async(model_dir, save_dir, *extra: str) -> list[dict]:
    prompt_file = write_addition_prompts(save_dir.parent / f"{save_dir.name}.jsonl")
    result = run_driver_script(
        "train_async.py", *small_run_flags(model_dir, prompt_file, save_dir), "--num-rollout", "3",
        "--rollout-function-path", FULLY_ASYNC, "--over-sampling-batch-size", "4", *extra,
    )  # fmt: skip
    assert result.returncode == 0, f"train_async.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return rollout_rows(save_dir)


def check_bound_and_exactly_once(save_dir, bound: int) -> list[int]:
    """No trained sample is more than `bound` pushes behind the trainer, no prompt group is trained twice."""
    trained = []
    for rollout_id in range(3):
        samples = saved_samples(save_dir, rollout_id)
        trainer_version = rollout_id + 1  # the first push is version 1, then one push after every step
        for sample in samples:
            assert trainer_version - min(int(v) for v in sample.weight_versions) <= bound, (rollout_id, sample.index)
        trained += sorted({s.group_index for s in samples})
    assert len(trained) == len(set(trained)) == 6
    return trained


@pytest.mark.slow
def test_train_async_bound_0_trains_on_policy(tiny_model_dir, tmp_path):
    rows = run_fully_async(tiny_model_dir, tmp_path / "run", "--max-weight-staleness", "0")
    check_bound_and_exactly_once(tmp_path / "run", 0)
    for rollout_id in range(3):  # bound 0: every token of step k comes from the weights trained at step k
        assert {v for s in saved_samples(tmp_path / "run", rollout_id) for v in s.weight_versions} == {
            str(rollout_id + 1)
        }
    assert [row["rollout_id"] for row in rows] == [0, 1, 2]
    assert all(row["rollout/staleness_max"] == 0 and "perf/train_wait_time" in row for row in rows)
    # What the loop generated while the trainer trained was stale after the push, and was dropped.
    assert sum(row["rollout/stale_groups"] for row in rows) >= 1


@pytest.mark.slow
def test_train_async_bound_1_regenerates_saves_and_evaluates(tiny_model_dir, tmp_path):
    save_dir = tmp_path / "run"
    eval_file = write_addition_prompts(tmp_path / "eval.jsonl", operands=range(1, 3))
    rows = run_fully_async(
        tiny_model_dir, save_dir, "--max-weight-staleness", "1", "--staleness-policy", "regenerate",
        "--partial-rollout", "--save-interval", "3",
        "--eval-prompt-data", "add", str(eval_file), "--eval-interval", "3", "--skip-eval-before-train",
    )  # fmt: skip
    trained = check_bound_and_exactly_once(save_dir, 1)
    assert all(row["rollout/staleness_max"] <= 1 for row in rows)
    assert "eval/add" in rows[-1]  # eval ran beside the generation loop
    # The checkpoint of step 2 holds, put back as fresh prompts, every group drawn but not trained.
    saved = torch.load(save_dir / "rollout" / "data_source_2.pt", weights_only=True)
    in_checkpoint = [g[0]["group_index"] for g in saved["buffer"]]
    assert sorted(trained + in_checkpoint) == list(range(saved["sample_group_index"]))


def run_to_files(script: str, *flags: str, log: Path, timeout: float = 420) -> int:
    """`python <script> <flags>` as `run_driver_script` runs it, with its output in `log`.{out,err}: a killed
    driver's descendants could hold pipes open. Returns the exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        process = subprocess.Popen([sys.executable, script, *flags], cwd=REPO, env=env, stdout=out, stderr=err)
        try:
            return process.wait(timeout=timeout)
        finally:
            if process.poll() is None:
                process.kill()


RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def still_running(job: list[list]) -> list[str]:
    """The processes of `job` ([pid, create time] pairs) that have not exited, Ray's agents aside, as "pid name"."""
    alive = []
    for pid, created in job:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                if process.name() not in RAY_AGENTS:
                    alive.append(f"{pid} {process.name()}")
    return alive


def wait_for_exit(job: list[list], deadline: float) -> list[str]:
    """Wait until the processes of `job` have exited or `deadline` (time.monotonic) has passed; returns those left."""
    while still_running(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    return still_running(job)


@pytest.mark.slow
@pytest.mark.reliability(
    "kill -9 of the train_async.py driver of a fully async run (--save-interval 1) while rollout 2 trains, "
    "then the same command with --load",
    "the job's processes (Ray, trainer, engines, router) die with it; the resumed run regenerates the groups the "
    "checkpoint put back and trains every prompt of the data source order exactly once, as an uninterrupted run",
)
def test_kill_9_of_the_driver_and_load_train_every_prompt_once(tiny_model_dir, tmp_path):
    save_dir = tmp_path / "run"
    prompt_file = write_addition_prompts(tmp_path / "prompts.jsonl")
    run_flags = [*small_run_flags(tiny_model_dir, prompt_file, save_dir), "--num-rollout", "3"]
    flags = [
        *run_flags, "--rollout-function-path", FULLY_ASYNC, "--max-weight-staleness", "2", "--save-interval", "1",
        "--rollout-data-postprocess-path", "support.fault_injection.kill_driver_once_in_rollout_2",
    ]  # fmt: skip
    # The uninterrupted run, from the data source order: the first 6 prompt groups, each once (one batch in the
    # pipeline: every step trains the 2 groups drawn after the previous one).
    expected = RolloutDataSourceWithBuffer(parse_args(run_flags)).get_samples(6)
    status = run_to_files("train_async.py", *flags, log=tmp_path / "killed")
    assert status == -signal.SIGKILL, f"exit status {status}:\n{(tmp_path / 'killed.err').read_text()[-6000:]}"
    assert run_dir.committed_step(save_dir) == 1
    assert [row["rollout_id"] for row in rollout_rows(save_dir)] == [0, 1]
    # Engines, router, trainer, rollout manager, Ray's GCS and raylet: all gone with the driver (2 s here).
    job = json.loads((save_dir / "killed_job.json").read_text())
    left = wait_for_exit(job, time.monotonic() + 30)
    assert not left, f"left running 30 s after the driver was killed: {left}"
    interrupted = sorted({s.group_index for s in saved_samples(save_dir, 2)})  # drawn, never trained

    status = run_to_files("train_async.py", *flags, "--load", str(save_dir), log=tmp_path / "resumed")
    assert status == 0, f"the resumed run failed:\n{(tmp_path / 'resumed.err').read_text()[-6000:]}"
    rows = rollout_rows(save_dir)
    assert [row["rollout_id"] for row in rows] == [0, 1, 2]
    trained = {rollout_id: saved_samples(save_dir, rollout_id) for rollout_id in range(3)}
    samples = [s for rollout in trained.values() for s in rollout]
    assert sorted((s.group_index, s.prompt) for s in samples) == sorted(
        (s.group_index, s.prompt) for group in expected for s in group
    )
    assert len({s.index for s in samples}) == len(samples) == 12  # no sample trained twice
    # Rollout 2 was redone with the groups it had drawn, generated again under the resumed run's first weights
    # (which numbers its pushes from 1 again): none of the killed run's responses was trained.
    assert sorted({s.group_index for s in trained[2]}) == interrupted
    assert all(s.weight_versions == ["1"] for s in trained[2])
    # Within --max-weight-staleness 2; a one-batch pipeline is never more than one push behind.
    for rollout_id, trainer_version in ((0, 1), (1, 2), (2, 1)):
        assert all(trainer_version - min(map(int, s.weight_versions)) <= 1 for s in trained[rollout_id])
    assert all(row["rollout/staleness_max"] <= 1 for row in rows)
