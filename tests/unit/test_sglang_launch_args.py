"""The SGLang launch command slime builds from `--sglang-*` flags is one SGLang's own server parser accepts.

Where sglang imports (a GPU machine with it installed) the command is parsed by `ServerArgs.add_cli_args`
itself. Elsewhere (sglang does not run on CPU) it is parsed by a parser rebuilt from
tests/support/data/sglang_server_args.json: every option of SGLang's server CLI with its action, nargs, type and
choices, dumped from that parser of the sglang release the file names. Either way an unknown option, a value
given to a bare flag or the wrong number of values fails the parse. Regenerate the file with sglang
importable; on CPU an unzipped wheel plus what server_args imports (msgspec, pybase64, pyzmq, triton, put in a
folder with `pip install --target DIR --no-deps`) on PYTHONPATH is enough:

    python tests/unit/test_sglang_launch_args.py --write --source "sglang-<version> wheel from PyPI, sha256 ..."
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime.backends.sglang_utils.engine_actor import RolloutEngine
from slime.backends.sglang_utils.keyed_launch import with_key
from slime.utils.arguments import SGLANG_MANAGED_FIELDS, parse_args
from slime.utils.arguments.cluster import SLIME_SGLANG_FLAG_NAMES
from slime.utils.engine_args import ENGINE_API_KEY_ENV, engine_api_key

REPO = Path(__file__).resolve().parents[2]
TABLE_PATH = Path(__file__).resolve().parents[1] / "support" / "data" / "sglang_server_args.json"

BASE = [
    "--train-backend", "fsdp", "--rollout-backend", "sglang",
    "--hf-checkpoint", "/models/tiny", "--prompt-data", "/data/train.jsonl",
    "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2",
    "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "2",
]  # fmt: skip


class _StrictParser(argparse.ArgumentParser):
    """Raises instead of printing usage and exiting, so a test sees the message."""

    def error(self, message):
        raise ValueError(message)


@dataclasses.dataclass
class SGLangCLI:
    """SGLang's server parser (real or rebuilt), with what the table records beside it."""

    parser: argparse.ArgumentParser
    source: str
    fields: set[str]  # ServerArgs fields (dests of the options an engine's ServerArgs takes)
    deprecated: set[str]  # option strings SGLang still accepts but warns about

    @property
    def options(self) -> set[str]:
        return {opt for action in self.parser._actions for opt in action.option_strings}


def describe_options(parser: argparse.ArgumentParser, fields: set[str]) -> list[dict]:
    """One row per long option of `parser`: its spellings, dest, action class, nargs, type name, choices, and
    whether the dest is a ServerArgs field."""
    rows = []
    for action in parser._actions:
        flags = [opt for opt in action.option_strings if opt.startswith("--")]
        if not flags or isinstance(action, argparse._HelpAction):
            continue
        choices = action.choices
        if choices is not None:
            choices = sorted(choices, key=str) if isinstance(choices, set | frozenset) else list(choices)
            if not all(isinstance(choice, str | int | float) for choice in choices):
                choices = None
        rows.append(
            {
                "flags": flags,
                "dest": action.dest,
                "action": type(action).__name__,
                "nargs": action.nargs,
                "type": getattr(action.type, "__name__", None),
                "choices": [c if isinstance(c, int | float) else str(c) for c in choices] if choices else None,
                "field": action.dest in fields,
            }
        )
    return rows


def parser_from_table(rows: list[dict]) -> argparse.ArgumentParser:
    """A parser with the options of `rows` and their arity: bare flags take no value, the others take `nargs`
    values (one when None), checked against `type` (int / float) and `choices`."""
    parser = _StrictParser(add_help=False)
    for row in rows:
        flags, dest = row["flags"], row["dest"]
        if row["action"] == "BooleanOptionalAction":
            # Rebuilt from the positive spelling; argparse adds the --no- one.
            parser.add_argument(flags[0], dest=dest, action=argparse.BooleanOptionalAction)
        elif row["action"] == "_StoreFalseAction":
            parser.add_argument(*flags, dest=dest, action="store_false")
        elif row["nargs"] == 0:
            parser.add_argument(*flags, dest=dest, action="store_true")
        else:
            value_type = {"int": int, "float": float}.get(row["type"], str)
            action = "append" if row["action"] == "_AppendAction" else "store"
            parser.add_argument(
                *flags, dest=dest, action=action, nargs=row["nargs"], type=value_type, choices=row["choices"]
            )
    return parser


def _server_args_fields(server_args_cls) -> set[str]:
    try:
        return {field.name for field in dataclasses.fields(server_args_cls)}
    except TypeError:  # sglang >= 0.5.2x: ServerArgs is a msgspec Struct
        import msgspec

        return {field.name for field in msgspec.structs.fields(server_args_cls)}


def installed_sglang_cli() -> SGLangCLI | None:
    """The installed sglang's own parser, or None when sglang is not installed."""
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    parser = _StrictParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    retired = [action for action in parser._actions if type(action).__name__.startswith("Deprecated")]
    deprecated = {opt for action in retired for opt in action.option_strings}
    return SGLangCLI(parser, f"installed sglang {sglang.__version__}", _server_args_fields(ServerArgs), deprecated)


def table_sglang_cli() -> SGLangCLI:
    """The parser rebuilt from tests/support/data/sglang_server_args.json."""
    table = json.loads(TABLE_PATH.read_text())
    rows = table["options"]
    return SGLangCLI(
        parser_from_table(rows),
        f"the options of sglang {table['sglang_version']} ({TABLE_PATH.name})",
        {row["dest"] for row in rows if row["field"]},
        {flag for row in rows if row["action"].startswith("Deprecated") for flag in row["flags"]},
    )


@pytest.fixture(scope="module")
def sglang_cli() -> SGLangCLI:
    cli = installed_sglang_cli() or table_sglang_cli()
    print(f"parsing with {cli.source}")
    return cli


def launch_command(argv: list[str], **engine_kwargs) -> list[str]:
    """slime's `python -m sglang.launch_server ...` for `argv` (slime flags after BASE), as an engine actor builds it."""
    args = parse_args(BASE + argv)
    engine = RolloutEngine(args, rank=0, backend="sglang", host="127.0.0.1", port=30001, **engine_kwargs)
    command, env = engine._server_command()
    assert command[:4] == [sys.executable, "-m", "slime.backends.sglang_utils.keyed_launch", "sglang.launch_server"]
    key = env.get(ENGINE_API_KEY_ENV)
    assert key and key == engine_api_key(args) and key not in " ".join(command)  # by the environment only
    return with_key(command[4:], key)  # what keyed_launch hands SGLang's parser


# A representative `--sglang-*` flag of each kind of value, and what SGLang must read from the command.
CASES = {
    "float": (["--sglang-mem-fraction-static", "0.7"], {"mem_fraction_static": 0.7}),
    "int": (["--sglang-chunked-prefill-size", "4096"], {"chunked_prefill_size": 4096}),
    "string": (["--sglang-log-level", "debug"], {"log_level": "debug"}),
    "bare flag": (["--sglang-disable-radix-cache"], {"disable_radix_cache": True}),
    "list": (["--sglang-cuda-graph-bs-decode", "1", "2", "4"], {"cuda_graph_bs_decode": [1, 2, 4]}),
    "choice": (["--sglang-radix-eviction-policy", "lfu"], {"radix_eviction_policy": "lfu"}),
    "JSON": (
        ["--sglang-json-model-override-args", '{"rope_scaling": null}'],
        {"json_model_override_args": '{"rope_scaling": null}'},
    ),
    "negated boolean": (["--sglang-no-enable-tf32-matmul"], {"enable_tf32_matmul": False}),
    "api key": (["--sglang-api-key", "k3y"], {"api_key": "k3y"}),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_launch_command_parses_with_sglang(sglang_cli, kind):
    argv, expected = CASES[kind]
    command = launch_command(argv)
    parsed = vars(sglang_cli.parser.parse_args(command))
    assert {field: parsed[field] for field in expected} == expected
    # What slime sets itself: --rollout-num-gpus-per-engine 2 is the tensor-parallel size.
    assert (parsed["model_path"], parsed["host"], parsed["port"]) == ("/models/tiny", "127.0.0.1", 30001)
    assert parsed["tp_size"] == 2
    assert (parsed["base_gpu_id"], parsed["nnodes"], parsed["node_rank"]) == (0, 1, 0)
    assert isinstance(parsed["nccl_port"], int) and parsed["nccl_port"] != 30001
    assert not parsed["enable_memory_saver"]
    emitted = {word.partition("=")[0] for word in command if word.startswith("--")}
    assert not emitted & sglang_cli.deprecated, f"deprecated SGLang options in {command}"


def test_multi_node_offload_command_parses_with_sglang(sglang_cli):
    command = launch_command(
        ["--offload-rollout", "--sglang-mem-fraction-static", "0.5"],
        base_gpu_id=4,
        nnodes=2,
        node_rank=1,
        dist_init_addr="10.0.0.1:5000",
    )
    parsed = sglang_cli.parser.parse_args(command)
    assert (parsed.dist_init_addr, parsed.nnodes, parsed.node_rank, parsed.base_gpu_id) == ("10.0.0.1:5000", 2, 1, 4)
    assert parsed.enable_memory_saver and parsed.mem_fraction_static == 0.5


@pytest.mark.parametrize(
    "command",
    [
        ["--mem-fraction-statik", "0.7"],  # no such option (a typo slime passes on where sglang is not installed)
        ["--disable-radix-cache", "1"],  # a value after a bare flag
        ["--cuda-graph-bs-decode"],  # a list option without values
        ["--mem-fraction-static", "0.5", "0.6"],  # two values for a one-value option
        ["--radix-eviction-policy", "fifo"],  # not one of its choices
        ["--chunked-prefill-size", "big"],  # not an int
    ],
    ids=["unknown", "value-after-flag", "missing-values", "extra-value", "bad-choice", "bad-type"],
)
def test_misshapen_commands_are_refused(sglang_cli, command):
    # The check above can fail: each of these is a command SGLang would refuse at launch.
    with pytest.raises(ValueError):
        sglang_cli.parser.parse_args(["--model-path", "/m", *command])


def test_fields_slime_sets_or_reads_are_sglang_fields(sglang_cli):
    # slime refuses the managed ones with a hint, and reads context_length / api_key (slime/utils/engine_args.py).
    used = set(SGLANG_MANAGED_FIELDS) | {"context_length", "api_key"}
    assert sorted(used - sglang_cli.fields) == []


def test_sglang_flags_in_recipes_and_docs_are_sglang_options(sglang_cli):
    files = [REPO / "README.md", *(REPO / "scripts").rglob("*.sh")]
    files += [path for folder in ("examples", "docs") for path in (REPO / folder).rglob("*") if path.suffix in
              (".sh", ".md", ".py", ".yaml")]  # fmt: skip
    unknown = {}
    for path in files:
        for name in re.findall(r"--sglang-([a-z0-9][a-z0-9-]*)", path.read_text(errors="replace")):
            if name.replace("-", "_") not in SLIME_SGLANG_FLAG_NAMES and f"--{name}" not in sglang_cli.options:
                unknown.setdefault(f"--sglang-{name}", set()).add(str(path.relative_to(REPO)))
    assert unknown == {}, f"not options of {sglang_cli.source}: {unknown}"


def test_table_matches_installed_sglang():
    installed = installed_sglang_cli()
    if installed is None:
        pytest.skip("sglang is not installed; the launch commands were checked against the table")
    import sglang

    table = json.loads(TABLE_PATH.read_text())
    if sglang.__version__ != table["sglang_version"]:
        pytest.skip(f"table is of sglang {table['sglang_version']}, installed {sglang.__version__}: regenerate it")
    assert describe_options(installed.parser, installed.fields) == table["options"]


def write_table(source: str) -> None:
    """Dump the installed sglang's server options to TABLE_PATH, one option per line."""
    import sglang

    cli = installed_sglang_cli()
    if cli is None:
        raise SystemExit("sglang is not importable: put an unpacked sglang wheel (and its imports) on PYTHONPATH")
    header = {
        "sglang_version": sglang.__version__,
        "commit": getattr(sglang, "__commit_id__", None),
        "read_from": source,
        "how": "describe_options(ServerArgs.add_cli_args parser); regenerate with tests/unit/test_sglang_launch_args.py",
    }
    rows = describe_options(cli.parser, cli.fields)
    body = ",\n".join("    " + json.dumps(row) for row in rows)
    text = json.dumps(header, indent=2)[:-2] + ',\n  "options": [\n' + body + "\n  ]\n}\n"
    TABLE_PATH.parent.mkdir(exist_ok=True)
    TABLE_PATH.write_text(text)
    print(f"wrote {len(rows)} options of sglang {sglang.__version__} to {TABLE_PATH}")


if __name__ == "__main__":
    cli_args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli_args.add_argument("--write", action="store_true", help="regenerate tests/support/data/sglang_server_args.json")
    cli_args.add_argument("--source", default="installed sglang", help="where the sglang that is dumped came from")
    options = cli_args.parse_args()
    if options.write:
        write_table(options.source)


def test_keyed_launch_hands_the_key_to_the_server_but_not_to_its_command_line(tmp_path):
    (tmp_path / "fake_server.py").write_text(
        "import json, os, sys\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')\n"
        f"print(json.dumps({{'argv': sys.argv[1:], 'cmdline': cmdline, 'env': os.environ.get('{ENGINE_API_KEY_ENV}')}}))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    launch = [sys.executable, "-m", "slime.backends.sglang_utils.keyed_launch", "fake_server", "--port", "1"]
    # Generated keys are URL-safe base64, so one in 64 starts with "-": it must still read as the key's value.
    keyed = subprocess.run(
        launch, env=env | {ENGINE_API_KEY_ENV: "-s3cret"}, capture_output=True, text=True, check=True
    )
    seen = json.loads(keyed.stdout)
    assert seen["argv"] == ["--port", "1", "--api-key=-s3cret"]
    server_parser = argparse.ArgumentParser()
    server_parser.add_argument("--port")
    server_parser.add_argument("--api-key")
    assert server_parser.parse_args(seen["argv"]).api_key == "-s3cret"
    assert "s3cret" not in " ".join(seen["cmdline"])  # what `ps` shows every local user
    assert seen["env"] is None  # nor do the server's own children inherit it
    unkeyed = subprocess.run(launch, env=env, capture_output=True, text=True, check=True)
    assert json.loads(unkeyed.stdout)["argv"] == ["--port", "1"]


def test_vision_language_launch_serves_images_from_the_checkpoint(sglang_cli, tiny_vlm_dir):
    """--multimodal-keys with a VL checkpoint: SGLang loads that folder with multimodal serving on; nothing in the
    command keeps the engine from reading images (no tokenizer-less start) and a text run leaves SGLang to decide."""
    vl = [*BASE[: BASE.index("--hf-checkpoint")], "--hf-checkpoint", str(tiny_vlm_dir)]
    vl += BASE[BASE.index("--hf-checkpoint") + 2 :]
    parsed = vars(sglang_cli.parser.parse_args(launch_command([*vl, "--multimodal-keys", '{"image": "images"}'])))
    assert parsed["model_path"] == str(tiny_vlm_dir)
    assert parsed["enable_multimodal"] is True and not parsed["skip_tokenizer_init"]
    assert not vars(sglang_cli.parser.parse_args(launch_command(vl)))["enable_multimodal"]
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as stderr:
        parse_args([*vl, "--multimodal-keys", '{"image": "images"}', "--sglang-enable-multimodal"])
    assert "--sglang-enable-multimodal is set by slime itself; use --multimodal-keys" in stderr.getvalue()
