"""--custom-config-path: a YAML of flag values applied over the command line at parse time."""

from __future__ import annotations

import argparse
import difflib
import logging
from typing import Any

import yaml

from slime.utils.arguments.cluster import _router_source_parser, _sglang_source_parser
from slime.utils.arguments.errors import _fail
from slime.utils.arguments.flag_values import _NamePathPairs

# One logger for the whole parser, named as before the split into modules (log lines show the name).
logger = logging.getLogger(__package__)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config file")
    group.add_argument(
        "--custom-config-path",
        default=None,
        help="YAML mapping of flag values applied over the command line at parse time. Keys are dests "
        "(use_tis) or flag names (--use-tis); keys that are no flag are set on args for custom functions.",
    )


def _config_value(action: argparse.Action, option: str | None, key: str, value: Any, path: str) -> Any:
    """A YAML value for a registered flag, converted and checked as argparse would.

    `option` is the flag name the key was written as (`--use-tis`), None for a dest key (`use_tis`): a
    boolean under a flag name says whether the flag is given, under a dest it is the value itself.
    """

    def bad(why: str) -> None:
        _fail(f"--custom-config-path {path}: {key}: {why}")

    if isinstance(action, _NamePathPairs):
        pairs = list(value.items()) if isinstance(value, dict) else value
        if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            bad(f"expected a mapping {{name: path}} or a list of [name, path], got {value!r}")
        return [tuple(p) for p in pairs]
    if action.nargs == 0:  # store_true / store_false / store_const / BooleanOptionalAction
        if not isinstance(value, bool):
            bad(f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value != bool(option and option.startswith("--no-"))
        if option is None:
            return value
        return action.const if value else action.default
    many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    items = (value if isinstance(value, list) else [value]) if many else [value]
    converted = []
    for item in items:
        if isinstance(item, str) and action.type is not None:
            try:
                item = action.type(item)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                bad(f"{item!r} is not a valid value ({e})")
        if action.choices is not None and item not in action.choices:
            bad(f"{item!r} is not one of {', '.join(map(str, action.choices))}")
        converted.append(item)
    return converted if many else converted[0]


def _apply_custom_config(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    generic_sglang: dict[str, Any],
    generic_router: dict[str, Any],
) -> None:
    """--custom-config-path: set the YAML's values over the command line (as upstream applies them)."""
    path = args.custom_config_path
    if not path:
        return
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        _fail(f"--custom-config-path {path}: cannot read it ({e.strerror or e}).")
    except yaml.YAMLError as e:
        _fail(f"--custom-config-path {path} is not valid YAML: {e}")
    if config is None:
        return
    if not isinstance(config, dict):
        _fail(f"--custom-config-path {path} must hold a mapping of flag: value, not a {type(config).__name__}.")
    by_dest = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    extra = []
    for key, value in config.items():
        name = str(key)
        stripped = name.lstrip("-")
        option = None
        action = None if name.startswith("--") or "-" in stripped else by_dest.get(stripped)
        if action is None:
            option = "--" + stripped.replace("_", "-")
            action = parser._option_string_actions.get(option)
        dest = action.dest if action is not None else stripped.replace("-", "_")
        if dest in ("custom_config_path", "train_backend"):
            _fail(f"--custom-config-path {path}: {name} must be given on the command line.")
        if action is not None:
            setattr(args, dest, _config_value(action, option, name, value, path))
            continue
        prefix = next((p for p in ("sglang_", "router_") if dest.startswith(p)), None)
        source = {"sglang_": _sglang_source_parser, "router_": _router_source_parser}.get(prefix)
        if source is not None and source() is None:  # forwarded generically: as if on the command line
            generic = generic_sglang if prefix == "sglang_" else generic_router
            generic["--" + prefix.replace("_", "-") + dest[len(prefix) :].replace("_", "-")] = value
            continue
        if hasattr(args, dest):  # a flag of Megatron's own parser, or a kept Megatron flag
            setattr(args, dest, value)
            continue
        close = difflib.get_close_matches(dest, list(by_dest), n=1, cutoff=0.85)
        if close or prefix is not None:
            hint = f"; did you mean {close[0]}?" if close else ""
            _fail(f"--custom-config-path {path}: {name} is not a flag{hint}")
        setattr(args, dest, value)
        extra.append(dest)
    if extra:
        logger.info("--custom-config-path %s: set %s for custom functions (no slime flags)", path, ", ".join(extra))
