"""Command lines for the two engine servers: `python -m sglang.launch_server` (GPU) and
`python -m slime.backends.cpu_engine` (CPU). Both serve SGLang's HTTP API, so nothing else differs.

`--sglang-<flag> value` on slime's command line lands in `args.sglang_server_args` as {"<flag>": value}
and is forwarded to every SGLang server as `--<flag> value`. With sglang installed that dict holds every
ServerArgs field, defaults included, so only values that differ from SGLang's own CLI defaults are
passed on, each in the form its argparse action expects. The fields that depend on where an engine is
placed (model path, ports, GPUs, nodes) are slime's to set; passing one of them raises.

The command lines take any namespace that holds the fields it sets (engines launched on their own, outside a
run, pass only those), so every field is read with a default.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from typing import Any

from slime.utils.engine_args import cpu_engine_dtype
from slime.utils.engine_args import engine_api_key as engine_api_key  # importable here, as before
from slime.utils.lora import engines_serve_adapter, lora_enabled

logger = logging.getLogger(__name__)


def options_to_cli_args(options: dict[str, Any], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Turn {"field_name": value} into ["--field-name", "value", ...] for an argparse-based CLI.

    Args:
        options: Field names (underscores or dashes) to values. True becomes a bare flag; False and None
            are left out; lists become several values after one flag; dicts are passed as JSON.
        parser: The target program's parser, when importable: booleans and repeated options then follow
            each field's action (`store_false`, `--x/--no-x`, `append`).

    Returns:
        The argument list, in the order of `options`.
    """
    actions = {action.dest: action for action in parser._actions} if parser is not None else {}
    cli_args = []
    for field, value in options.items():
        field = field.replace("-", "_")
        action = actions.get(field)
        flag = _long_option(action) if action is not None else "--" + field.replace("_", "-")
        if isinstance(value, bool):
            if isinstance(action, argparse.BooleanOptionalAction):
                cli_args.append(flag if value else "--no-" + flag.removeprefix("--"))
            elif isinstance(action, argparse._StoreFalseAction):
                if not value:
                    cli_args.append(flag)
            elif value:
                cli_args.append(flag)
        elif value is None:
            continue
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                cli_args += [flag, *_cli_values(item)]
        else:
            cli_args += [flag, *_cli_values(value)]
    return cli_args


def drop_parser_defaults(options: dict[str, Any], parser: argparse.ArgumentParser | None) -> dict[str, Any]:
    """The options whose value differs from `parser`'s default (all of them when there is no parser).

    slime's argument parser stores every field of SGLang's ServerArgs / sglang-router's RouterArgs, given
    or not; only the ones a user changed should reach the command line.
    """
    if parser is None:
        return dict(options)
    defaults = {action.dest: action.default for action in parser._actions}
    return {
        field: value
        for field, value in options.items()
        if field.replace("-", "_") not in defaults or value != defaults[field.replace("-", "_")]
    }


def _long_option(action: argparse.Action) -> str:
    return next(option for option in action.option_strings if option.startswith("--"))


def _cli_values(value: Any) -> list[str]:
    if isinstance(value, list | tuple):
        return [str(item) for item in value]
    if isinstance(value, dict):
        return [json.dumps(value)]
    return [str(value)]


@functools.cache
def sglang_cli_parser() -> argparse.ArgumentParser | None:
    """`sglang.launch_server`'s argument parser, or None where sglang is not installed (CPU machines)."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def build_sglang_server_args(
    args: argparse.Namespace,
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
        args: slime's parsed arguments; reads `sglang_server_args` (dict of user `--sglang-*` flags),
            `offload_rollout` (adds `--enable-memory-saver` so weights and KV cache can be released),
            `use_rollout_routing_replay` (adds `--enable-return-routed-experts`), `multimodal_keys` (adds
            `--enable-multimodal`) and `trust_remote_code`.
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
    # Imported here: the parser pulls in torch, which an engine actor (a launcher) does not need.
    from slime.utils.arguments import SGLANG_MANAGED_FIELDS

    user_options = _normalized_options(args.sglang_server_args or {})
    user_options.pop("api_key", None)  # by the environment (`keyed_launch`), never on the command line
    managed = sorted(set(user_options) & set(SGLANG_MANAGED_FIELDS))
    if managed:
        hints = "; ".join(f"--sglang-{f.replace('_', '-')}: use {SGLANG_MANAGED_FIELDS[f]}" for f in managed)
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
        "enable_memory_saver": bool(args.offload_rollout),
        "enable_return_routed_experts": bool(args.use_rollout_routing_replay),
        "trust_remote_code": bool(args.trust_remote_code),
        # SGLang would also detect a vision-language checkpoint itself; said outright, a VL run never depends on it.
        "enable_multimodal": bool(args.multimodal_keys),
        **_lora_serving_options(args, every_linear="all"),
    }
    if lora_enabled(args) and args.offload_rollout:
        # Released weights come back only from a CPU copy: with LoRA (--lora-train-only too) no push resends the base.
        slime_options["enable_weights_cpu_backup"] = True
    parser = sglang_cli_parser()
    return options_to_cli_args(slime_options) + options_to_cli_args(drop_parser_defaults(user_options, parser), parser)


def build_cpu_engine_args(args: argparse.Namespace, *, model_path: str, host: str, port: int) -> list[str]:
    """Arguments for `python -m slime.backends.cpu_engine` for one engine.

    Args:
        args: slime's parsed arguments; reads `cpu_engine_max_running_requests`, `cpu_engine_max_queued_requests`,
            `cpu_engine_num_threads` (torch threads of the engine process) and `trust_remote_code`. Of the `--sglang-*` flags only
            `--sglang-api-key` (which goes by the environment, `ENGINE_API_KEY_ENV`, not these arguments) and
            `--sglang-quantization fp8` (block FP8 weights, `slime.utils.fp8`) and `--sglang-dtype` (the engine's
            parameter dtype, `cpu_engine_dtype`) mean something to the CPU engine; the others are ignored with a
            warning.
        model_path: HF checkpoint directory the engine loads.
        host: Address the HTTP server binds.
        port: HTTP port.

    Returns:
        The argument list (without the `python -m slime.backends.cpu_engine` prefix).
    """
    ignored = _normalized_options(drop_parser_defaults(args.sglang_server_args or {}, sglang_cli_parser()))
    ignored.pop("api_key", None)
    quantization = ignored.pop("quantization", None)
    if quantization not in (None, "fp8"):
        raise ValueError(
            f"--sglang-quantization {quantization}: the CPU engine runs only fp8; use fp8 or drop the flag"
        )
    ignored.pop("dtype", None)
    # The one SGLang LoRA field the CPU engine takes from the user; the others follow --lora-rank.
    max_loras_per_batch = ignored.pop("max_loras_per_batch", None) if engines_serve_adapter(args) else None
    if ignored:
        logger.warning("the CPU engine ignores these --sglang-* flags: %s", ", ".join(sorted(ignored)))
    return options_to_cli_args(
        {
            "model_path": model_path,
            "host": host,
            "port": port,
            "max_running_requests": args.cpu_engine_max_running_requests,
            "max_queued_requests": args.cpu_engine_max_queued_requests,
            "num_threads": cpu_engine_num_threads(args),
            "trust_remote_code": bool(args.trust_remote_code),
            **_lora_serving_options(args, every_linear="all-linear"),
            "max_loras_per_batch": max_loras_per_batch,
            "quantization": quantization,
            "dtype": cpu_engine_dtype(args),
            # --true-on-policy-mode: the trainer ranks' thread count, which a matmul's rounding depends on
            "true_on_policy_threads": args.train_num_threads if args.true_on_policy_mode else None,
        }
    )


def _lora_serving_options(args: argparse.Namespace, every_linear: str) -> dict[str, Any]:
    """SGLang's LoRA serving fields for `--lora-rank`: the engines serve the trained adapter beside the base (none
    with `--lora-train-only`, where they keep the base).

    Args:
        every_linear: The engine's name for `--target-modules all-linear` (SGLang: "all"); leaf names pass as they are.
    """
    if not engines_serve_adapter(args):
        return {}
    targets = list(args.target_modules)
    return {
        "enable_lora": True,
        "max_lora_rank": args.lora_rank,
        "lora_target_modules": [every_linear] if targets == ["all-linear"] else targets,
    }


def cpu_engine_num_threads(args: argparse.Namespace) -> int:
    """Torch/OpenMP threads for one CPU engine process (`--cpu-engine-num-threads`)."""
    return int(args.cpu_engine_num_threads)


def _normalized_options(options: dict[str, Any]) -> dict[str, Any]:
    return {field.replace("-", "_"): value for field, value in options.items()}
