"""Upstream slime's launcher helpers for test and recipe scripts, run on this machine:

    import slime.utils.external_utils.command_utils as U

    U.execute_train(train_args="--hf-checkpoint /models/Qwen3-0.6B --rm-type math ...", num_gpus_per_node=2,
                    megatron_model_type="qwen3-0.6B")

`execute_train` runs `python train.py ${MODEL_ARGS[@]} <train_args>` from the repository root, after
`source scripts/models/<megatron_model_type>.sh`, and raises when training fails. train.py starts a private Ray
cluster of its own (loopback only), or joins the one in RAY_ADDRESS, as `ray job submit` would have it do.

What upstream's version does and this one does not: kill every sglang / ray / slime process of the machine first
(other people's runs too), start a long-lived `ray start --head` and leave it running, point PYTHONPATH at a
Megatron-LM checkout (slime uses the megatron-core package), probe NVLink with nvidia-smi, and launch several nodes
from SLURM. For several nodes start Ray on each and `ray job submit -- python train.py ...` yourself.

Environment variables read, as upstream: SLIME_SCRIPT_EXTERNAL_RAY=1 (join the cluster in RAY_ADDRESS),
SLIME_SCRIPT_ENABLE_RAY_SUBMIT=0 (run `before_ray_job_submit` only, not training), MASTER_ADDR,
SLIME_TEST_ENABLE_INFINITE_RUN (read by `get_env_enable_infinite_run`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slime.utils.device import cuda_available

repo_base_dir = Path(__file__).resolve().parents[3]


def exec_command(cmd: str, capture_output: bool = False) -> str | None:
    """Run `cmd` with bash from the current directory; return its stdout when `capture_output`.

    Raises:
        subprocess.CalledProcessError: The command exited with a non-zero status.
    """
    print(f"exec_command: {cmd}", flush=True)
    result = subprocess.run(["bash", "-c", cmd], check=True, capture_output=capture_output, text=True)
    return result.stdout if capture_output else None


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """True when the variable (else `default`) is "1" or "true" (any case); any other value is False."""
    return os.environ.get(name, default).strip().lower() in ("1", "true")


def get_env_enable_infinite_run() -> bool:
    """SLIME_TEST_ENABLE_INFINITE_RUN: upstream's CI scripts then train for thousands of rollouts, not a few."""
    return get_bool_env_var("SLIME_TEST_ENABLE_INFINITE_RUN")


@dataclass
class ExecuteTrainConfig:
    """Launch options (upstream scripts extend it).

    Attributes:
        cuda_core_dump: Have CUDA write a core dump (in the temp folder) when a kernel raises; needs CUDA.
        num_nodes: Nodes of the run (upstream reads SLURM_JOB_NUM_NODES); only 1 can be launched from here.
        extra_env_vars: More environment variables for training, as JSON or `KEY=VALUE KEY2=VALUE2`.
    """

    cuda_core_dump: bool = False
    num_nodes: int = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    extra_env_vars: str = ""


def _parse_env_text(text: str) -> dict[str, str]:
    """`{"A": "1"}` or `A=1 B=2` as a dict; the empty string as none."""
    if not text.strip():
        return {}
    if text.lstrip().startswith("{"):
        return {str(k): str(v) for k, v in json.loads(text).items()}
    pairs = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"ExecuteTrainConfig.extra_env_vars: {item!r} is not KEY=VALUE (or pass a JSON object)")
        pairs[key] = value
    return pairs


def execute_train(
    train_args: str,
    num_gpus_per_node: int,
    megatron_model_type: str | None,
    train_script: str = "train.py",
    before_ray_job_submit: Callable[[], None] | None = None,
    extra_env_vars: dict[str, str] | None = None,
    config: ExecuteTrainConfig | None = None,
) -> None:
    """Run a training job on this machine and wait for it.

    Args:
        train_args: slime's flags as one shell string (quoted as in a shell).
        num_gpus_per_node: GPUs the job may use; with CUDA at most the visible ones (unused on the CPU).
        megatron_model_type: `scripts/models/<type>.sh`, whose MODEL_ARGS go before `train_args`; None for none
            (e.g. `--train-backend fsdp`).
        train_script: The driver, relative to the repository root (`train_async.py`, ...) or absolute.
        before_ray_job_submit: Called right before training starts.
        extra_env_vars: More environment variables for training.
        config: See `ExecuteTrainConfig`.

    Raises:
        ValueError: An input that cannot run here (the message names it and what to do).
        subprocess.CalledProcessError: Training exited with a non-zero status.
    """
    config = config or ExecuteTrainConfig()
    if config.num_nodes > 1:
        raise ValueError(
            f"execute_train launches one node, not {config.num_nodes} (SLURM_JOB_NUM_NODES / "
            "ExecuteTrainConfig.num_nodes): start Ray on every node and `ray job submit -- python train.py ...`"
        )
    if cuda_available() and num_gpus_per_node > torch.cuda.device_count():
        raise ValueError(
            f"num_gpus_per_node={num_gpus_per_node}, but this machine shows {torch.cuda.device_count()} CUDA devices"
        )
    script = Path(train_script) if Path(train_script).is_absolute() else repo_base_dir / train_script
    if not script.is_file():
        raise ValueError(f"train_script {train_script!r}: no such file ({script})")
    source_model = ""
    if megatron_model_type is not None:
        model_script = repo_base_dir / "scripts" / "models" / f"{megatron_model_type}.sh"
        if not model_script.is_file():
            known = sorted(p.stem for p in model_script.parent.glob("*.sh"))
            raise ValueError(f"megatron_model_type {megatron_model_type!r}: no {model_script}; known: {known}")
        source_model = f"source {shlex.quote(str(model_script))} && "
    if get_bool_env_var("SLIME_SCRIPT_EXTERNAL_RAY") and not os.environ.get("RAY_ADDRESS"):
        raise ValueError("SLIME_SCRIPT_EXTERNAL_RAY is set but RAY_ADDRESS is not: set it to the cluster to join")

    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    env = {
        **os.environ,
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron overlaps communication only with a single hardware queue
        "MASTER_ADDR": master_addr,
        "no_proxy": f"127.0.0.1,{master_addr}",
        "PYTHONUNBUFFERED": "1",
    }
    if config.cuda_core_dump:
        if not cuda_available():
            raise ValueError("ExecuteTrainConfig.cuda_core_dump needs CUDA; this machine has no CUDA device")
        env |= {
            "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
            "CUDA_COREDUMP_SHOW_PROGRESS": "1",
            "CUDA_COREDUMP_FILE": os.path.join(tempfile.gettempdir(), "cuda_coredump_%h.%p.%t"),
        }
    env |= {str(k): str(v) for k, v in (extra_env_vars or {}).items()}
    env |= _parse_env_text(config.extra_env_vars)

    if before_ray_job_submit is not None:
        before_ray_job_submit()
    if not get_bool_env_var("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "1"):
        return
    model_args = '"${MODEL_ARGS[@]}" ' if megatron_model_type is not None else ""
    command = f"{source_model}exec {shlex.quote(sys.executable)} {shlex.quote(str(script))} {model_args}{train_args}"
    print(f"execute_train: {command}", flush=True)
    subprocess.run(["bash", "-c", command], check=True, cwd=repo_base_dir, env=env)
