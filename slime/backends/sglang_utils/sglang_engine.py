"""Command lines for the two engine servers: `python -m sglang.launch_server` (GPU) and
`python -m slime.backends.cpu_engine` (CPU). Both serve SGLang's HTTP API, so nothing else differs.

`--sglang-<flag> value` on slime's command line lands in `args.sglang_server_args` as {"<flag>": value}
and is forwarded to every SGLang server as `--<flag> value`. The fields that depend on where an engine
is placed (model path, ports, GPUs, nodes) are slime's to set; passing one of them raises.
"""

from __future__ import annotations

import json
import logging
from argparse import Namespace
from typing import Any

logger = logging.getLogger(__name__)

# SGLang ServerArgs fields slime sets per engine, with the slime flag a user should use instead.
MANAGED_SGLANG_FIELDS = {
    "model_path": "--hf-checkpoint",
    "tp_size": "--rollout-num-gpus-per-engine",
    "port": "nothing (slime picks a free port per engine)",
    "host": "nothing (engines bind to their node's address)",
    "base_gpu_id": "nothing (slime places engines on the GPUs Ray assigns)",
    "nccl_port": "nothing (slime picks a free port per engine)",
    "dist_init_addr": "nothing (slime sets it for multi-node engines)",
    "nnodes": "--rollout-num-gpus-per-engine (an engine spans nodes when it exceeds --num-gpus-per-node)",
    "node_rank": "nothing (slime sets it for multi-node engines)",
    "enable_memory_saver": "--offload-rollout",
}


def options_to_cli_args(options: dict[str, Any]) -> list[str]:
    """Turn {"field_name": value} into ["--field-name", "value", ...] for an argparse-based CLI.

    Args:
        options: Field names (underscores or dashes) to values. True becomes a bare flag; False and None
            are left out; lists become several values after one flag; dicts are passed as JSON.

    Returns:
        The argument list, in the order of `options`.
    """
    cli_args = []
    for field, value in options.items():
        flag = "--" + field.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            cli_args.append(flag)
        elif isinstance(value, list | tuple):
            cli_args += [flag, *(str(item) for item in value)]
        elif isinstance(value, dict):
            cli_args += [flag, json.dumps(value)]
        else:
            cli_args += [flag, str(value)]
    return cli_args


def build_sglang_server_args(
    args: Namespace,
    *,
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    base_gpu_id: int,
    nccl_port: int,
    dist_init_addr: str | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
) -> list[str]:
    """Arguments for `python -m sglang.launch_server` for one engine.

    Args:
        args: slime's parsed arguments; reads `sglang_server_args` (dict of user `--sglang-*` flags) and
            `offload_rollout` (adds `--enable-memory-saver` so weights and KV cache can be released).
        model_path: HF checkpoint directory the engine loads.
        host: Address the HTTP server binds.
        port: HTTP port.
        tp_size: Tensor-parallel size (GPUs per engine).
        base_gpu_id: First GPU index this engine uses on its node.
        nccl_port: Port for the engine's internal NCCL group.
        dist_init_addr: "ip:port" of node 0 when the engine spans several nodes.
        nnodes: Number of nodes the engine spans.
        node_rank: This node's rank within the engine.

    Returns:
        The argument list (without the `python -m sglang.launch_server` prefix).

    Raises:
        ValueError: A `--sglang-*` flag tries to set a field slime manages.
    """
    user_options = _normalized_options(getattr(args, "sglang_server_args", None) or {})
    managed = sorted(set(user_options) & set(MANAGED_SGLANG_FIELDS))
    if managed:
        hints = "; ".join(f"--sglang-{f.replace('_', '-')}: use {MANAGED_SGLANG_FIELDS[f]}" for f in managed)
        raise ValueError(f"slime sets these SGLang server fields itself, remove them from the command line: {hints}")

    slime_options = {
        "model_path": model_path,
        "host": host,
        "port": port,
        "tp_size": tp_size,
        "base_gpu_id": base_gpu_id,
        "nccl_port": nccl_port,
        "dist_init_addr": dist_init_addr,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "enable_memory_saver": bool(getattr(args, "offload_rollout", False)),
    }
    return options_to_cli_args(slime_options) + options_to_cli_args(user_options)


def build_cpu_engine_args(args: Namespace, *, model_path: str, host: str, port: int) -> list[str]:
    """Arguments for `python -m slime.backends.cpu_engine` for one engine.

    Args:
        args: slime's parsed arguments; reads `cpu_engine_max_running_requests` (default 32) and
            `cpu_engine_num_threads` (torch threads of the engine process, default 1). `--sglang-*`
            flags mean nothing to the CPU engine and are ignored with a warning.
        model_path: HF checkpoint directory the engine loads.
        host: Address the HTTP server binds.
        port: HTTP port.

    Returns:
        The argument list (without the `python -m slime.backends.cpu_engine` prefix).
    """
    ignored = getattr(args, "sglang_server_args", None) or {}
    if ignored:
        logger.warning("the CPU engine ignores these --sglang-* flags: %s", ", ".join(sorted(ignored)))
    return options_to_cli_args(
        {
            "model_path": model_path,
            "host": host,
            "port": port,
            "max_running_requests": getattr(args, "cpu_engine_max_running_requests", 32),
            "num_threads": cpu_engine_num_threads(args),
        }
    )


def cpu_engine_num_threads(args: Namespace) -> int:
    """Torch/OpenMP threads for one CPU engine process (`args.cpu_engine_num_threads`, default 1)."""
    return int(getattr(args, "cpu_engine_num_threads", 1))


def _normalized_options(options: dict[str, Any]) -> dict[str, Any]:
    return {field.replace("-", "_"): value for field, value in options.items()}
