"""train.py and train_async.py end to end on CPU: real Ray, router, CPU engine and FSDP trainer.

Each run is a subprocess, exactly as a user starts it, with a tiny random model. Runs are few and carry many
checks: the disaggregated run (trackers, weight sync, perf figures, save and eval intervals) is resumed by a
colocated run (same prompts, offload and onload, weight sync after them), then PPO and the async driver.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import torch
from support.runs import REPO, rollout_rows, run_driver_script, saved_samples, small_run_flags, write_addition_prompts
from support.trackers import (
    SECRET,
    assert_secret_in_no_file,
    assert_trackers_match_jsonl,
    jsonl_rows,
    of_type,
    wandb_records,
    wandb_run_dirs,
)
from transformers import AutoConfig, AutoModelForCausalLM

from slime.utils.arguments import parse_args
from slime.utils.misc import load_function
from slime.utils.perf import STEP_PHASES, ModelShape, cpu_peak_tflops, forward_flops
from slime.utils.tracking import WANDB_RUN_ID_FILE, format_step_line

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_addition_prompts(tmp_path_factory.mktemp("e2e_data") / "train.jsonl")


def run_script(script: str, model_dir, prompt_file, save_dir, *extra, timeout=300) -> subprocess.CompletedProcess:
    result = run_driver_script(script, *small_run_flags(model_dir, prompt_file, save_dir), *extra, timeout=timeout)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def eval_keys(row: dict) -> set[str]:
    return {key for key in row if key.startswith("eval/")}


def parameter_bytes(model_dir) -> int:
    """Bytes of the model's parameters in float32, each shared (tied) tensor once, from a plain HF load."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum({p.data_ptr(): p.numel() * 4 for p in model.parameters()}.values())


# ---- run A: disaggregated, 3 rollouts, every tracker, a checkpoint every 2 rollouts, eval every 2 ---------------
@dataclass
class Run:
    root: Path
    save: Path
    history: list[dict]
    stderr: str


@pytest.fixture(scope="module")
def disaggregated_run(tiny_model_dir, prompt_file, tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("disaggregated")
    save = root / "save"
    result = run_script(
        "train.py", tiny_model_dir, prompt_file, save,
        "--num-rollout", "3", "--save-interval", "2", "--check-weight-update-equal",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
        # A tiny random model never answers right; a reward that differs within every group gives a gradient.
        "--custom-rm-path", "support.rewards.alternating_reward",
        "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(root / "wandb_files"), "--wandb-key", SECRET,
        "--use-tensorboard", "--tensorboard-dir", str(root / "tb"),
        "--eval-prompt-data", "toy", str(prompt_file), "--eval-interval", "2",
    )  # fmt: skip
    return Run(root, save, rollout_rows(save), result.stderr)


def test_disaggregated_run_trains_syncs_and_logs_to_every_tracker(disaggregated_run, tiny_model_dir):
    """Also the trackers' end-to-end test: wandb offline and TensorBoard hold the scalars of metrics.jsonl, and the
    wandb key given on the command line is in no file."""
    history, save, root = disaggregated_run.history, disaggregated_run.save, disaggregated_run.root
    assert [h["rollout_id"] for h in history] == [0, 1, 2]
    first = history[0]
    # Same weights on both sides before the first update: engine and trainer log-probs agree, KL to ref is 0.
    assert first["train/train_rollout_logprob_max_abs_diff"] <= TOLERANCE
    assert first["train/kl_loss"] == 0.0
    # After each update the engines serve the new weights: log-probs still agree with the trainer.
    assert all(row["train/train_rollout_logprob_max_abs_diff"] <= TOLERANCE for row in history[1:])
    assert history[1]["train/kl_loss"] != 0.0

    for row in history:  # the per-rollout log line shows exactly the recorded values
        # (row 0 also holds the evaluation before training, logged on a line of its own)
        step = {k: v for k, v in row.items() if row["rollout_id"] or k not in eval_keys(row)}
        assert format_step_line(row["rollout_id"], step) in disaggregated_run.stderr
    assert {"rollout/reward", "train/loss", "train/ppo_kl", "perf/step_time"} <= history[0].keys()
    assert not [row for row in history if "perf/offload_time" in row or "perf/actor_offload_freed_gb" in row]
    assert_perf_metrics_add_up(history, disaggregated_run.stderr, tiny_model_dir, save)
    # The driver draws the rollout manager's progress: one bar per rollout and eval set, none relayed by Ray.
    driver_lines = disaggregated_run.stderr.replace("\r", "\n").splitlines()
    assert any(line.startswith("rollout 1: 100%") and "2/2" in line for line in driver_lines)
    assert any(line.startswith("eval toy: 100%") and "16/16" in line for line in driver_lines)
    assert not [line for line in driver_lines if line.startswith("(RolloutManager") and "it/s]" in line]
    wandb_dir = root / "wandb_files"
    assert_trackers_match_jsonl(history, wandb_dir, root / "tb")
    (run,) = of_type(wandb_records(wandb_run_dirs(wandb_dir)[0]), "run")
    assert run["run_id"] == (save / WANDB_RUN_ID_FILE).read_text().strip()
    assert "wandb_key" not in run["config"]["update"]
    assert_secret_in_no_file(root)


def test_save_interval_and_eval_interval_pick_their_rollouts(disaggregated_run):
    save, history = disaggregated_run.save, disaggregated_run.history
    # --save-interval 2 over 3 rollouts: after rollout 1, and after the last one; never after rollout 0.
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # --eval-interval 2: before training (no --skip-eval-before-train; logged with rollout 0) and after rollout 1.
    assert [bool(eval_keys(row)) for row in history] == [True, True, False]
    assert {"eval/toy", "eval/toy/truncated"} <= eval_keys(history[0])


def assert_perf_metrics_add_up(history: list[dict], driver_log: str, model_dir, save) -> None:
    """The phases of every step add up to its step time (within 10%), which the log lines' clock confirms; the
    trainer's TFLOPs are the model's FLOPs over the saved rollout's tokens in the measured train time."""
    logged_at = [  # when the driver printed each step's line: "2026-12-01 16:50:01,123 INFO slime: rollout 1 | ..."
        datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        for line in driver_log.splitlines()
        if line[:1].isdigit() and "slime: rollout " in line and "step_time" in line
    ]
    assert len(logged_at) == len(history) == 3
    for row in history:
        phases = sum(row.get(f"perf/{phase}_time", 0.0) for phase in STEP_PHASES)
        assert {"perf/generate_time", "perf/train_time", "perf/update_weights_time"} <= row.keys()
        assert {"perf/reward_time", "perf/actor_train_time", "perf/ref_log_probs_time"} <= row.keys()
        assert 0.9 * row["perf/step_time"] <= phases <= row["perf/step_time"], row
        assert row["perf/actor_train_time"] < row["perf/train_time"]
        assert row["perf/actor_peak_memory_gb"] > 0.1 and row["perf/engine_peak_memory_gb"] > 0.1
    assert "perf/save_time" in history[1] and "perf/eval_time" in history[1]
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


# ---- run B: run A's checkpoint resumed colocated, rollouts 3-5 ----------------------------------------------------
@pytest.fixture(scope="module")
def resumed_run(disaggregated_run, tiny_model_dir, prompt_file, tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("resumed")
    save = root / "save"
    shutil.copytree(disaggregated_run.save, save)  # run A's own folder stays as its tests read it
    result = run_script(
        "train.py", tiny_model_dir, prompt_file, save, "--num-rollout", "6", "--load", str(save),
        "--colocate", "--offload-train", "--check-weight-update-equal",
        "--eval-prompt-data", "toy", str(prompt_file), "--eval-interval", "3", "--skip-eval-before-train",
    )  # fmt: skip
    return Run(root, save, rollout_rows(save), result.stderr)


def uninterrupted_prompts(model_dir, prompt_file, save_dir, num_rollout: int) -> list[list[str]]:
    """Each rollout's prompts (once per sample) as a data source that is never interrupted hands them out."""
    args = parse_args(small_run_flags(model_dir, prompt_file, save_dir) + ["--num-rollout", str(num_rollout)])
    data_source = load_function(args.data_source_path)(args)
    return [
        [sample.prompt for group in data_source.get_samples(args.rollout_batch_size) for sample in group]
        for _ in range(num_rollout)
    ]


def test_resume_continues_with_the_same_prompts_and_step(resumed_run, tiny_model_dir, prompt_file, tmp_path):
    assert [h["rollout_id"] for h in resumed_run.history] == [0, 1, 2, 3, 4, 5]  # run A's rows, then 3, 4, 5
    expected = uninterrupted_prompts(tiny_model_dir, prompt_file, tmp_path / "unused", 6)
    for rollout_id in range(6):
        prompts = [s.prompt for s in saved_samples(resumed_run.save, rollout_id)]
        assert sorted(prompts) == sorted(expected[rollout_id]), rollout_id
    assert expected[3] != expected[2]  # the check can tell rollouts apart


def test_colocated_run_offloads_onloads_and_syncs_right_weights(resumed_run, tiny_model_dir):
    weights_gb = parameter_bytes(tiny_model_dir) / 2**30
    for row in resumed_run.history[3:]:
        assert row["perf/offload_time"] > 0
        # The engine released its weights for training (it reports holding none) and got them all back.
        assert row["perf/engine_weight_memory_offloaded_gb"] == 0.0
        assert row["perf/engine_weight_memory_onloaded_gb"] == pytest.approx(weights_gb, rel=1e-9)
        # --offload-train: the trainer offloads after each step. FSDP drops its gradients at the optimizer step
        # already and on CPU has nothing to move off a device, so it reports 0 bytes (on GPU: weights, optimizer).
        assert row["perf/actor_offload_freed_gb"] == 0.0
        # Rollouts 4 and 5 were generated after offload, onload and a push: the engine serves the trainer's weights.
        assert row["train/train_rollout_logprob_max_abs_diff"] <= TOLERANCE


def test_skip_eval_before_train_leaves_out_the_first_evaluation(resumed_run):
    # --eval-interval 3 from rollout 3: only after rollout 5; the evaluation before training is skipped.
    assert [bool(eval_keys(row)) for row in resumed_run.history[3:]] == [False, False, True]
    assert not [row for row in jsonl_rows(resumed_run.save) if row["rollout_id"] == 3 and eval_keys(row)]


# ---- PPO: actor and critic, with examples/train_infer_mismatch_helper's mis.yaml ------------------------------
MIS_EXAMPLE = REPO / "examples" / "train_infer_mismatch_helper"


def test_ppo_run_trains_actor_and_critic_and_the_values_enter_the_advantages(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch
):
    """PPO without --colocate: an actor rank and a critic rank share each trainer bundle. The run also carries the
    train/inference-mismatch example (mis.yaml: mismatch metrics, MIS masks and TIS weights on the policy loss)."""
    monkeypatch.setenv("PYTHONPATH", str(MIS_EXAMPLE))  # where mis.yaml's mis.mis_function is found
    run_script(
        "train.py", tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "2", "--advantage-estimator", "ppo",
        "--custom-rm-path", "support.rewards.alternating_reward",
        "--rollout-data-postprocess-path", "support.rewards.save_trainer_data",
        "--custom-config-path", str(MIS_EXAMPLE / "mis.yaml"),
    )  # fmt: skip
    history = rollout_rows(tmp_path)
    assert [h["rollout_id"] for h in history] == [0, 1]
    assert all("train/pg_loss" in h and "critic/value_loss" in h for h in history)
    for rollout_id in (0, 1):
        data = torch.load(tmp_path / "trainer_data" / f"rollout_{rollout_id}.pt", weights_only=False)
        values = [torch.as_tensor(v, dtype=torch.float32) for v in data["values"]]
        if rollout_id == 1:  # the critic has trained a step: zeroed values would give other advantages
            assert any(v.abs().max() > 1e-3 for v in values)
        # gamma = lambda = 1 and no reward KL: every token's return is the reward, so A_t = reward - V_t.
        for advantages, value, reward in zip(data["advantages"], values, data["rewards"], strict=True):
            assert torch.allclose(torch.as_tensor(advantages), reward - value, atol=1e-5)

    keys = ["train_rollout_logprob_abs_diff", "train_rollout_logprob_max_abs_diff", "train_rollout_kl"]
    keys += ["mis_ratio_mean", "mis_masked_fraction", "mis_veto_fraction", "tis_clipfrac"]
    for row in history:
        mismatch = {key: row[f"train/{key}"] for key in keys}
        assert all(math.isfinite(v) for v in mismatch.values()), mismatch
        # The CPU engine and the trainer compute in fp32 from the same weights: a healthy, near-zero mismatch,
        # so MIS keeps every token and TIS leaves every weight near 1.
        assert mismatch["train_rollout_logprob_max_abs_diff"] <= TOLERANCE and 0 <= mismatch["train_rollout_kl"] <= 1e-8
        assert mismatch["mis_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert mismatch["mis_masked_fraction"] == mismatch["mis_veto_fraction"] == mismatch["tis_clipfrac"] == 0.0


# ---- train_async.py -------------------------------------------------------------------------------------------
def test_async_run_pushes_weights_every_second_rollout(tiny_model_dir, prompt_file, tmp_path):
    run_script(
        "train_async.py", tiny_model_dir, prompt_file, tmp_path, "--num-rollout", "4", "--save-interval", "4",
        "--update-weights-interval", "2",
    )  # fmt: skip
    history = rollout_rows(tmp_path)
    assert [h["rollout_id"] for h in history] == [0, 1, 2, 3]
    assert all("train/loss" in h for h in history)
    assert ["perf/update_weights_time" in h for h in history] == [False, True, False, True]
    # The one push that could reach a generation (after rollout 1) lands before rollout 3 is generated: rollout 2
    # was drawn one step ahead and waited for, so rollouts 0-2 share the starting weights and rollout 3 has new ones.
    versions = [{v for s in saved_samples(tmp_path, r) for v in s.weight_versions} for r in range(4)]
    assert len(versions[0]) == 1 and versions[0] == versions[1] == versions[2] != versions[3], versions
    assert len(versions[3]) == 1
    # The one-step-ahead draw must not leak into the saved data position: rollout 3 was the last drawn.
    saved = torch.load(tmp_path / "rollout" / "data_source_3.pt", weights_only=False)
    assert saved["sample_group_index"] == 8
