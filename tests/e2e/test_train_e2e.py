"""train.py and train_async.py end to end on CPU: real Ray, router, CPU engine and FSDP trainer.

Each run is a subprocess, exactly as a user starts it, with a tiny random model.
"""

from datetime import datetime

import pytest
import torch
from support.runs import rollout_rows, run_driver_script, saved_samples, small_run_flags, write_addition_prompts
from support.trackers import (
    SECRET,
    assert_secret_in_no_file,
    assert_trackers_match_jsonl,
    of_type,
    wandb_records,
    wandb_run_dirs,
)
from transformers import AutoConfig

from slime.utils.arguments import parse_args
from slime.utils.misc import load_function
from slime.utils.perf import STEP_PHASES, ModelShape, cpu_peak_tflops, forward_flops
from slime.utils.tracking import WANDB_RUN_ID_FILE, format_step_line
from slime.utils.types import Sample


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_addition_prompts(tmp_path_factory.mktemp("e2e_data") / "train.jsonl")


def run_script(script: str, model_dir, prompt_file, save_dir, *extra, timeout=300, output: list | None = None):
    result = run_driver_script(script, *small_run_flags(model_dir, prompt_file, save_dir), *extra, timeout=timeout)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    if output is not None:
        output.append(result)
    return rollout_rows(save_dir)


def rollout_prompts(save_dir, rollout_id):
    saved = torch.load(save_dir / "rollouts" / f"rollout_{rollout_id}.pt", weights_only=False)
    return [Sample.from_dict(d).prompt for d in saved["samples"]]


def test_disaggregated_run_trains_syncs_and_logs_to_every_tracker(tiny_model_dir, prompt_file, tmp_path):
    """Also the trackers' end-to-end test (one run fewer in the suite): wandb offline and TensorBoard hold the
    scalars of metrics.jsonl, and the wandb key given on the command line is in no file."""
    save, wandb_dir, tb_dir = tmp_path / "save", tmp_path / "wandb_files", tmp_path / "tb"
    output = []
    history = run_script(
        "train.py", tiny_model_dir, prompt_file, save,
        "--num-rollout", "2", "--save-interval", "1", "--check-weight-update-equal",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
        # A tiny random model never answers right; a reward that differs within every group gives a gradient.
        "--custom-rm-path", "support.rewards.alternating_reward",
        "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(wandb_dir), "--wandb-key", SECRET,
        "--use-tensorboard", "--tensorboard-dir", str(tb_dir),
        "--eval-prompt-data", "toy", str(prompt_file), "--eval-interval", "1", "--skip-eval-before-train",
        output=output,
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1]
    first = history[0]
    # Same weights on both sides before the first update: engine and trainer log-probs agree, KL to ref is 0.
    assert first["train/train_rollout_logprob_max_abs_diff"] <= 1e-4
    assert first["train/kl_loss"] == 0.0
    # After one update the engines serve the new weights: log-probs still agree with the trainer.
    assert history[1]["train/train_rollout_logprob_max_abs_diff"] <= 1e-4
    assert history[1]["train/kl_loss"] != 0.0
    tracker = (save / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == "1"

    for row in history:  # the per-rollout log line shows exactly the recorded values
        assert format_step_line(row["rollout_id"], row) in output[0].stderr
    assert {"rollout/reward", "train/loss", "train/ppo_kl", "perf/step_time"} <= history[0].keys()
    assert_perf_metrics_add_up(history, output[0].stderr, tiny_model_dir, save)
    # The driver draws the rollout manager's progress: one bar per rollout and eval set, none relayed by Ray.
    driver_lines = output[0].stderr.replace("\r", "\n").splitlines()
    assert any(line.startswith("rollout 1: 100%") and "2/2" in line for line in driver_lines)
    assert any(line.startswith("eval toy: 100%") and "16/16" in line for line in driver_lines)
    assert not [line for line in driver_lines if line.startswith("(RolloutManager") and "it/s]" in line]
    assert_trackers_match_jsonl(history, wandb_dir, tb_dir)
    (run,) = of_type(wandb_records(wandb_run_dirs(wandb_dir)[0]), "run")
    assert run["run_id"] == (save / WANDB_RUN_ID_FILE).read_text().strip()
    assert "wandb_key" not in run["config"]["update"]
    assert_secret_in_no_file(tmp_path)


def assert_perf_metrics_add_up(history: list[dict], driver_log: str, model_dir, save) -> None:
    """The phases of every step add up to its step time (within 10%), which the log lines' clock confirms; the
    trainer's TFLOPs are the model's FLOPs over the saved rollout's tokens in the measured train time."""
    logged_at = [  # when the driver printed each step's line: "2026-12-01 16:50:01,123 INFO slime: rollout 1 | ..."
        datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        for line in driver_log.splitlines()
        if line[:1].isdigit() and "slime: rollout " in line and "step_time" in line
    ]
    assert len(logged_at) == len(history) == 2
    for row in history:
        phases = sum(row.get(f"perf/{phase}_time", 0.0) for phase in STEP_PHASES)
        assert {"perf/generate_time", "perf/train_time", "perf/save_time", "perf/update_weights_time"} <= row.keys()
        assert {"perf/eval_time", "perf/reward_time", "perf/actor_train_time", "perf/ref_log_probs_time"} <= row.keys()
        assert 0.9 * row["perf/step_time"] <= phases <= row["perf/step_time"], row
        assert row["perf/actor_train_time"] < row["perf/train_time"]
        assert row["perf/actor_peak_memory_gb"] > 0.1 and row["perf/engine_peak_memory_gb"] > 0.1
    # The driver's step clock against the log's: step 1 fits between the two lines, and only the logging of row 0
    # (jsonl, wandb, TensorBoard) lies outside both steps.
    between_lines = (logged_at[1] - logged_at[0]).total_seconds()
    assert 0 <= between_lines - history[1]["perf/step_time"] < 0.5

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    for row in history:
        # One sample per micro-batch (--micro-batch-size 1): each is a sequence, its logits only where it responds.
        samples = saved_samples(save, row["rollout_id"])
        flops = forward_flops(shape, [len(s.tokens) for s in samples], sum(s.response_length for s in samples))
        expected = 3 * flops / row["perf/actor_train_time"] / 1e12  # one trainer rank
        assert row["perf/actor_train_tflops"] == pytest.approx(expected, rel=1e-3)
        peak = row["perf/actor_train_tflops"] / row["perf/actor_train_mfu"]
        assert any(peak == pytest.approx(cpu_peak_tflops(threads), rel=1e-6) for threads in (1, 2))


def uninterrupted_prompts(model_dir, prompt_file, save_dir, num_rollout: int) -> list[list[str]]:
    """Each rollout's prompts (once per sample) as a data source that is never interrupted hands them out."""
    args = parse_args(small_run_flags(model_dir, prompt_file, save_dir) + ["--num-rollout", str(num_rollout)])
    data_source = load_function(args.data_source_path)(args)
    return [
        [sample.prompt for group in data_source.get_samples(args.rollout_batch_size) for sample in group]
        for _ in range(num_rollout)
    ]


def test_resume_continues_with_the_same_prompts_and_step(tiny_model_dir, prompt_file, tmp_path):
    interrupted = tmp_path / "interrupted"
    run_script("train.py", tiny_model_dir, prompt_file, interrupted, "--num-rollout", "2", "--save-interval", "1")
    resumed = run_script(
        "train.py", tiny_model_dir, prompt_file, interrupted, "--num-rollout", "3", "--load", str(interrupted)
    )
    assert [h["rollout_id"] for h in resumed][-1] == 2
    expected = uninterrupted_prompts(tiny_model_dir, prompt_file, tmp_path / "unused", 3)
    for rollout_id in range(3):
        assert sorted(rollout_prompts(interrupted, rollout_id)) == sorted(expected[rollout_id]), rollout_id
    assert expected[2] != expected[1]  # the check can tell rollouts apart


def test_colocated_run_offloads_and_trains(tiny_model_dir, prompt_file, tmp_path):
    history = run_script("train.py", tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "2", "--colocate")
    assert [h["rollout_id"] for h in history] == [0, 1]
    assert all("train/loss" in h for h in history)


def test_async_run_three_rollouts(tiny_model_dir, prompt_file, tmp_path):
    history = run_script(
        "train_async.py", tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "3", "--save-interval", "3"
    )
    assert [h["rollout_id"] for h in history] == [0, 1, 2]
    assert all("train/loss" in h for h in history)
    # The one-step-ahead draw must not leak into the saved data position: rollout 2 was the last drawn.
    saved = torch.load(tmp_path / "rollout" / "data_source_2.pt", weights_only=False)
    assert saved["sample_group_index"] == 6


def test_async_refuses_colocate(tiny_model_dir, prompt_file, tmp_path):
    with pytest.raises(AssertionError, match="cannot share devices"):
        run_script("train_async.py", tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "1", "--colocate")


def test_ppo_run_trains_actor_and_critic(tiny_model_dir, prompt_file, tmp_path):
    """PPO without --colocate: an actor rank and a critic rank share each trainer bundle."""
    history = run_script(
        "train.py", tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "2", "--advantage-estimator", "ppo",
        "--custom-rm-path", "support.rewards.alternating_reward",
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1]
    assert all("train/pg_loss" in h and "critic/value_loss" in h for h in history)
