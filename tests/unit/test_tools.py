"""Command-line tools on small inputs."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
from support.untrusted_payloads import MakesAFolderWhenUnpickled

from slime.utils.perf import STEP_PHASES
from slime.utils.types import Sample, Status

REPO = Path(__file__).resolve().parents[2]


def run_tool(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_make_addition_dataset_has_disjoint_train_and_eval(tmp_path):
    result = run_tool(
        "tools/make_addition_dataset.py", "--output-dir", str(tmp_path), "--num-train", "50", "--num-eval", "20"
    )
    assert result.returncode == 0, result.stderr
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 50 and len(held_out) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        a, b = (int(x) for x in row["prompt"].split("?")[0].removeprefix("What is ").split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["label"] == str(a + b)


@pytest.fixture(scope="module")
def plot_metrics():
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "tools" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def png_shape(plot_metrics, grid_rows, columns):
    width, height = plot_metrics.PANEL_INCHES
    return (round(grid_rows * height * plot_metrics.DPI), round(columns * width * plot_metrics.DPI), 4)


def test_plot_metrics_draws_every_panel_of_a_full_run(tmp_path, plot_metrics):
    rows = []
    for i in range(4):
        row = {"rollout_id": i, "rollout/reward": 0.1 * i, "train/kl_loss": 1e-3 * i, "train/ppo_kl": 1e-4 * i,
               "train/entropy_loss": 1.0 - 0.1 * i, "train/pg_clipfrac": 0.02 * i, "rollout/response_length": 30 + i,
               "rollout/truncated": 0.1, "rollout/pass@1": 0.1 * i, "rollout/pass@2": 0.15 * i,
               "perf/step_time": 10.0, "perf/generate_time": 4.0, "perf/train_time": 3.0}  # fmt: skip
        if i in (0, 3):
            for name in ("addition", "gsm"):
                row |= {f"eval/{name}": 0.2 * i, f"eval/{name}/truncated": 0.0, f"eval/{name}/response_length": 28}
                row |= {f"eval/{name}/pass@{k}": 0.2 * i + 0.05 * k for k in (1, 2, 4)}
        rows.append(row)
    write_rows(tmp_path / "metrics.jsonl", rows)
    output = tmp_path / "plots" / "curves.png"
    titles = plot_metrics.plot(plot_metrics.load_history(tmp_path / "metrics.jsonl"), output)
    assert titles == ["training reward", "held-out accuracy", "pass@k", "KL", "entropy", "response length",
                      "truncated", "clip fraction", "step time"]  # fmt: skip
    image = matplotlib.image.imread(output)
    assert image.shape == png_shape(plot_metrics, 3, 3) and image.std() > 0


def test_plot_metrics_draws_only_the_panels_a_run_logged(tmp_path, plot_metrics):
    write_rows(tmp_path / "metrics.jsonl", [{"rollout_id": i, "rollout/reward": 0.1 * i} for i in range(3)])
    result = run_tool("tools/plot_metrics.py", str(tmp_path / "metrics.jsonl"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"saved {tmp_path / 'curves.png'}: training reward"  # default: beside the file
    assert matplotlib.image.imread(tmp_path / "curves.png").shape == png_shape(plot_metrics, 1, 1)

    # No PPO (no clip fraction), no eval, no timings: those panels are left out, not drawn empty.
    rows = [
        {"rollout_id": i, "rollout/reward": 0.5, "train/kl_loss": 0.01, "train/entropy_loss": 1.2} for i in range(3)
    ]
    titles = plot_metrics.plot(rows, tmp_path / "no_ppo.png")
    assert titles == ["training reward", "KL", "entropy"]
    assert matplotlib.image.imread(tmp_path / "no_ppo.png").shape == png_shape(plot_metrics, 1, 3)


def test_plot_metrics_step_time_other_is_what_the_phases_leave(plot_metrics):
    rows = [
        {"rollout_id": 0, "perf/step_time": 10.0, "perf/generate_time": 4.0, "perf/train_time": 3.0},
        {"rollout_id": 1, "perf/step_time": 9.0, "perf/generate_time": 5.0, "perf/eval_time": 1.5,
         "perf/update_weights_time": 0.5},
        {"rollout_id": 1, "perf/step_time": 8.0, "perf/generate_time": 2.0, "perf/train_wait_time": 1.0},  # resumed
        {"rollout_id": 2, "rollout/reward": 1.0},  # no timings: no bar
        {"rollout_id": 3, "perf/step_time": 6.0, "perf/generate_time": 4.0, "perf/train_time": 2.0001},  # rounding
        {"rollout_id": 4, "perf/step_time": 5.0},  # no phases: all of it is "other"
    ]  # fmt: skip
    breakdown = plot_metrics.step_time_breakdown(plot_metrics.latest_rows(rows))
    assert breakdown["other"] == pytest.approx([10.0 - 4.0 - 3.0, 8.0 - 2.0 - 1.0, 0.0, 5.0])
    assert breakdown["generate"] == [4.0, 2.0, 4.0, 0.0] and breakdown["train_wait"] == [0.0, 1.0, 0.0, 0.0]
    assert breakdown["eval"] == [0.0, 0.0, 0.0, 0.0]  # the first row of rollout 1 was replaced by the resumed one
    assert set(breakdown) == {*STEP_PHASES, "other"}


def test_plot_metrics_latest_row_of_a_rollout_wins(plot_metrics):
    rows = [{"rollout_id": 1, "rollout/reward": 0.1}, {"rollout_id": 0, "a": 1}, {"rollout_id": 1, "b": 2}]
    assert plot_metrics.latest_rows(rows) == [{"rollout_id": 0, "a": 1}, {"rollout_id": 1, "b": 2}]


@pytest.mark.reliability("plot_metrics.py on a metrics file that does not exist", "exits naming the file")
def test_plot_metrics_names_a_missing_file(tmp_path):
    result = run_tool("tools/plot_metrics.py", str(tmp_path / "nope.jsonl"))
    assert result.returncode != 0 and "nope.jsonl does not exist" in result.stderr


@pytest.mark.reliability(
    "plot_metrics.py on a metrics.jsonl with a cut-short line or a line that is not a row",
    "exits naming the file and line number",
)
def test_plot_metrics_names_a_malformed_line(tmp_path, plot_metrics):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"rollout_id": 0, "rollout/reward": 0.5}\n\n{"rollout_id": 1, "rollout/rew\n')
    result = run_tool("tools/plot_metrics.py", str(metrics))
    assert result.returncode != 0 and f"{metrics} line 3 is not JSON" in result.stderr
    assert not (tmp_path / "curves.png").exists()
    for line in ("[1, 2]", '{"rollout/reward": 0.5}', '{"rollout_id": "3"}'):
        metrics.write_text('{"rollout_id": 0}\n' + line + "\n")
        with pytest.raises(SystemExit, match=f"{re.escape(str(metrics))} line 2 is not a metrics row"):
            plot_metrics.load_history(metrics)


@pytest.mark.reliability(
    "plot_metrics.py on an empty metrics.jsonl, or one whose rows hold no metric it draws",
    "exits naming the file and what it lacks",
)
def test_plot_metrics_names_a_file_with_nothing_to_draw(tmp_path, plot_metrics):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n")
    with pytest.raises(SystemExit, match=f"{re.escape(str(metrics))} holds no JSON rows"):
        plot_metrics.load_history(metrics)
    write_rows(metrics, [{"rollout_id": 0, "perf/rollout_tokens": 12}])
    result = run_tool("tools/plot_metrics.py", str(metrics))
    assert result.returncode != 0 and f"{metrics}: no metric to plot" in result.stderr


def test_display_rollout_data_summarizes(tmp_path):
    samples = [
        Sample(index=i, group_index=i // 2, prompt="p", response="r", response_length=3, reward=float(i % 2),
               status=Status.COMPLETED if i else Status.TRUNCATED).to_dict()
        for i in range(4)
    ]  # fmt: skip
    torch.save({"rollout_id": 7, "samples": samples}, tmp_path / "rollout_7.pt")
    result = run_tool("tools/display_rollout_data.py", str(tmp_path / "rollout_7.pt"), "--num", "1")
    assert result.returncode == 0, result.stderr
    assert "rollout 7: 4 samples in 2 groups | reward mean 0.500" in result.stdout
    assert "'truncated': 1" in result.stdout and "'completed': 3" in result.stdout


@pytest.mark.reliability(
    "display_rollout_data.py on a file whose unpickling would run code",
    "refused (weights_only=True) with the type it holds; no code runs",
)
def test_display_rollout_data_never_runs_code_from_the_file(tmp_path):
    ran = tmp_path / "code_ran"
    torch.save({"rollout_id": 0, "samples": [MakesAFolderWhenUnpickled(str(ran))]}, tmp_path / "rollout_0.pt")
    result = run_tool("tools/display_rollout_data.py", str(tmp_path / "rollout_0.pt"))
    assert result.returncode != 0 and "rollout_0.pt holds a" in result.stderr and "makedirs" in result.stderr
    assert not ran.exists()
