"""Shared pieces of the end-to-end tests: a prompt file and `train.py` / `train_async.py` run as a user runs them."""

from __future__ import annotations

import atexit
import functools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from slime.utils.types import Sample
from support.ray_head import loopback_env, start_head, stop_tree, with_test_interpreter

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

    The driver joins this test process's shared Ray node (`shared_ray_node`), as under `ray job submit`, unless the
    environment names a cluster already (RAY_ADDRESS) or `own_cluster` asks for the local cluster train.py starts
    when it is run alone (a test of what happens to Ray's own processes needs that)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    if not own_cluster and "RAY_ADDRESS" not in env:
        env |= shared_ray_node()
    command = [sys.executable, script, *flags]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@functools.cache
def shared_ray_node() -> dict[str, str]:
    """One `ray start --head` node on 127.0.0.1 for the driver runs of this test process, with a token of its own
    (RAY_AUTH_TOKEN, in no file); returns the environment a driver joins it with. Each run still has its own job,
    actors and engines (a job's processes end with its driver); what it saves is Ray's start and stop per run
    (~5 s). Stopped by process id when the test process exits."""
    env = loopback_env() | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # No dashboard (its processes idle at ~0.1 core, the whole session) and no prestarted workers (started with the
    # node's environment, they never serve a job, whose workers get the job's runtime env).
    env |= {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}
    log = Path(tempfile.mkdtemp(prefix="slime-test-ray-")) / "ray_start.log"
    process, ports = start_head(16, env, log, "--include-dashboard", "false")
    atexit.register(stop_tree, process)
    address = f"127.0.0.1:{ports['--port']}"
    deadline = time.monotonic() + 120
    status = ["ray", "status", "--address", address]
    while subprocess.run(status, env=with_test_interpreter(env), capture_output=True).returncode != 0:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the shared Ray node did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    keys = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
    return {key: env[key] for key in keys} | {"RAY_ADDRESS": address}


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
