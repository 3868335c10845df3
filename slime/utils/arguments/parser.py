"""The parser: slime's groups in --help order (`add_slime_arguments`), and `build_parser` for a backend."""

from __future__ import annotations

import argparse

from slime.utils.arguments.algorithm import _add_algorithm_arguments, _add_opd_arguments
from slime.utils.arguments.checkpoint import _add_checkpoint_arguments
from slime.utils.arguments.cluster import (
    _add_cluster_arguments,
    _add_cpu_arguments,
    _add_fault_tolerance_arguments,
    _add_forwarded_arguments,
    _add_sglang_arguments,
)
from slime.utils.arguments.config_file import _add_config_arguments
from slime.utils.arguments.debug import _add_debug_arguments
from slime.utils.arguments.lora import _add_lora_arguments
from slime.utils.arguments.megatron import add_fsdp_megatron_arguments, add_megatron_subset_arguments
from slime.utils.arguments.reporting import _add_ci_arguments, _add_logging_arguments
from slime.utils.arguments.rollout import (
    _add_buffer_arguments,
    _add_data_arguments,
    _add_eval_arguments,
    _add_reward_arguments,
    _add_rollout_arguments,
    _add_sampling_arguments,
)
from slime.utils.arguments.training import _add_train_arguments
from slime.utils.device import cuda_available


def add_slime_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register slime's own flags, plus `--sglang-*` / `--router-*` when those packages are installed.

    Usable as Megatron's `extra_args_provider`. Megatron-named flags (lr, batch sizes, save/load,
    ...) are not added here; see `add_megatron_subset_arguments`.

    Args:
        parser: the parser to extend.

    Returns:
        the same parser.
    """
    cuda = cuda_available()
    _add_cluster_arguments(parser, cuda)
    _add_cpu_arguments(parser)
    _add_train_arguments(parser)
    _add_lora_arguments(parser)
    _add_rollout_arguments(parser)
    _add_sglang_arguments(parser)
    _add_sampling_arguments(parser)
    _add_data_arguments(parser)
    _add_eval_arguments(parser)
    _add_algorithm_arguments(parser)
    _add_opd_arguments(parser)
    _add_reward_arguments(parser)
    _add_buffer_arguments(parser)
    _add_checkpoint_arguments(parser)
    _add_logging_arguments(parser)
    _add_debug_arguments(parser)
    _add_fault_tolerance_arguments(parser)
    _add_ci_arguments(parser)
    _add_config_arguments(parser)
    _add_forwarded_arguments(parser)
    return parser


def build_parser(train_backend: str, megatron_subset: bool = True) -> argparse.ArgumentParser:
    """slime's parser as `parse_args` builds it for `train_backend` (Megatron's own parser not included).

    Args:
        train_backend: "fsdp" or "megatron".
        megatron_subset: also register the Megatron flags slime reads (done when Megatron's parser is not used).

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(
        description="slime: RL post-training with Megatron/FSDP training and SGLang rollout.",
        allow_abbrev=False,
    )
    add_slime_arguments(parser)
    if megatron_subset:
        add_megatron_subset_arguments(parser)
    if train_backend == "fsdp":
        add_fsdp_megatron_arguments(parser)
    return parser


def default_args(**changed) -> argparse.Namespace:
    """A namespace with every slime flag at the default the parser gives it under `--train-backend fsdp` (no
    `--sglang-*` / `--router-*` flag given, so `sglang_server_args` and `router_args` are empty), with `changed` on
    top; unvalidated. For code that drives one component outside a run (the benches, tests)."""
    defaults = vars(build_parser("fsdp").parse_args([]))
    return argparse.Namespace(**(defaults | {"sglang_server_args": {}, "router_args": {}} | changed))
