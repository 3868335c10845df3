"""Every registered flag does something: it is read outside the parser, consumed by the parser itself
(`PARSE_TIME_FLAGS`), or refused at parse time with a reason (`REFUSED_FLAGS`)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from slime.utils import arguments
from slime.utils.arguments import PARSE_TIME_FLAGS, REFUSED_FLAGS, ArgumentValidationError, build_parser, parse_args

REPO = Path(__file__).resolve().parents[2]
PARSER = REPO / "slime" / "utils" / "arguments"
BASE = [
    "--train-backend", "fsdp",
    "--rollout-backend", "cpu",
    "--hf-checkpoint", "/models/tiny",
    "--prompt-data", "/data/train.jsonl",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "2",
    "--num-rollout", "2",
]  # fmt: skip


def source_text() -> str:
    """The code that may read a flag: slime/, slime_plugins/, tools/, train*.py, without the parser itself."""
    files = [f for root in ("slime", "slime_plugins", "tools") for f in (REPO / root).rglob("*.py")]
    files += sorted(REPO.glob("train*.py"))
    return "\n".join(f.read_text() for f in files if not f.is_relative_to(PARSER))


def parser_text() -> str:
    """The parser's own code: every module of the slime/utils/arguments/ package."""
    return "\n".join(f.read_text() for f in sorted(PARSER.rglob("*.py")))


def forwarded_dests() -> set[str]:
    """The --sglang-<field> / --router-<field> flags: read together through args.sglang_server_args / router_args."""
    sglang = arguments._forwarded_actions(arguments._sglang_source_parser(), arguments._SGLANG_EXCLUDED)
    router = arguments._forwarded_actions(arguments._router_source_parser(), arguments._ROUTER_EXCLUDED)
    return {"sglang_" + a.dest for a in sglang} | {"router_" + a.dest for a in router}


def registered() -> dict[str, str]:
    """dest -> flag of every flag parse_args registers, for either backend (Megatron's own parser aside)."""
    dests: dict[str, str] = {}
    for backend in ("fsdp", "megatron"):
        for action in build_parser(backend)._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                dests.setdefault(action.dest, action.option_strings[0])
    return dests


def is_read(dest: str, text: str) -> bool:
    return bool(re.search(rf"args\.{dest}\b|getattr\(\s*\w*args\w*\s*,\s*[\"']{dest}[\"']|[\"']{dest}[\"']", text))


def test_every_flag_is_read_consumed_or_refused():
    text = source_text()
    forwarded = forwarded_dests()
    flags = registered()
    unread = sorted(d for d in flags if d not in forwarded and not is_read(d, text))
    print(f"{len(flags)} registered flags ({len(forwarded)} forwarded), {len(unread)} never read outside the parser:")
    print("  " + " ".join(flags[d] for d in unread))
    # A flag refused under one backend only must work (be read) under the other.
    refused_everywhere = {d for d, r in REFUSED_FLAGS.items() if set(r.backends) == {"fsdp", "megatron"}}
    unhandled = [flags[d] for d in unread if d not in refused_everywhere and d not in PARSE_TIME_FLAGS]
    assert not unhandled, (
        f"{len(unhandled)} flags parse without effect: {' '.join(unhandled)}; read them, or add them to "
        "REFUSED_FLAGS (reason + what instead) or PARSE_TIME_FLAGS in slime/utils/arguments/refused.py"
    )
    if forwarded:
        assert is_read("router_args", text) or is_read("sglang_server_args", text)


def test_tables_name_registered_flags_and_say_why():
    flags = registered()
    assert not set(REFUSED_FLAGS) - set(flags), "REFUSED_FLAGS names flags that are not registered"
    assert not set(PARSE_TIME_FLAGS) - set(flags), "PARSE_TIME_FLAGS names flags that are not registered"
    parser_source = parser_text()
    for dest in PARSE_TIME_FLAGS:
        assert re.search(rf"args\.{dest}\b", parser_source), (
            f"{dest} is in PARSE_TIME_FLAGS but the parser never reads it"
        )
    defaults = {a.dest: a.default for a in build_parser("fsdp")._actions} | {
        a.dest: a.default for a in build_parser("megatron")._actions
    }
    for dest, refusal in REFUSED_FLAGS.items():
        assert refusal.reason and refusal.instead, dest
        assert refusal.values is None or defaults[dest] not in refusal.values, f"{dest}: its default is refused"


@pytest.mark.reliability("a flag that is not implemented, given a value", "refused at parse time with reason and fix")
@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--opd-type", "megatron", "--use-opd"], "a teacher loaded in the trainer"),
        (["--update-weight-local-checkpoint-dir", "/x"], "delta weight sync"),
        (["--update-weight-mode", "delta"], "delta weight sync is not implemented"),
        (["--update-weight-delta-checksum", "md5"], "delta weight sync"),
        (["--async-save"], "checkpoints are written synchronously"),
        (["--rollout-buffer-url", "http://127.0.0.1:8889"], "trajectory-buffer plugin"),
        (["--recompute-method", "block", "--recompute-granularity", "full"], "block recompute"),
        (["--keep-old-actor", "--train-backend", "megatron"], "--train-backend fsdp only"),
    ],
)
def test_refused_flags_raise_with_reason(extra, reason):
    with pytest.raises(ArgumentValidationError, match=re.escape(reason)) as error:
        parse_args(BASE + extra)
    assert extra[0] in str(error.value) and "Instead:" in str(error.value)


@pytest.mark.reliability("every refused on/off flag switched on", "each refused at parse time naming the flag")
def test_every_refused_switch_raises():
    actions = {a.dest: a for a in build_parser("fsdp")._actions} | {
        a.dest: a for a in build_parser("megatron")._actions
    }
    switches = [d for d in REFUSED_FLAGS if isinstance(actions[d], argparse._StoreTrueAction)]
    assert len(switches) > 5
    for dest in switches:
        refusal = REFUSED_FLAGS[dest]
        flag = actions[dest].option_strings[0]
        with pytest.raises(ArgumentValidationError, match=re.escape(refusal.reason)):
            parse_args(BASE + ["--train-backend", refusal.backends[0], flag])


def test_refused_flags_at_their_default_are_harmless():
    args = parse_args(
        BASE
        + ["--update-weight-transport", "nccl", "--update-weight-mode", "full", "--qwen-gdn-backend", "fla"]
        + ["--loss-mask-type", "qwen", "--rollout-data-transport", "object-store", "--data-pad-size-multiplier", "128"]
        + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    )
    assert args.update_weight_transport == "nccl" and args.recompute_num_layers == 1
    # Implemented for FSDP, refused only under Megatron.
    assert parse_args(BASE + ["--keep-old-actor"]).keep_old_actor
