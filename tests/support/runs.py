"""Shared pieces of the end-to-end tests: a prompt file and `train.py` / `train_async.py` run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from slime.utils.types import Sample
from support.ray_head import connect_session_cluster

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def write_addition_prompts(path: Path, operands: range = range(1, 5)) -> Path:
    """A JSONL file of "What is a + b?" prompts with their sums as labels."""
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a in operands for b in operands]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def small_run_flags(model_dir, prompt_file, save_dir: Path) -> list[str]:
    """Two prompts x two samples of 8 tokens per rollout, saved to `save_dir` with the rollouts dumped."""
    return [
        "--hf-checkpoint", str(model_dir),
        "--prompt-data", str(prompt_file), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rm-type", "last_number", "--rollout-shuffle",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--lr", "1e-3", "--save", str(save_dir),
        "--save-debug-rollout-data", str(save_dir / "rollouts" / "rollout_{rollout_id}.pt"),
    ]  # fmt: skip


def run_driver_script(
    script: str, *flags: str, timeout: float = 420, own_cluster: bool = False
) -> subprocess.CompletedProcess:
    """`python <script> <flags>` from the repository root, with tests/ importable for plugin paths.

    The driver joins this test process's session Ray cluster (`session_cluster_env`), as under `ray job submit`,
    unless the environment names a cluster already (RAY_ADDRESS) or `own_cluster` asks for the local cluster train.py
    starts when it is run alone (a test of what happens to Ray's own processes needs that)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    if not own_cluster and "RAY_ADDRESS" not in env:
        env |= session_cluster_env()
    command = [sys.executable, script, *flags]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def session_cluster_env() -> dict[str, str]:
    """The environment a driver run joins this test process's session Ray cluster with (`ray_cluster`, started here
    if it is not up), as a job joins a cluster under `ray job submit`. Each run still has its own job, actors and
    engines (a job's processes end with its driver); what it saves is Ray's start and stop per run (~5 s), and a
    second node per test process idling beside the session cluster (~2.4 CPU-s a minute, measured)."""
    import ray

    connect_session_cluster()
    # The mode the cluster started in (Ray sets it here as it starts one): in token mode a joining process reads the
    # cluster's token from Ray's default file, ~/.ray/auth_token.
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }


def rollout_rows(save_dir: Path) -> list[dict]:
    """The rows of `save_dir/metrics.jsonl` that describe a training rollout."""
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "rollout/reward" in row]


def run_training(
    script: str, save_dir: Path, *flags: str, timeout: float = 420, own_cluster: bool = False
) -> list[dict]:
    """`run_driver_script`, failing the test with the tails of its output unless it exits 0; returns the
    `rollout_rows` of `save_dir` (where `flags` save)."""
    result = run_driver_script(script, *flags, timeout=timeout, own_cluster=own_cluster)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return rollout_rows(save_dir)


def saved_samples(save_dir: Path, rollout_id: int) -> list[Sample]:
    """The samples of rollout `rollout_id` that `small_run_flags`' `--save-debug-rollout-data` wrote."""
    saved = torch.load(save_dir / "rollouts" / f"rollout_{rollout_id}.pt", weights_only=False)
    return [Sample.from_dict(d) for d in saved["samples"]]
