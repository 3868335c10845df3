"""Engines and trainer ranks that die mid-run: train.py end to end on CPU (real Ray, router, CPU engines)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from support.runs import rollout_rows, run_driver_script, small_run_flags, write_addition_prompts

from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils.arguments import parse_args
from slime.utils.types import Sample


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_addition_prompts(tmp_path_factory.mktemp("ft_data") / "train.jsonl")


def run_train(model_dir, prompt_file, save_dir, *extra) -> subprocess.CompletedProcess:
    return run_driver_script("train.py", *small_run_flags(model_dir, prompt_file, save_dir), *extra)


def rollout_samples(save_dir: Path, rollout_id: int) -> list[Sample]:
    saved = torch.load(save_dir / "rollouts" / f"rollout_{rollout_id}.pt", weights_only=True)
    return [Sample.from_dict(d) for d in saved["samples"]]


def still_alive(pid: int, created: float) -> bool:
    try:
        process = psutil.Process(pid)
        return process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.reliability(
    "SIGKILL of one of two engines after rollout 1 was generated, before the weight push, without "
    "--use-fault-tolerance",
    "the run stops; the last line of its output names the dead engine and --use-fault-tolerance (not a bare "
    "ConnectionError of /pause_generation)",
)
def test_killed_engine_without_fault_tolerance_stops_naming_it(tiny_model_dir, prompt_file, tmp_path):
    result = run_train(
        tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "3", "--rollout-num-gpus", "2",
        "--rollout-data-postprocess-path", "support.fault_injection.kill_an_engine_before_the_push_of_rollout_1",
    )  # fmt: skip
    assert result.returncode != 0
    line = last_line(result)
    assert line.startswith("slime: RuntimeError: updating the engines' weights: inference engine "), line
    assert "(http://127.0.0.1:" in line and "--use-fault-tolerance" in line and "--load" in line
    assert [row["rollout_id"] for row in rollout_rows(tmp_path)] == [0]


@pytest.mark.slow
@pytest.mark.reliability(
    "the training process of rank 0 exits in the middle of rollout 1, without --use-fault-tolerance",
    "the run stops naming training rank 0 and --load (what --use-fault-tolerance would do by itself)",
)
def test_dead_trainer_rank_is_named(tiny_model_dir, prompt_file, tmp_path):
    hook = ("--rollout-data-postprocess-path", "support.fault_injection.exit_trainer_once_in_rollout_1")
    result = run_train(tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "3", "--save-interval", "1", *hook)
    assert result.returncode != 0
    line = last_line(result)
    assert "training rank 0 of the actor" in line and f"--load {tmp_path}" in line, line
    assert [row["rollout_id"] for row in rollout_rows(tmp_path)] == [0]


@pytest.mark.slow
@pytest.mark.reliability(
    "the training process of rank 0 exits in rollout 1, then the rollout manager's process in rollout 2, with "
    "--use-fault-tolerance --save-interval 1",
    "the driver restarts the job from the last committed checkpoint each time (--max-restarts bounds it, the "
    "restart is logged) and the run finishes; every prompt of the data-source order is trained exactly once",
)
def test_dead_trainer_rank_restarts_the_job_from_its_checkpoint(tiny_model_dir, prompt_file, tmp_path):
    flags = [*small_run_flags(tiny_model_dir, prompt_file, tmp_path), "--num-rollout", "3", "--save-interval", "1"]
    result = run_driver_script(
        "train.py", *flags, "--use-fault-tolerance", "--max-restarts", "2",
        "--rollout-data-postprocess-path", "support.fault_injection.exit_trainer_once_in_rollout_1",
        "--custom-generate-function-path", "support.fault_injection.exit_rollout_manager_once_after_a_restart",
    )  # fmt: skip
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "restart 1 of --max-restarts 2" in result.stderr and "restart 2 of --max-restarts 2" in result.stderr
    assert "training rank 0 of the actor" in result.stderr and "ActorDiedError" in result.stderr
    assert [row["rollout_id"] for row in rollout_rows(tmp_path)] == [0, 1, 2]
    # The uninterrupted order: the data source of the same flags, fresh (a --save of its own: this one holds a run).
    fresh = [*small_run_flags(tiny_model_dir, prompt_file, tmp_path / "fresh"), "--num-rollout", "3"]
    expected = RolloutDataSourceWithBuffer(parse_args(fresh)).get_samples(6)
    trained = [s for rollout_id in range(3) for s in rollout_samples(tmp_path, rollout_id)]
    assert sorted((s.group_index, s.prompt) for s in trained) == sorted(
        (s.group_index, s.prompt) for group in expected for s in group
    )
