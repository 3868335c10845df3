"""Placement, backends, engines and router: the cluster, CPU-budget, slime-level SGLang and fault-tolerance
groups, and the forwarding of `--sglang-<field>` / `--router-<field>` to SGLang's and sglang-router's own
parsers (with the fields slime sets itself refused)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib
import logging
from typing import Any

from slime.utils.arguments.flag_values import _field_name

# One logger for the whole parser, named as before the split into modules (log lines show the name).
logger = logging.getLogger(__package__)

# ServerArgs fields slime sets itself for each engine, and the flag that controls each instead.
SGLANG_MANAGED_FIELDS: dict[str, str] = {
    "model_path": "--hf-checkpoint",
    "tp_size": "--rollout-num-gpus-per-engine",
    "port": "nothing (slime picks a free port per engine)",
    "host": "nothing (slime binds each engine itself)",
    "nnodes": "--rollout-num-gpus-per-engine (slime spans nodes itself)",
    "node_rank": "nothing (slime assigns ranks)",
    "dist_init_addr": "nothing (slime assigns addresses)",
    "base_gpu_id": "nothing (slime places engines on GPUs)",
    "gpu_id_step": "nothing (slime places engines on GPUs)",
    "nccl_port": "nothing (slime picks a free port)",
    "enable_memory_saver": "--offload-rollout",
    "skip_server_warmup": "nothing (slime decides)",
    "trust_remote_code": "--trust-remote-code",
    "enable_multimodal": "--multimodal-keys",
}


# RouterArgs fields slime sets itself.
ROUTER_MANAGED_FIELDS: dict[str, str] = {
    "host": "--sglang-router-ip",
    "port": "--sglang-router-port",
}
# slime's own --sglang-<name> flags; a ServerArgs field of the same name is not forwarded.
SLIME_SGLANG_FLAG_NAMES = {"server_concurrency", "router_ip", "router_port", "router_request_timeout_secs", "config"}
_SGLANG_EXCLUDED = set(SGLANG_MANAGED_FIELDS) | SLIME_SGLANG_FLAG_NAMES
_ROUTER_EXCLUDED = set(ROUTER_MANAGED_FIELDS)


def _add_cluster_arguments(parser: argparse.ArgumentParser, cuda: bool) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--train-backend",
        choices=["megatron", "fsdp"],
        default="megatron" if cuda else "fsdp",
        help="Training backend (default: megatron with CUDA, fsdp without).",
    )
    group.add_argument(
        "--rollout-backend",
        choices=["sglang", "cpu"],
        default="sglang" if cuda else "cpu",
        help="Inference engines: SGLang servers, or slime's CPU engine that speaks the same HTTP API "
        "(default: sglang with CUDA, cpu without).",
    )
    group.add_argument("--actor-num-nodes", type=int, default=1, help="Nodes for the actor (and critic).")
    group.add_argument(
        "--actor-num-gpus-per-node",
        type=int,
        default=8 if cuda else 1,
        help="Trainer processes per node, one per GPU; without CUDA each is a CPU rank "
        "(default: 8 with CUDA, 1 without).",
    )
    group.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=None,
        help="GPUs for all rollout engines. Set automatically under --colocate; without CUDA a 'GPU' is one CPU "
        "engine slot and the default is 1. Engines = rollout-num-gpus / rollout-num-gpus-per-engine.",
    )
    group.add_argument(
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        help="GPUs per engine (its tensor-parallel size); keep 1 with --rollout-backend cpu.",
    )
    group.add_argument(
        "--num-gpus-per-node",
        type=int,
        default=8 if cuda else 1,
        help="GPUs per node, used to place engines that span nodes (default: 8 with CUDA, 1 without).",
    )
    group.add_argument(
        "--colocate",
        action="store_true",
        help="Train and generate on the same GPUs, taking turns; turns on both offloads unless --no-offload-*.",
    )
    group.add_argument("--offload", action="store_true", help="Shorthand for --offload-train --offload-rollout.")
    group.add_argument(
        "--offload-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Release the trainer's GPU memory while engines generate (default: on with --colocate or ppo).",
    )
    group.add_argument(
        "--offload-rollout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Release the engines' GPU memory while training (default: on with --colocate).",
    )
    group.add_argument(
        "--prefill-num-servers",
        type=int,
        default=None,
        help="Prefill servers for prefill/decode disaggregation (SGLang only).",
    )


def _add_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "CPU budgets", "Threads per process. On a CPU machine keep the total at or below the core count."
    )
    group.add_argument(
        "--train-num-threads",
        type=int,
        default=1,
        help="torch intra-op threads in each trainer process (on GPU only CPU-side ops use them).",
    )
    group.add_argument(
        "--cpu-engine-num-threads",
        type=int,
        default=1,
        help="torch intra-op threads in each CPU rollout engine (--rollout-backend cpu).",
    )
    group.add_argument(
        "--cpu-engine-max-running-requests",
        type=int,
        default=32,
        help="Requests a CPU rollout engine decodes together in one batch.",
    )
    group.add_argument(
        "--cpu-engine-max-queued-requests",
        type=int,
        default=4096,
        help="Requests a CPU rollout engine keeps waiting for a batch slot; more get HTTP 503 with Retry-After.",
    )


def _add_sglang_arguments(parser: argparse.ArgumentParser) -> None:
    sglang = parser.add_argument_group("SGLang and router (slime-level)")
    sglang.add_argument(
        "--sglang-server-concurrency",
        type=int,
        default=512,
        help="Requests in flight per engine from the rollout function.",
    )
    sglang.add_argument("--sglang-router-ip", default=None, help="Use a router already running at this IP.")
    sglang.add_argument("--sglang-router-port", type=int, default=None, help="Port of that router.")
    sglang.add_argument(
        "--sglang-router-request-timeout-secs",
        type=int,
        default=14400,
        help="Timeout of one request through the router.",
    )
    sglang.add_argument(
        "--sglang-config", default=None, help="YAML describing server groups (prefill/decode/...) with overrides."
    )


def _add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fault tolerance")
    group.add_argument(
        "--use-fault-tolerance",
        action="store_true",
        help="Health-check engines and the router and restart dead ones; restart the job from its last checkpoint "
        "when a trainer rank or the rollout manager dies (--max-restarts).",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="With --use-fault-tolerance and --save: how many times the driver restarts the job from the last "
        "committed checkpoint after a trainer rank or the rollout manager died (0: never).",
    )
    group.add_argument("--rollout-health-check-interval", type=float, default=30.0, help="Seconds between checks.")
    group.add_argument("--rollout-health-check-timeout", type=float, default=30.0, help="Seconds before a check fails.")
    group.add_argument(
        "--rollout-health-check-first-wait", type=float, default=0.0, help="Seconds before the first check."
    )


def _copy_prefixed_actions(actions: list[argparse.Action], group: argparse._ArgumentGroup, flag_prefix: str) -> None:
    """Re-register each `--x` option as `--{flag_prefix}x` with dest `{flag_prefix}x` (dashes as "_").

    Type, default, nargs, choices and action class stay the package's own.
    """
    dest_prefix = flag_prefix.replace("-", "_")
    for action in actions:
        prefixed = copy.copy(action)
        prefixed.option_strings = [f"--{flag_prefix}{opt[2:]}" for opt in action.option_strings if opt.startswith("--")]
        prefixed.dest = dest_prefix + action.dest
        if isinstance(action, argparse.BooleanOptionalAction):
            prefixed.__class__ = _PrefixedBooleanOptional
            prefixed.negative_prefix = f"--{flag_prefix}no-"
        group._add_action(prefixed)


class _PrefixedBooleanOptional(argparse.BooleanOptionalAction):
    """A copied `--x` / `--no-x` pair: argparse tells the negative form by a leading `--no-`, which the prefix
    hides (`--sglang-no-x`), so the copy compares against its own negative spelling."""

    negative_prefix = "--no-"

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith(self.negative_prefix))


@functools.cache
def _sglang_source_parser() -> argparse.ArgumentParser | None:
    """SGLang's own server parser, or None when sglang is not installed."""
    try:
        server_args = importlib.import_module("sglang.srt.server_args")
    except ImportError:
        return None
    except Exception as e:  # installed but broken here (e.g. CUDA libraries missing)
        logger.warning("sglang is installed but cannot be imported (%s); --sglang-* flags are parsed generically.", e)
        return None
    parser = argparse.ArgumentParser(add_help=False)
    server_args.ServerArgs.add_cli_args(parser)
    # ServerArgs is a dataclass in older SGLang and a msgspec Struct (fields in `record_fields`) in newer ones.
    fields_of = getattr(server_args, "record_fields", dataclasses.fields)
    fields = {f.name for f in fields_of(server_args.ServerArgs)}
    # Keep only dataclass fields: those are what an engine's ServerArgs can take.
    parser._actions = [a for a in parser._actions if a.dest in fields]
    return parser


@functools.cache
def _router_source_parser() -> argparse.ArgumentParser | None:
    """sglang-router's own parser (without host/port), or None when it is not installed."""
    try:
        router_args = importlib.import_module("sglang_router.router_args")
    except ImportError:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False, exclude_host_port=True)
    return parser


def _forwarded_actions(source: argparse.ArgumentParser | None, excluded: set[str]) -> list[argparse.Action]:
    """The options of a package's parser that slime registers under a prefix."""
    if source is None:
        return []
    return [
        action
        for action in source._actions
        if not isinstance(action, argparse._HelpAction)
        and any(opt.startswith("--") for opt in action.option_strings)
        and action.dest not in excluded
    ]


def _add_forwarded_arguments(parser: argparse.ArgumentParser) -> None:
    sglang_actions = _forwarded_actions(_sglang_source_parser(), _SGLANG_EXCLUDED)
    if sglang_actions:
        group = parser.add_argument_group("SGLang server (--sglang-<ServerArgs field>)")
        _copy_prefixed_actions(sglang_actions, group, "sglang-")
    router_actions = _forwarded_actions(_router_source_parser(), _ROUTER_EXCLUDED)
    if router_actions:
        group = parser.add_argument_group("router (--router-<RouterArgs field>)")
        _copy_prefixed_actions(router_actions, group, "router-")


def _reject_managed_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    for token in argv:
        flag = token.partition("=")[0]
        for prefix, managed in (("--sglang-", SGLANG_MANAGED_FIELDS), ("--router-", ROUTER_MANAGED_FIELDS)):
            if flag.startswith(prefix) and flag[len(prefix) :].replace("-", "_") in managed:
                instead = managed[flag[len(prefix) :].replace("-", "_")]
                parser.error(f"{flag} is set by slime itself; use {instead} instead")


def _attach_forwarded(
    args: argparse.Namespace, prefix: str, registered: list[str], generic: dict[str, Any]
) -> dict[str, Any]:
    """Set `args.<prefix><field>` for generic flags and return {field: value} of all forwarded ones."""
    forwarded = {field: getattr(args, prefix + field) for field in registered}
    for flag, value in generic.items():
        field = _field_name(flag, "--" + prefix.replace("_", "-"))
        setattr(args, prefix + field, value)
        forwarded[field] = value
    return forwarded
