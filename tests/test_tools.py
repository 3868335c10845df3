"""Command-line tools on small inputs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from untrusted_payloads import MakesAFolderWhenUnpickled

from slime.utils.types import Sample, Status

REPO = Path(__file__).resolve().parent.parent


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


def test_plot_metrics_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"rollout_id": 0, "eval/addition": 0.2}] + [
        {"rollout_id": i, "rollout/reward": 0.1 * i, **({"eval/addition": 0.3} if i == 2 else {})} for i in range(3)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_tool("tools/plot_metrics.py", str(metrics))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_names_a_missing_file(tmp_path):
    result = run_tool("tools/plot_metrics.py", str(tmp_path / "nope.jsonl"))
    assert result.returncode != 0 and "nope.jsonl does not exist" in result.stderr


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
