"""train.py and train_async.py end to end on CPU: real Ray, router, CPU engine and FSDP trainer.

Each run is a subprocess, exactly as a user starts it, with a tiny random model.
"""

import pytest
import torch
from e2e_runs import rollout_rows, run_driver_script, small_run_flags, write_addition_prompts

from slime.utils.types import Sample


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_addition_prompts(tmp_path_factory.mktemp("e2e_data") / "train.jsonl")


def run_script(script: str, model_dir, prompt_file, save_dir, *extra, timeout=300):
    result = run_driver_script(script, *small_run_flags(model_dir, prompt_file, save_dir), *extra, timeout=timeout)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return rollout_rows(save_dir)


def rollout_prompts(save_dir, rollout_id):
    saved = torch.load(save_dir / "rollouts" / f"rollout_{rollout_id}.pt", weights_only=False)
    return [Sample.from_dict(d).prompt for d in saved["samples"]]


def test_disaggregated_run_trains_and_syncs(tiny_model_dir, prompt_file, tmp_path):
    history = run_script(
        "train.py", tiny_model_dir, prompt_file, tmp_path,
        "--num-rollout", "2", "--save-interval", "1", "--check-weight-update-equal",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
        # A tiny random model never answers right; a reward that differs within every group gives a gradient.
        "--custom-rm-path", "e2e_rewards.alternating_reward",
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1]
    first = history[0]
    # Same weights on both sides before the first update: engine and trainer log-probs agree, KL to ref is 0.
    assert first["train/train_rollout_logprob_max_abs_diff"] <= 1e-4
    assert first["train/kl_loss"] == 0.0
    # After one update the engines serve the new weights: log-probs still agree with the trainer.
    assert history[1]["train/train_rollout_logprob_max_abs_diff"] <= 1e-4
    assert history[1]["train/kl_loss"] != 0.0
    tracker = (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == "1"


def test_resume_continues_with_the_same_prompts_and_step(tiny_model_dir, prompt_file, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_script("train.py", tiny_model_dir, prompt_file, straight, "--num-rollout", "3")
    run_script("train.py", tiny_model_dir, prompt_file, interrupted, "--num-rollout", "2", "--save-interval", "1")
    resumed = run_script(
        "train.py", tiny_model_dir, prompt_file, interrupted, "--num-rollout", "3", "--load", str(interrupted)
    )
    assert [h["rollout_id"] for h in resumed][-1] == 2
    assert rollout_prompts(interrupted, 2) == rollout_prompts(straight, 2)
    assert rollout_prompts(interrupted, 1) == rollout_prompts(straight, 1)


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
        "--custom-rm-path", "e2e_rewards.alternating_reward",
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1]
    assert all("train/pg_loss" in h and "critic/value_loss" in h for h in history)
