"""Every registered flag does something, and a test shows it: each flag that is not refused everywhere names in
`FLAG_TESTS` the tests that set it and assert its effect; the rest are refused at parse time with a reason
(`REFUSED_FLAGS`). The `--sglang-*` / `--router-*` flags only forward; the launch-command tests cover them."""

from __future__ import annotations

import argparse
import ast
import functools
import re
from pathlib import Path

import pytest

from slime.utils import arguments
from slime.utils.arguments import (
    FLAG_TESTS,
    PARSE_TIME_FLAGS,
    REFUSED_FLAGS,
    ArgumentValidationError,
    build_parser,
    parse_args,
)

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
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
    """The code that may read a flag: slime/ (slime/plugins/ too), tools/, train*.py, without the parser itself."""
    files = [f for root in ("slime", "tools") for f in (REPO / root).rglob("*.py")]
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


def option_strings() -> dict[str, set[str]]:
    """dest -> every option string of every flag parse_args registers, for either backend (Megatron's own parser
    aside)."""
    dests: dict[str, set[str]] = {}
    for backend in ("fsdp", "megatron"):
        for action in build_parser(backend)._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                dests.setdefault(action.dest, set()).update(action.option_strings)
    return dests


def registered() -> dict[str, str]:
    """dest -> flag of every flag parse_args registers, for either backend (Megatron's own parser aside)."""
    dests: dict[str, str] = {}
    for backend in ("fsdp", "megatron"):
        for action in build_parser(backend)._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                dests.setdefault(action.dest, action.option_strings[0])
    return dests


def refused_everywhere() -> set[str]:
    return {d for d, r in REFUSED_FLAGS.items() if set(r.backends) == {"fsdp", "megatron"}}


def flags_needing_a_test() -> list[str]:
    """The dests of the flags that do something: registered, not forwarded, not refused under both backends."""
    forwarded, refused = forwarded_dests(), refused_everywhere()
    return [d for d in registered() if d not in forwarded and d not in refused]


class _WithoutMentions(ast.NodeTransformer):
    """Drops what names a flag without giving it: docstrings, `match=` patterns, `pytest.mark.reliability` texts
    (comments never reach the AST)."""

    def visit_keyword(self, node: ast.keyword) -> ast.keyword | None:
        return None if node.arg == "match" else self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "reliability":
            return ast.Constant(None)
        return self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        is_text = isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        return ast.Pass() if is_text else self.generic_visit(node)


@functools.cache
def functions_of(file_name: str) -> dict[str, str]:
    """name -> code of each test function in the one file under tests/ called `file_name` (its decorators
    included), followed by the code of the module-level functions, constants and fixtures it names, each without
    comments, docstrings, `match=` patterns and reliability texts."""
    paths = sorted(TESTS.rglob(file_name))
    if len(paths) != 1:
        raise LookupError(f"{len(paths)} files named {file_name} under tests/")
    module = ast.parse(paths[0].read_text())
    top: dict[str, ast.AST] = {}
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    top[target.id] = node
    tests = {}
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            # One level: the names it uses (fixtures are its parameters) that this module defines.
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in node.args.args}
            named = [top[name] for name in sorted(names) if name in top and name != node.name]
            tests[node.name] = "\n".join(ast.unparse(_WithoutMentions().visit(n)) for n in [node, *named])
    return tests


def passes_flag(dest: str, options: set[str], code: str) -> bool:
    """Whether `code` gives the flag: an option string (`--x-y`), the dest as a keyword or attribute set
    (`x_y=`) or quoted (`"x_y"`)."""
    spelled = "|".join(re.escape(option) for option in sorted(options))
    return bool(re.search(rf"(?<![\w-])(?:{spelled})(?![\w-])|\b{dest}\s*=(?!=)|[\"']{dest}[\"']", code))


def is_read(dest: str, text: str) -> bool:
    return bool(re.search(rf"args\.{dest}\b|getattr\(\s*\w*args\w*\s*,\s*[\"']{dest}[\"']|[\"']{dest}[\"']", text))


def test_every_flag_has_a_behaviour_test():
    options, flags, needed = option_strings(), registered(), flags_needing_a_test()
    problems = []
    for dest in needed:
        if dest not in FLAG_TESTS:
            problems.append(
                f"{flags[dest]}: no entry in FLAG_TESTS (slime/utils/arguments/flag_tests.py); write a test "
                "that sets it and asserts what it changes, and name it there"
            )
    for dest in sorted(set(FLAG_TESTS) - set(needed)):
        what = "refused under both backends" if dest in refused_everywhere() else "not a slime flag"
        problems.append(f"FLAG_TESTS names {dest}, which is {what}: remove the entry")
    for dest, test_ids in sorted(FLAG_TESTS.items()):
        if not test_ids:
            problems.append(f"FLAG_TESTS[{dest!r}] is empty: name a test or remove the entry")
        for test_id in test_ids:
            file_name, _, name = test_id.partition("::")
            try:
                sources = functions_of(file_name)
            except LookupError as error:
                problems.append(f"FLAG_TESTS[{dest!r}] names {test_id}: {error}; write it as '<file name>::<test>'")
                continue
            if name not in sources:
                problems.append(f"FLAG_TESTS[{dest!r}] names {test_id}: {file_name} has no test function {name}")
            elif dest in options and not passes_flag(dest, options[dest], sources[name]):
                problems.append(
                    f"FLAG_TESTS[{dest!r}] names {test_id}, which never passes {flags[dest]} (nor {dest}=): "
                    "name a test that sets it"
                )
    covered = sum(1 for dest in needed if dest in FLAG_TESTS)
    print(f"{covered} flags with a behaviour test / {len(needed)} flags")
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems)


def test_forwarded_flags_reach_the_engines_and_the_router():
    # The --sglang-* / --router-* flags are read together through these two (the launch-command tests run them).
    text = source_text()
    if forwarded_dests():
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
