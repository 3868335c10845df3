"""The trackers as their users read them: wandb offline runs read back with wandb's own reader
(`wandb leet inspect --json`, which prints the records of a run's .wandb log), TensorBoard event files read
back with TensorBoard's `EventAccumulator`, both holding the same scalars as `metrics.jsonl`; the wandb
flags against their `WANDB_*` variables, resume into the same wandb run, the API key kept out of every file;
and the per-rollout log line's number format."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from support.trackers import (
    SECRET,
    assert_secret_in_no_file,
    assert_trackers_match_jsonl,
    jsonl_rows,
    of_type,
    tensorboard_scalars,
    wandb_history,
    wandb_records,
    wandb_run_dirs,
)

from slime.utils.arguments import parse_args
from slime.utils.tracking import WANDB_RUN_ID_FILE, Tracker, format_step_line, format_value


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    """No WANDB_* / TENSORBOARD_DIR or login of the caller's, a fresh wandb session (wandb reads the environment
    once per session), and the working directory in tmp_path (relative tracker folders land there)."""
    import wandb

    for name in list(os.environ):
        if name.startswith("WANDB_") or name == "TENSORBOARD_DIR":
            monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.chdir(tmp_path)
    wandb.teardown()
    yield
    wandb.teardown()


def make_args(model_dir, *extra: str, num_steps: int = 1):
    return parse_args(
        ["--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl", "--num-rollout", "4",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", str(4 // num_steps),
         *extra]
    )  # fmt: skip


def test_format_value_shows_small_numbers():
    cases = {
        1.2e-05: "1.2e-05",
        -0.0101: "-0.0101",
        0.41234: "0.4123",
        0.0001234: "0.0001234",
        41.25: "41.25",
        999.94: "999.9",
        1234.4: "1234",
        12345.6: "12346",
        0.0: "0",
        7: "7",
        float("nan"): "nan",
        float("-inf"): "-inf",
        np.float32(0.5): "0.5",
    }
    for value, text in cases.items():
        assert format_value(value) == text, value
    metrics = {"perf/step_time": 41.23, "train/kl_loss": 1.2e-05, "rollout/reward": 0.5, "eval/math": 0.35}
    line = "rollout 3 | reward 0.5 | kl 1.2e-05 | step_time 41.23s | eval_math 0.35"
    assert format_step_line(3, metrics) == line


@pytest.mark.slow
def test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows(tiny_model_dir, tmp_path, monkeypatch):
    wandb_dir, save = tmp_path / "wandb_files", tmp_path / "save"
    command_line = ["train.py", "--wandb-key", SECRET, f"--wandb-key={SECRET}"]
    monkeypatch.setattr(sys, "argv", command_line)  # wandb records the command line with the run
    args = make_args(
        tiny_model_dir, "--save", str(save), "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(wandb_dir),
        "--wandb-project", "proj", "--wandb-team", "team", "--wandb-group", "grp", "--wandb-key", SECRET,
        "--wandb-host", "http://127.0.0.1:9", "--use-tensorboard", "--tb-project-name", "tbproj",
        "--tb-experiment-name", "exp1",
    )  # fmt: skip
    tracker = Tracker(args)
    tracker.log(0, {"eval/toy": 0.25})  # eval before training, then the training metrics: one row
    tracker.log(0, {"rollout/reward": 0.5, "train/loss": -0.0101, "train/kl_loss": 1.2e-05, "perf/step_time": 1.5})
    tracker.log(1, {"rollout/reward": 0.1 + 0.2, "train/loss": 1 / 3, "train/kl_loss": 0.0, "eval/toy": 0.75})
    tracker.finish()
    assert sys.argv == command_line

    rows = jsonl_rows(save)
    assert rows == [
        {"rollout_id": 0, "eval/toy": 0.25, "rollout/reward": 0.5, "train/loss": -0.0101, "train/kl_loss": 1.2e-05,
         "perf/step_time": 1.5},
        {"rollout_id": 1, "rollout/reward": 0.1 + 0.2, "train/loss": 1 / 3, "train/kl_loss": 0.0, "eval/toy": 0.75},
    ]  # fmt: skip
    tb_dir = tmp_path / "tensorboard_log" / "tbproj" / "exp1"
    assert_trackers_match_jsonl(rows, wandb_dir, tb_dir)

    (run_dir,) = wandb_run_dirs(wandb_dir)
    records = wandb_records(run_dir)
    (run,) = of_type(records, "run")
    run_id = (save / WANDB_RUN_ID_FILE).read_text().strip()
    assert (run["run_id"], run["project"], run["entity"], run["run_group"]) == (run_id, "proj", "team", "grp")
    assert run["display_name"] == f"grp_{run_id}"
    config = run["config"]["update"]
    assert "wandb_key" not in config and config["wandb_project"] == "proj" and config["rollout_batch_size"] == 2
    (environment,) = [e for e in of_type(records, "environment") if "args" in e]
    assert environment["args"] == ["--wandb-key", "<redacted>", "--wandb-key=<redacted>"]
    x_axes = {m["name"]: m["step_metric"] for m in of_type(records, "metric") if "step_metric" in m}
    assert x_axes == {
        "eval/toy": "rollout/step", "rollout/reward": "rollout/step", "perf/step_time": "rollout/step",
        "train/loss": "train/step", "train/kl_loss": "train/step",
    }  # fmt: skip
    assert_secret_in_no_file(tmp_path)


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tiny_model_dir, tmp_path, monkeypatch):
    wandb_dir, save = tmp_path / "wandb_files", tmp_path / "save"
    flags = ("--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(wandb_dir), "--wandb-group", "grp")
    first = Tracker(make_args(tiny_model_dir, *flags, "--save", str(save)))
    first.log(0, {"rollout/reward": 0.5})
    first.finish()
    saved_id = (save / WANDB_RUN_ID_FILE).read_text().strip()

    resume = (*flags, "--save", str(save), "--load", str(save), "--wandb-always-use-train-step")
    resumed = Tracker(make_args(tiny_model_dir, *resume, num_steps=2), start_rollout_id=1)  # checkpoint: rollout 0
    resumed.log(1, {"rollout/reward": 0.75, "train/loss": 0.125})
    resumed.finish()
    first_dir, resumed_dir = wandb_run_dirs(wandb_dir)
    records = wandb_records(resumed_dir)
    (run,) = of_type(records, "run")
    assert (run["run_id"], run["resume"], run["display_name"]) == (saved_id, True, f"grp_{saved_id}")
    assert wandb_history(records) == {
        1: {"rollout/reward": 0.75, "train/loss": 0.125, "rollout/step": 1, "train/step": 2}
    }
    x_axes = {m["name"]: m["step_metric"] for m in of_type(records, "metric") if "step_metric" in m}
    assert x_axes == {"rollout/reward": "train/step", "train/loss": "train/step"}  # --wandb-always-use-train-step
    assert of_type(wandb_records(first_dir), "run")[0]["run_id"] == saved_id

    # No checkpoint loaded (start_rollout_id 0): a new wandb run. --wandb-run-id, then WANDB_RUN_ID, pick the run.
    restarted = Tracker(make_args(tiny_model_dir, *flags, "--load", str(save), "--disable-wandb-random-suffix"))
    assert restarted.wandb.id != saved_id and restarted.wandb.name == "grp"
    restarted.finish()
    monkeypatch.setenv("WANDB_RUN_ID", "fromenv1")
    chosen = Tracker(make_args(tiny_model_dir, *flags, "--load", str(save), "--wandb-run-id", "fromflag"), 1)
    assert chosen.wandb.id == "fromflag"
    chosen.finish()
    from_env = Tracker(make_args(tiny_model_dir, *flags, "--load", str(save)), 1)
    assert from_env.wandb.id == "fromenv1"
    from_env.finish()


@pytest.mark.slow
def test_tracker_flags_override_their_environment_variables(tiny_model_dir, tmp_path, monkeypatch):
    env_dir, flag_dir = tmp_path / "env_wandb", tmp_path / "flag_wandb"
    env_dir.mkdir()
    for name, value in {"WANDB_MODE": "disabled", "WANDB_PROJECT": "envproj", "WANDB_RUN_GROUP": "envgroup",
                        "WANDB_DIR": str(env_dir), "TENSORBOARD_DIR": str(tmp_path / "env_tb")}.items():  # fmt: skip
        monkeypatch.setenv(name, value)

    disabled = Tracker(make_args(tiny_model_dir, "--use-wandb"))  # WANDB_MODE=disabled: nothing written
    disabled.log(0, {"rollout/reward": 0.5})
    disabled.finish()
    assert wandb_run_dirs(env_dir) == []

    from_env = Tracker(make_args(tiny_model_dir, "--use-wandb", "--wandb-mode", "offline", "--use-tensorboard"))
    from_env.log(0, {"rollout/reward": 0.5})
    from_env.finish()
    (run,) = of_type(wandb_records(wandb_run_dirs(env_dir)[0]), "run")
    assert (run["project"], run["run_group"]) == ("envproj", "envgroup")
    assert tensorboard_scalars(tmp_path / "env_tb") == {"rollout/reward": {0: 0.5}}

    flags = ("--use-wandb", "--wandb-mode", "offline", "--wandb-project", "flagproj", "--wandb-dir", str(flag_dir))
    from_flags = Tracker(make_args(tiny_model_dir, *flags, "--use-tensorboard", "--tensorboard-dir", "flag_tb"))
    from_flags.log(0, {"rollout/reward": 0.5})
    from_flags.finish()
    (run,) = of_type(wandb_records(wandb_run_dirs(flag_dir)[0]), "run")
    assert run["project"] == "flagproj"
    assert tensorboard_scalars(tmp_path / "flag_tb") == {"rollout/reward": {0: 0.5}}


@pytest.mark.reliability(
    "--use-wandb online with no API key (no --wandb-key, WANDB_API_KEY or `wandb login`)",
    "the run stops before its first rollout, naming --wandb-key / WANDB_API_KEY and --wandb-mode offline",
)
def test_online_wandb_without_a_key_names_the_fix(tiny_model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="--wandb-key .*--wandb-mode offline"):
        Tracker(make_args(tiny_model_dir, "--use-wandb", "--wandb-mode", "online", "--wandb-dir", str(tmp_path)))
