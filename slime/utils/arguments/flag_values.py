"""How flag values are read: argparse types for JSON objects and name/path pairs, and the best-effort typing
of flags no parser registered (`--sglang-*` / `--router-*` without the packages, kept Megatron flags)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_INT_PATTERN = re.compile(r"[-+]?\d+")
_FLOAT_PATTERN = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _json_object(text: str) -> dict[str, Any]:
    """argparse `type=` for flags that take a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"key\": 1}}', got {text!r} ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"key\": 1}}', got {type(value).__name__}")
    return value


class _NamePathPairs(argparse.Action):
    """`--flag name path [name path ...]`, repeatable; collects `[(name, path), ...]`."""

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) % 2:
            parser.error(
                f"{option_string} takes name/path pairs but got {len(values)} values {values}; "
                f"write e.g. {option_string} gsm8k /data/gsm8k.jsonl aime /data/aime.jsonl"
            )
        pairs = list(getattr(namespace, self.dest) or [])
        pairs.extend(zip(values[0::2], values[1::2]))
        setattr(namespace, self.dest, pairs)


def _typed_value(text: str) -> Any:
    """Best-effort type for a value of a flag nobody registered: int, float, bool, JSON, else str."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INT_PATTERN.fullmatch(text):
        return int(text)
    if _FLOAT_PATTERN.fullmatch(text):
        return float(text)
    if text[:1] in ("[", "{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def _is_flag(token: str) -> bool:
    # "-1" or "-0.5" is a value, not a flag.
    return token.startswith("-") and not _FLOAT_PATTERN.fullmatch(token)


def _extract_unknown_flags(argv: list[str], known: set[str], prefix: str) -> tuple[list[str], dict[str, Any]]:
    """Pull out `prefix*` flags the parser does not know, with their values.

    Every non-flag token right after an unknown flag is its value (slime has no positional
    arguments, so nothing else could own it).

    Args:
        argv: command line without the program name.
        known: option strings the parser registers.
        prefix: only unknown flags starting with this are taken, e.g. "--sglang-" or "--".

    Returns:
        (the rest of argv in order, {flag as written, e.g. "--sglang-log-level": typed value}).
    """
    rest: list[str] = []
    found: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, has_inline, inline_value = token.partition("=")
        if len(flag) <= len(prefix) or not flag.startswith(prefix) or flag in known:
            rest.append(token)
            i += 1
            continue
        values = [inline_value] if has_inline else []
        i += 1
        while not has_inline and i < len(argv) and not _is_flag(argv[i]):
            values.append(argv[i])
            i += 1
        if not values:
            found[flag] = True
        elif len(values) == 1:
            found[flag] = _typed_value(values[0])
        else:
            found[flag] = [_typed_value(v) for v in values]
    return rest, found


def _field_name(flag: str, prefix: str) -> str:
    """ "--sglang-mem-fraction-static" with prefix "--sglang-" -> "mem_fraction_static"."""
    return flag[len(prefix) :].replace("-", "_")
