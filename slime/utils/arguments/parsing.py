"""`parse_args`: one command line into one validated namespace, through Megatron's parser when it is
importable, else slime's, with generic `--sglang-*` / `--router-*` and kept Megatron flags."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from slime.utils.arguments.algorithm import _load_algorithm_modules
from slime.utils.arguments.cluster import (
    _ROUTER_EXCLUDED,
    _SGLANG_EXCLUDED,
    _attach_forwarded,
    _forwarded_actions,
    _reject_managed_flags,
    _router_source_parser,
    _sglang_source_parser,
)
from slime.utils.arguments.config_file import _apply_custom_config
from slime.utils.arguments.flag_values import _extract_unknown_flags, _field_name
from slime.utils.arguments.megatron import MEGATRON_DEFAULT_OVERRIDES
from slime.utils.arguments.parser import add_slime_arguments, build_parser
from slime.utils.arguments.refused import refuse_unsupported_flags
from slime.utils.arguments.validation import validate_args
from slime.utils.device import cuda_available

# One logger for the whole parser, named as before the split into modules (log lines show the name).
logger = logging.getLogger(__package__)


def _import_megatron_arguments():
    try:
        return importlib.import_module("megatron.training.arguments")
    except ImportError:
        return None


def _parse_with_megatron(megatron_arguments, argv: list[str]) -> argparse.Namespace:
    """Megatron's parse_args over argv, with slime's flags and default overrides added."""
    cuda = cuda_available()

    def extra_args_provider(parser):
        add_slime_arguments(parser)
        parser.set_defaults(**MEGATRON_DEFAULT_OVERRIDES, distributed_backend="nccl" if cuda else "gloo")
        return parser

    # Megatron reads sys.argv itself.
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "slime", *argv]
    try:
        return megatron_arguments.parse_args(extra_args_provider=extra_args_provider, ignore_unknown_args=True)
    finally:
        sys.argv = saved_argv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse slime's command line into one namespace and validate it.

    Args:
        argv: arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        the namespace: every flag as an attribute, plus `sglang_server_args`, `router_args`,
        `megatron_passthrough_args` (dicts) and the fields derived by `validate_args`.

    `--custom-config-path` values are applied over the command line first; then a flag of `REFUSED_FLAGS`
    given a value other than its default is refused.

    Raises:
        SystemExit: malformed command line (argparse prints the message).
        ArgumentValidationError: inconsistent flags, or a refused flag (the message says why and what instead).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cuda = cuda_available()

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--train-backend", choices=["megatron", "fsdp"], default="megatron" if cuda else "fsdp")
    pre.add_argument("--custom-algorithm-module", nargs="+", default=None)
    pre_args = pre.parse_known_args(argv)[0]
    train_backend = pre_args.train_backend
    _load_algorithm_modules(pre_args)  # before the parser takes its choices from the registries
    megatron_arguments = _import_megatron_arguments() if train_backend == "megatron" else None

    parser = build_parser(train_backend, megatron_subset=megatron_arguments is None)
    _reject_managed_flags(parser, argv)
    known = set(parser._option_string_actions)

    # Without the package, --sglang-*/--router-* are taken generically before argparse sees them.
    generic_sglang: dict[str, Any] = {}
    generic_router: dict[str, Any] = {}
    if _sglang_source_parser() is None:
        argv, generic_sglang = _extract_unknown_flags(argv, known, "--sglang-")
    if _router_source_parser() is None:
        argv, generic_router = _extract_unknown_flags(argv, known, "--router-")

    passthrough: dict[str, Any] = {}
    if megatron_arguments is not None:
        args = _parse_with_megatron(megatron_arguments, argv)
    else:
        argv, unknown = _extract_unknown_flags(argv, known, "--")
        if unknown and train_backend == "fsdp":
            parser.error(
                f"unrecognized arguments: {', '.join(unknown)}. With --train-backend fsdp only slime's flags and "
                "the Megatron flags slime reads are accepted (see --help): fix the spelling, or drop Megatron "
                "model flags (FSDP reads the architecture from --hf-checkpoint)."
            )
        args = parser.parse_args(argv)
        if unknown:
            logger.warning(
                "megatron.training is not importable, so these flags are kept as given without Megatron's checks: %s",
                ", ".join(unknown),
            )
        for flag, value in unknown.items():
            name = _field_name(flag, "--")
            if hasattr(args, name):  # e.g. --rollout_batch_size next to the real --rollout-batch-size
                parser.error(f"unrecognized argument {flag}; did you mean --{name.replace('_', '-')}?")
            setattr(args, name, value)
            passthrough[name] = value

    _apply_custom_config(args, parser, generic_sglang, generic_router)
    args.sglang_server_args = _attach_forwarded(
        args, "sglang_", [a.dest for a in _forwarded_actions(_sglang_source_parser(), _SGLANG_EXCLUDED)], generic_sglang
    )
    args.router_args = _attach_forwarded(
        args, "router_", [a.dest for a in _forwarded_actions(_router_source_parser(), _ROUTER_EXCLUDED)], generic_router
    )
    args.megatron_passthrough_args = passthrough
    refuse_unsupported_flags(args)
    validate_args(args)
    return args
