"""Reading what the trackers wrote: wandb's offline records, TensorBoard's events, metrics.jsonl; the API-key check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SECRET = "slimetestkey" + "0" * 28  # a 40-character API key that must appear in no file


WANDB_OWN_KEYS = {"_runtime", "_step", "_timestamp"}


AXES = {"rollout/step", "train/step"}


def wandb_run_dirs(wandb_dir: Path) -> list[Path]:
    """The run folders wandb wrote under `--wandb-dir`, oldest first."""
    return sorted((wandb_dir / "wandb").glob("*run-*"))


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of the run's .wandb log, as wandb's own reader prints them."""
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [record[kind] for record in records if record["type"] == kind]


def wandb_history(records: list[dict]) -> dict[int, dict]:
    """step -> the logged row, without wandb's own _runtime / _step / _timestamp."""
    rows = {}
    for row in of_type(records, "history"):
        rows[row["step"]["num"]] = {k: v for k, v in row["item"].items() if k not in WANDB_OWN_KEYS}
    return rows


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, read back with TensorBoard's event-file reader."""
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def jsonl_rows(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def assert_trackers_match_jsonl(rows: list[dict], wandb_dir: Path, tb_dir: Path, steps_per_rollout: int = 1) -> None:
    """wandb and TensorBoard hold each row of metrics.jsonl: the same keys and values at step rollout_id
    (TensorBoard stores float32)."""
    (run_dir,) = wandb_run_dirs(wandb_dir)
    history = wandb_history(wandb_records(run_dir))
    scalars = tensorboard_scalars(tb_dir)
    keys = set()
    for row in rows:
        row = dict(row)
        rollout_id = row.pop("rollout_id")
        keys |= row.keys()
        axes = {"rollout/step": rollout_id, "train/step": rollout_id * steps_per_rollout}
        assert history[rollout_id] == {**row, **axes}
        for key, value in row.items():
            assert scalars[key][rollout_id] == float(np.float32(value)), key
    assert sorted(history) == [row["rollout_id"] for row in rows]
    assert set(scalars) == keys
    assert all(sorted(steps) == [row["rollout_id"] for row in rows if key in row] for key, steps in scalars.items())


def assert_secret_in_no_file(*roots: Path) -> None:
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), f"the API key is in {path}"
