"""Engines and trainer ranks that die mid-run: train.py end to end on CPU (real Ray, router, CPU engines)."""

from __future__ import annotations

import subprocess

import pytest
from support.runs import rollout_rows, run_driver_script, small_run_flags, write_addition_prompts


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_addition_prompts(tmp_path_factory.mktemp("ft_data") / "train.jsonl")


def run_train(model_dir, prompt_file, save_dir, *extra) -> subprocess.CompletedProcess:
    return run_driver_script("train.py", *small_run_flags(model_dir, prompt_file, save_dir), *extra)


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
