"""slime.utils.engine_args: the context limit, failover window and API key read off the arguments, one copy for
the default rollout, the multi-turn helpers, the agent rollout and the engine launchers."""

import json

import pytest
from support.flags import slime_flags

from slime.agent import multi_turn
from slime.backends.sglang_utils import engine_command_line
from slime.rollout import sglang_rollout
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.engine_args import context_limit, engine_api_key, engine_context_length, engine_failover_window


def test_context_length_is_the_sglang_flag_on_sglang_and_the_model_config_on_cpu(tiny_model_dir):
    positions = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    flagged = {
        "hf_checkpoint": str(tiny_model_dir),
        "trust_remote_code": False,
        "sglang_server_args": {"context_length": 2048},
    }
    assert engine_context_length(slime_flags(**flagged, rollout_backend="sglang")) == 2048
    assert (
        engine_context_length(slime_flags(**flagged, rollout_backend="cpu")) == positions
    )  # the CPU engine ignores it
    assert engine_context_length(slime_flags(hf_checkpoint=str(tiny_model_dir), trust_remote_code=False)) == positions


def test_context_limit_is_the_requested_length_never_past_the_engine(tiny_model_dir):
    positions = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    args = slime_flags(
        hf_checkpoint=str(tiny_model_dir),
        trust_remote_code=False,
        rollout_max_context_len=None,
        eval_max_context_len=None,
    )
    assert context_limit(args) == context_limit(args, evaluation=True) == positions - 1
    args.rollout_max_context_len, args.eval_max_context_len = 100, 200
    assert (context_limit(args), context_limit(args, evaluation=True)) == (100, 200)
    args.eval_max_context_len = positions * 2
    assert context_limit(args, evaluation=True) == positions - 1


def test_failover_window_covers_one_health_round_with_fault_tolerance_only():
    health = {"rollout_health_check_first_wait": 5.0, "rollout_health_check_interval": 2.0}
    args = slime_flags(**health, rollout_health_check_timeout=1.5, use_fault_tolerance=False)
    assert engine_failover_window(args) == 0.0
    args.use_fault_tolerance = True
    assert engine_failover_window(args) == 5.0 + 2.0 + 1.5 + 30.0


def test_api_key_comes_from_the_sglang_flags_or_the_slime_flag():
    assert engine_api_key(slime_flags(sglang_server_args={"api_key": "k1"}, sglang_api_key="k2")) == "k1"
    assert engine_api_key(slime_flags(sglang_server_args={"api-key": "k1"})) == "k1"
    assert engine_api_key(slime_flags(sglang_server_args={}, sglang_api_key="k2")) == "k2"
    assert engine_api_key(slime_flags(sglang_server_args={}, sglang_api_key="")) is None
    assert engine_api_key(slime_flags()) is None


def test_the_old_import_paths_name_the_same_functions():
    assert engine_command_line.engine_api_key is sglang_rollout.engine_api_key is engine_api_key
    assert sglang_rollout.context_limit is multi_turn.context_limit is context_limit


def test_sglang_dtype_sets_the_cpu_engines_dtype_and_refuses_what_rounding_breaks():
    from slime.backends.cpu_engine.server import parse_args as engine_parse_args

    def engine_dtype(sglang_dtype: str | None) -> str:
        flags = {"sglang_server_args": {"dtype": sglang_dtype} if sglang_dtype else {}}
        cli = engine_command_line.build_cpu_engine_args(slime_flags(**flags), model_path="/m", host="127.0.0.1", port=5)
        return engine_parse_args(cli).dtype

    spelled = {None: "float32", "auto": "float32", "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}
    assert {given: engine_dtype(given) for given in spelled} == spelled
    assert engine_dtype("half") == engine_dtype("float16") == "float16"

    base = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2"]
    base += ["--n-samples-per-prompt", "2", "--rollout-backend", "cpu", "--sglang-dtype"]
    assert parse_args([*base, "bfloat16"]).sglang_server_args == {"dtype": "bfloat16"}
    with pytest.raises(ArgumentValidationError, match="--sglang-dtype int8: the CPU engine runs auto, float32"):
        parse_args([*base, "int8"])
    for extra in (["--use-fault-tolerance"], ["--check-weight-update-equal"], ["--true-on-policy-mode"]):
        with pytest.raises(ArgumentValidationError, match=f"{extra[0]} with .*--sglang-dtype"):
            parse_args([*base, "bfloat16", *extra])
