import argparse
import dataclasses
import importlib.util
import json
import logging
import sys
import types

import pytest
import torch

from slime.utils.arguments import (
    ADVANTAGE_ESTIMATORS,
    KL_LOSS_TYPES,
    ArgumentValidationError,
    add_megatron_subset_arguments,
    add_slime_arguments,
    parse_args,
    validate_args,
)
from slime.utils.arguments.cluster import _copy_prefixed_actions
from slime.utils.arguments.validation import cpu_thread_counts
from slime.utils.mask_utils import LOSS_MASK_TYPES

# Explicit backends so these tests mean the same with or without CUDA.
BASE = [
    "--train-backend", "fsdp",
    "--rollout-backend", "cpu",
    "--actor-num-gpus-per-node", "1",
    "--hf-checkpoint", "/models/tiny",
    "--prompt-data", "/data/train.jsonl",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "2",  # GRPO (the default) needs at least 2 responses per prompt
    "--num-rollout", "2",
]  # fmt: skip

HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None


def without(argv, flag, n_values=1):
    """argv with `flag` and its values removed."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + n_values :]


# --- defaults ---------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the defaults of a machine without CUDA")
def test_cpu_defaults():
    args = parse_args(["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--rollout-batch-size", "4",
                       "--n-samples-per-prompt", "2", "--num-rollout", "1"])  # fmt: skip
    assert (args.train_backend, args.rollout_backend) == ("fsdp", "cpu")
    assert (args.actor_num_nodes, args.actor_num_gpus_per_node, args.num_gpus_per_node) == (1, 1, 1)
    assert (args.rollout_num_gpus, args.rollout_num_gpus_per_engine, args.rollout_num_engines) == (1, 1, 1)
    assert args.actor_world_size == 1
    assert args.distributed_backend == "gloo"
    assert (args.train_num_threads, args.cpu_engine_num_threads, args.cpu_engine_max_running_requests) == (1, 1, 32)
    assert (args.offload_train, args.offload_rollout, args.colocate) == (False, False, False)


def test_upstream_defaults():
    args = parse_args(BASE)
    # Megatron-named flags with slime's defaults.
    assert (args.lr, args.lr_decay_style, args.clip_grad, args.seed, args.micro_batch_size) == (
        1e-6, "constant", 1.0, 1234, 1,
    )  # fmt: skip
    assert args.update_weight_buffer_size == 512 * 1024 * 1024 == 536870912
    assert args.update_weights_interval == 1
    assert args.sglang_server_concurrency == 512
    assert args.sglang_router_request_timeout_secs == 14400
    assert args.rollout_function_path == "slime.rollout.sglang_rollout.generate_rollout"
    assert args.eval_function_path == args.rollout_function_path
    assert (args.rollout_temperature, args.rollout_top_p, args.rollout_top_k) == (1.0, 1.0, -1)
    assert (args.advantage_estimator, args.loss_type, args.kl_loss_type) == ("grpo", "policy_loss", "k1")
    assert args.eps_clip == 0.2 and args.eps_clip_high == 0.2
    assert args.over_sampling_batch_size == args.rollout_batch_size == 4
    assert args.rollout_global_dataset is True
    assert args.use_critic is False
    assert args.input_key == "input" and args.metadata_key == "metadata" and args.tool_key == "tools"
    assert (args.rollout_health_check_interval, args.rollout_health_check_timeout) == (30.0, 30.0)
    assert args.apply_chat_template_kwargs == {} and args.train_env_vars == {}


def test_eps_clip_high_follows_eps_clip_unless_given():
    assert parse_args(BASE + ["--eps-clip", "0.1"]).eps_clip_high == 0.1
    assert parse_args(BASE + ["--eps-clip", "0.1", "--eps-clip-high", "0.28"]).eps_clip_high == 0.28


# --- batch-size identity ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rollout_batch_size, n_samples, global_batch_size, num_steps, expected",
    [
        # 32 prompts x 8 samples = 256 samples per rollout in every row.
        (32, 8, None, None, (256, 1)),  # one step of everything
        (32, 8, 64, None, (64, 4)),  # 256 / 64 = 4 steps
        (32, 8, None, 2, (128, 2)),  # 256 / 2 = 128 per step
        (32, 8, 128, 2, (128, 2)),  # consistent as given
        (3, 2, None, None, (6, 1)),
    ],
)
def test_batch_size_identity(rollout_batch_size, n_samples, global_batch_size, num_steps, expected):
    argv = without(BASE, "--rollout-batch-size") + [
        "--rollout-batch-size", str(rollout_batch_size), "--n-samples-per-prompt", str(n_samples),
    ]  # fmt: skip
    if global_batch_size is not None:
        argv += ["--global-batch-size", str(global_batch_size)]
    if num_steps is not None:
        argv += ["--num-steps-per-rollout", str(num_steps)]
    args = parse_args(argv)
    assert (args.global_batch_size, args.num_steps_per_rollout) == expected


def test_inconsistent_batch_sizes_name_flags_and_numbers():
    argv = without(BASE, "--rollout-batch-size") + [
        "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
        "--global-batch-size", "100", "--num-steps-per-rollout", "2",
    ]  # fmt: skip
    with pytest.raises(ArgumentValidationError) as error:
        parse_args(argv)
    message = str(error.value)
    # 32 x 8 = 256 samples, but 100 x 2 = 200.
    for text in ["--rollout-batch-size (32)", "--n-samples-per-prompt (8)", "256", "--global-batch-size (100)",
                 "--num-steps-per-rollout (2)", "200"]:  # fmt: skip
        assert text in message


def test_global_batch_size_must_divide_samples():
    # 4 prompts x 3 samples = 12, not a multiple of 5.
    with pytest.raises(ArgumentValidationError, match=r"--global-batch-size \(5\)"):
        parse_args(BASE + ["--n-samples-per-prompt", "3", "--global-batch-size", "5"])


def test_rollout_batch_size_required():
    with pytest.raises(ArgumentValidationError, match="--rollout-batch-size"):
        parse_args(without(BASE, "--rollout-batch-size"))


# --- --sglang-* and --router-* forwarding -----------------------------------------------------


@pytest.fixture
def packages_missing(monkeypatch):
    """Make sglang and sglang-router unimportable, as on a CPU machine without them."""
    from slime.utils import arguments

    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", None)  # None in sys.modules -> ImportError
    monkeypatch.setitem(sys.modules, "sglang_router.router_args", None)
    arguments._sglang_source_parser.cache_clear()
    arguments._router_source_parser.cache_clear()
    yield
    arguments._sglang_source_parser.cache_clear()
    arguments._router_source_parser.cache_clear()


def test_generic_sglang_flags_are_typed_and_collected(packages_missing):
    args = parse_args(
        BASE
        + [
            "--sglang-mem-fraction-static", "0.8",
            "--sglang-enable-metrics",  # bare flag
            "--sglang-decode-log-interval", "1000",
            "--sglang-cuda-graph-bs", "1", "2", "4",
            "--sglang-log-level", "INFO",
            "--sglang-disable-radix-cache", "false",
            "--sglang-json-model-override-args", '{"rope_theta": 1000000}',
            "--sglang-random-seed", "-3",
            "--sglang-context-length=8192",
            # slime's own flags, never forwarded:
            "--sglang-server-concurrency", "64",
            "--sglang-router-ip", "10.0.0.1",
            "--sglang-router-port", "3000",
            "--sglang-router-request-timeout-secs", "60",
        ]
    )  # fmt: skip
    expected = {
        "mem_fraction_static": 0.8,
        "enable_metrics": True,
        "decode_log_interval": 1000,
        "cuda_graph_bs": [1, 2, 4],
        "log_level": "INFO",
        "disable_radix_cache": False,
        "json_model_override_args": {"rope_theta": 1000000},
        "random_seed": -3,
        "context_length": 8192,
    }
    assert args.sglang_server_args == expected
    for field, value in expected.items():
        assert getattr(args, f"sglang_{field}") == value
    assert type(args.sglang_decode_log_interval) is int and type(args.sglang_mem_fraction_static) is float
    assert (args.sglang_server_concurrency, args.sglang_router_ip, args.sglang_router_port) == (64, "10.0.0.1", 3000)
    assert args.sglang_router_request_timeout_secs == 60


def test_no_sglang_flags_gives_empty_dict(packages_missing):
    assert parse_args(BASE).sglang_server_args == {}


def test_generic_router_flags(packages_missing):
    args = parse_args(BASE + ["--router-policy", "round_robin", "--router-disable-circuit-breaker",
                              "--router-request-timeout-secs", "7200", "--sglang-router-port", "3000"])  # fmt: skip
    assert args.router_args == {"policy": "round_robin", "disable_circuit_breaker": True, "request_timeout_secs": 7200}
    assert args.router_policy == "round_robin" and args.router_request_timeout_secs == 7200
    assert args.sglang_router_port == 3000 and args.sglang_server_args == {}


@dataclasses.dataclass
class _StandInServerArgs:
    """A few fields shaped like sglang's ServerArgs, which cannot be installed without CUDA."""

    model_path: str = ""
    tp_size: int = 1
    mem_fraction_static: float | None = None
    enable_metrics: bool = False
    cuda_graph_bs: list[int] | None = None
    config: str | None = None

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", default="")
        parser.add_argument("--tp-size", type=int, default=1)
        parser.add_argument("--mem-fraction-static", type=float, default=None)
        parser.add_argument("--enable-metrics", action="store_true")
        parser.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
        parser.add_argument("--config", default=None)
        parser.add_argument("--not-a-field", type=int, default=3)


@pytest.fixture
def installed_sglang(monkeypatch):
    from slime.utils import arguments

    module = types.ModuleType("sglang.srt.server_args")
    module.ServerArgs = _StandInServerArgs
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    monkeypatch.setitem(sys.modules, "sglang.srt", types.ModuleType("sglang.srt"))
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", module)
    arguments._sglang_source_parser.cache_clear()
    yield
    arguments._sglang_source_parser.cache_clear()


def test_installed_sglang_fields_are_registered_with_their_types(installed_sglang, capsys):
    args = parse_args(BASE + ["--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2",
                              "--sglang-server-concurrency", "8"])  # fmt: skip
    # Every registered field, given or default; not the ones slime sets, nor non-fields, nor slime's --sglang-*.
    assert args.sglang_server_args == {"mem_fraction_static": 0.7, "enable_metrics": False, "cuda_graph_bs": [1, 2]}
    assert args.sglang_mem_fraction_static == 0.7 and args.sglang_server_concurrency == 8
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--sglang-mem-fraction-statik", "0.7"])
    assert "--sglang-mem-fraction-statik" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_ROUTER, reason="needs sglang-router")
def test_router_flags_use_router_args_types_and_defaults():
    from sglang_router.router_args import RouterArgs

    args = parse_args(BASE + ["--router-policy", "round_robin", "--router-disable-circuit-breaker",
                              "--router-request-timeout-secs", "7200"])  # fmt: skip
    assert args.router_policy == "round_robin" and args.router_args["policy"] == "round_robin"
    assert args.router_args["disable_circuit_breaker"] is True
    assert args.router_args["request_timeout_secs"] == 7200 and type(args.router_args["request_timeout_secs"]) is int
    # Fields not given keep RouterArgs' own defaults.
    defaults = {f.name: f.default for f in dataclasses.fields(RouterArgs) if f.default is not dataclasses.MISSING}
    assert args.router_args["max_payload_size"] == defaults["max_payload_size"]
    assert args.router_args["cache_threshold"] == defaults["cache_threshold"]
    # Host and port belong to slime (--sglang-router-ip/port), and slime's router flags stay out.
    assert "host" not in args.router_args and "port" not in args.router_args
    assert "router_request_timeout_secs" not in args.router_args


@pytest.mark.skipif(not HAS_ROUTER, reason="needs sglang-router")
def test_unknown_router_flag_is_an_error_when_router_is_installed(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--router-polcy", "round_robin"])
    assert "--router-polcy" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, hint",
    [("--sglang-model-path", "--hf-checkpoint"), ("--sglang-tp-size", "--rollout-num-gpus-per-engine"),
     ("--router-port", "--sglang-router-port")],
)  # fmt: skip
def test_flags_slime_sets_itself_are_refused(capsys, flag, hint):
    with pytest.raises(SystemExit):
        parse_args(BASE + [flag, "1"])
    err = capsys.readouterr().err
    assert flag in err and hint in err


# --- Megatron flags ---------------------------------------------------------------------------


def test_unknown_flag_under_fsdp_is_an_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--num-layers", "28", "--rollout-batch-sise", "8"])
    err = capsys.readouterr().err
    assert "--num-layers" in err and "--rollout-batch-sise" in err


def test_megatron_subset_parses_under_fsdp():
    args = parse_args(BASE + [
        "--lr", "2e-6", "--min-lr", "1e-7", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--clip-grad", "0.5",
        "--seed", "7", "--micro-batch-size", "2", "--save", "/ckpt", "--save-interval", "10",
        "--no-save-optim", "--tensor-model-parallel-size", "2", "--optimizer", "adam", "--calculate-per-token-loss",
    ])  # fmt: skip
    assert (args.lr, args.min_lr, args.lr_decay_style, args.lr_warmup_iters) == (2e-6, 1e-7, "cosine", 5)
    assert (args.weight_decay, args.adam_beta2, args.clip_grad, args.seed) == (0.1, 0.98, 0.5, 7)
    assert (args.micro_batch_size, args.save, args.save_interval, args.no_save_optim) == (2, "/ckpt", 10, True)
    assert args.tensor_model_parallel_size == 2 and args.calculate_per_token_loss is True


@pytest.mark.reliability(
    "--enable-mtp-training or --mtp-num-layers where MTP cannot train (FSDP, one without the other, pipeline or "
    "context parallelism, LoRA, routing replay, a checkpoint with fewer MTP layers or a family without them)",
    "refused at parse time, naming the flag, the checkpoint's num_nextn_predict_layers and the fix",
)
def test_mtp_training_is_refused_where_it_cannot_train(tmp_path):
    def checkpoint(model_type, layers):
        folder = tmp_path / f"{model_type}_{layers}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type, "num_nextn_predict_layers": layers}))
        return ["--hf-checkpoint", str(folder)]

    megatron = without(without(BASE, "--train-backend"), "--hf-checkpoint") + ["--train-backend", "megatron"]
    glm = checkpoint("glm4_moe", 1)
    cases = {
        "use --train-backend megatron": BASE + ["--enable-mtp-training"],
        "only --enable-mtp-training trains: add it": megatron + glm + ["--mtp-num-layers", "1"],
        "needs --mtp-num-layers N": megatron + glm + ["--enable-mtp-training"],
        "--pipeline-model-parallel-size 2 is not supported yet": megatron + glm
        + ["--enable-mtp-training", "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"],
        r"has 1 MTP layer\(s\) \(num_nextn_predict_layers": megatron + glm
        + ["--enable-mtp-training", "--mtp-num-layers", "2"],
        "with --use-rollout-routing-replay is not supported": megatron + glm
        + ["--enable-mtp-training", "--mtp-num-layers", "1", "--use-rollout-routing-replay"],
        "is a llama model; slime maps the MTP layers of deepseek_v3": megatron + checkpoint("llama", 0)
        + ["--enable-mtp-training", "--mtp-num-layers", "1"],
    }  # fmt: skip
    for message, argv in cases.items():
        with pytest.raises(ArgumentValidationError, match=message):
            parse_args(argv)
    args = parse_args(megatron + glm + ["--enable-mtp-training", "--mtp-num-layers", "1"])
    assert args.enable_mtp_training and args.mtp_num_layers == 1


@pytest.mark.skipif(importlib.util.find_spec("megatron") is not None, reason="megatron installed")
def test_megatron_backend_without_megatron_keeps_model_flags(caplog):
    with caplog.at_level(logging.WARNING, logger="slime.utils.arguments"):
        args = parse_args(without(BASE, "--train-backend") + [
            "--train-backend", "megatron", "--num-layers", "2", "--swiglu", "--normalization", "RMSNorm",
            "--rotary-base", "1000000", "--layernorm-epsilon", "1e-6",
        ])  # fmt: skip
    assert (args.num_layers, args.swiglu, args.normalization) == (2, True, "RMSNorm")
    assert args.rotary_base == 1000000 and args.layernorm_epsilon == 1e-6
    assert set(args.megatron_passthrough_args) == {"num_layers", "swiglu", "normalization", "rotary_base",
                                                   "layernorm_epsilon"}  # fmt: skip
    assert "--num-layers" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("megatron") is not None, reason="megatron installed")
def test_megatron_backend_without_megatron_catches_underscore_typos(capsys):
    argv = without(BASE, "--train-backend") + ["--train-backend", "megatron", "--n_samples_per_prompt", "4"]
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "--n-samples-per-prompt" in capsys.readouterr().err


def _fake_megatron_parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Stands in for megatron.training.arguments.parse_args: its own flags, then the provider, then sys.argv."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--lr-decay-style", default="linear")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--eval-interval", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save-interval", type=int, default=None)
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser = extra_args_provider(parser)
    assert ignore_unknown_args
    args, _ = parser.parse_known_args()
    return args


def test_megatron_parser_path(monkeypatch):
    fake = types.ModuleType("megatron.training.arguments")
    fake.parse_args = _fake_megatron_parse_args
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", fake)
    saved_argv = list(sys.argv)

    argv = without(BASE, "--train-backend") + ["--train-backend", "megatron", "--num-layers", "4",
                                               "--some-megatron-flag-we-do-not-know", "--lr", "3e-6"]  # fmt: skip
    args = parse_args(argv)
    assert sys.argv == saved_argv
    assert args.num_layers == 4 and args.lr == 3e-6  # given values pass through
    # Megatron's defaults replaced by slime's.
    assert (args.lr_decay_style, args.micro_batch_size, args.eval_interval) == ("constant", 1, None)
    expected_backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert args.distributed_backend == expected_backend
    assert args.global_batch_size == 8  # 4 prompts x 2 samples, derived by validate_args
    assert args.megatron_passthrough_args == {}


# --- eval data, JSON flags --------------------------------------------------------------------


def test_eval_prompt_data_pairs_single_and_repeated():
    args = parse_args(BASE + ["--eval-prompt-data", "gsm8k", "/e/gsm8k.jsonl", "aime", "/e/aime.jsonl",
                              "--eval-prompt-data", "math", "/e/math.parquet"])  # fmt: skip
    assert args.eval_prompt_data == [
        ("gsm8k", "/e/gsm8k.jsonl"),
        ("aime", "/e/aime.jsonl"),
        ("math", "/e/math.parquet"),
    ]


def test_eval_prompt_data_odd_count_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--eval-prompt-data", "gsm8k", "/e/gsm8k.jsonl", "aime"])
    err = capsys.readouterr().err
    assert "--eval-prompt-data" in err and "3 values" in err


def test_eval_interval_needs_eval_data():
    with pytest.raises(ArgumentValidationError, match="--eval-interval"):
        parse_args(BASE + ["--eval-interval", "5"])
    args = parse_args(BASE + ["--eval-interval", "5", "--eval-prompt-data", "gsm8k", "/e/gsm8k.jsonl"])
    assert args.eval_interval == 5


def test_json_flags():
    args = parse_args(BASE + ["--apply-chat-template-kwargs", '{"enable_thinking": false}',
                              "--train-env-vars", '{"NCCL_DEBUG": "INFO", "X": 1}'])  # fmt: skip
    assert args.apply_chat_template_kwargs == {"enable_thinking": False}
    assert args.train_env_vars == {"NCCL_DEBUG": "INFO", "X": 1}


@pytest.mark.parametrize("bad", ["{not json}", "[1, 2]"])
def test_json_flags_reject_non_objects(capsys, bad):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--apply-chat-template-kwargs", bad])
    assert "--apply-chat-template-kwargs" in capsys.readouterr().err


# --- placement and offload --------------------------------------------------------------------


def test_colocate_turns_on_offload_and_shares_actor_gpus(caplog):
    argv = without(BASE, "--actor-num-gpus-per-node") + [
        "--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "3", "--rollout-num-gpus", "2",
    ]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="slime.utils.arguments"):
        args = parse_args(argv)
    assert args.actor_world_size == 6  # 2 nodes x 3
    assert args.rollout_num_gpus == 6 and args.rollout_num_engines == 6
    assert (args.offload_train, args.offload_rollout) == (True, True)
    assert "--rollout-num-gpus" in caplog.text


def test_colocate_offload_can_be_turned_off():
    args = parse_args(BASE + ["--colocate", "--no-offload-train"])
    assert (args.offload_train, args.offload_rollout) == (False, True)


def test_offload_flag_without_colocate():
    args = parse_args(BASE + ["--offload", "--rollout-num-gpus", "1"])
    assert (args.offload_train, args.offload_rollout) == (True, True)


def test_disaggregated_sglang_needs_rollout_num_gpus():
    argv = without(BASE, "--rollout-backend") + ["--rollout-backend", "sglang", "--num-gpus-per-node", "8"]
    with pytest.raises(ArgumentValidationError, match="--rollout-num-gpus"):
        parse_args(argv)
    args = parse_args(argv + ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"])
    assert args.rollout_num_engines == 2  # 4 GPUs / 2 per engine
    with pytest.raises(ArgumentValidationError, match="--rollout-num-gpus-per-engine"):
        parse_args(argv + ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"])


def test_cpu_engines_come_from_gpu_counts():
    args = parse_args(BASE + ["--rollout-num-gpus", "2"])
    assert args.rollout_num_engines == 2


# --- algorithm --------------------------------------------------------------------------------


def test_ppo_uses_a_critic_and_offloads_train():
    args = parse_args(BASE + ["--advantage-estimator", "ppo", "--n-samples-per-prompt", "2"])
    assert args.use_critic is True and args.offload_train is True
    args = parse_args(BASE + ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "2"])
    assert args.use_critic is False and args.offload_train is False


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_normalizes_advantages(estimator):
    args = parse_args(BASE + ["--advantage-estimator", estimator, "--n-samples-per-prompt", "2"])
    assert args.normalize_advantages is True


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_every_estimator_is_accepted(estimator):
    assert parse_args(BASE + ["--advantage-estimator", estimator]).advantage_estimator == estimator


@pytest.mark.parametrize("kl_type", KL_LOSS_TYPES)
def test_every_kl_type_is_accepted(kl_type):
    args = parse_args(BASE + ["--use-kl-loss", "--kl-loss-coef", "0.001", "--kl-loss-type", kl_type])
    assert args.kl_loss_type == kl_type


def test_choice_lists_match_upstream():
    # Upstream's choices, plus what peers have (rloo, abs); see tests/unit/test_algorithm_registry.py.
    assert set(ADVANTAGE_ESTIMATORS) >= {"grpo", "gspo", "cispo", "reinforce_plus_plus",
                                         "reinforce_plus_plus_baseline", "ppo"}  # fmt: skip
    assert set(KL_LOSS_TYPES) >= {"k1", "k2", "k3", "low_var_kl"}


@pytest.mark.parametrize("flag, value", [("--advantage-estimator", "dpo"), ("--kl-loss-type", "k4"),
                                         ("--loss-type", "mse")])  # fmt: skip
def test_bad_choices_are_rejected(capsys, flag, value):
    with pytest.raises(SystemExit):
        parse_args(BASE + [flag, value])
    assert value in capsys.readouterr().err


def test_kl_loss_without_weight_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="slime.utils.arguments"):
        parse_args(BASE + ["--use-kl-loss"])
    assert "--kl-loss-coef" in caplog.text


def test_custom_loss_needs_its_path():
    with pytest.raises(ArgumentValidationError, match="--custom-loss-function-path"):
        parse_args(BASE + ["--loss-type", "custom_loss"])
    args = parse_args(BASE + ["--loss-type", "custom_loss", "--custom-loss-function-path", "my.loss.fn"])
    assert args.custom_loss_function_path == "my.loss.fn"


def test_temperature_must_be_positive():
    with pytest.raises(ArgumentValidationError, match="--rollout-temperature"):
        parse_args(BASE + ["--rollout-temperature", "0"])


# --- modes and required inputs ----------------------------------------------------------------


def test_debug_modes_exclude_each_other():
    with pytest.raises(ArgumentValidationError, match="--debug-rollout-only"):
        parse_args(BASE + ["--debug-rollout-only", "--debug-train-only"])
    with pytest.raises(ArgumentValidationError, match="--load-debug-rollout-data"):
        parse_args(BASE + ["--debug-rollout-only", "--load-debug-rollout-data", "/tmp/r_{rollout_id}.pt"])


def test_load_debug_rollout_data_implies_train_only():
    argv = without(BASE, "--prompt-data") + ["--load-debug-rollout-data", "/tmp/r_{rollout_id}.pt"]
    args = parse_args(argv)
    assert args.debug_train_only is True


def test_required_inputs_are_named():
    with pytest.raises(ArgumentValidationError, match="--hf-checkpoint"):
        parse_args(without(BASE, "--hf-checkpoint"))
    with pytest.raises(ArgumentValidationError, match="--prompt-data"):
        parse_args(without(BASE, "--prompt-data"))
    with pytest.raises(ArgumentValidationError, match="--num-rollout"):
        parse_args(without(BASE, "--num-rollout"))
    # A rollout function that brings its own prompts, or an epoch count, is enough.
    assert parse_args(without(BASE, "--prompt-data") + ["--disable-rollout-global-dataset"]).prompt_data is None
    args = parse_args(without(BASE, "--num-rollout") + ["--num-epoch", "3"])
    assert args.num_rollout is None and args.num_epoch == 3


def test_over_sampling_batch_size_at_least_rollout_batch_size():
    with pytest.raises(ArgumentValidationError, match="--over-sampling-batch-size"):
        parse_args(BASE + ["--over-sampling-batch-size", "2"])
    assert parse_args(BASE + ["--over-sampling-batch-size", "8"]).over_sampling_batch_size == 8


def test_dynamic_batch_size_needs_token_budget():
    with pytest.raises(ArgumentValidationError, match="--max-tokens-per-gpu"):
        parse_args(BASE + ["--use-dynamic-batch-size"])
    args = parse_args(BASE + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"])
    assert args.log_probs_max_tokens_per_gpu == 4096


def test_delta_weight_sync_needs_the_disk_transport():
    with pytest.raises(
        ArgumentValidationError, match="--update-weight-mode delta needs --update-weight-transport disk"
    ):
        parse_args(BASE + ["--update-weight-mode", "delta"])


def test_save_interval_needs_save():
    with pytest.raises(ArgumentValidationError, match="--save"):
        parse_args(BASE + ["--save-interval", "10"])


def test_validate_args_is_idempotent():
    args = parse_args(BASE + ["--colocate", "--n-samples-per-prompt", "1", "--advantage-estimator",
                              "reinforce_plus_plus"])  # fmt: skip
    before = dict(vars(args))
    validate_args(args)
    assert vars(args) == before


def test_public_builders_compose_into_one_parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_subset_arguments(add_slime_arguments(parser))
    args = parser.parse_args(["--rollout-batch-size", "8", "--lr", "1e-5"])
    assert args.rollout_batch_size == 8 and args.lr == 1e-5


def test_thread_budget_over_core_count_warns(monkeypatch, caplog):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="slime.utils.arguments"):
        parse_args(BASE + ["--train-num-threads", "1", "--cpu-engine-num-threads", "1"])  # 1 + 1 = 2 cores: fine
    assert "cores" not in caplog.text
    # train.py runs trainer and engine one after the other: 2 + 1 threads on 2 cores is fine there ...
    with caplog.at_level(logging.WARNING, logger="slime.utils.arguments"):
        args = parse_args(BASE + ["--train-num-threads", "2", "--cpu-engine-num-threads", "1"])
    assert "cores" not in caplog.text
    assert cpu_thread_counts(args) == (2, 1)  # ... train_async.py, running both at once, warns on the sum
    with caplog.at_level(logging.WARNING, logger="slime.utils.arguments"):
        parse_args(BASE + ["--train-num-threads", "3", "--cpu-engine-num-threads", "1"])  # one side alone: 3 > 2
    assert "3 trainer threads exceed the 2 cores" in caplog.text and "--train-num-threads" in caplog.text


def test_help_lists_the_groups(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for title in ["cluster", "CPU budgets", "rollout", "sampling", "data", "eval", "algorithm and loss", "reward",
                  "buffer", "checkpoint", "logging", "debug", "fault tolerance", "CI", "optimizer (Megatron names)"]:  # fmt: skip
        assert f"\n{title}" in out


@pytest.mark.parametrize("value", ["0", "-5"])
def test_peak_tflops_must_be_positive(value):
    with pytest.raises(ArgumentValidationError, match=f"--peak-tflops {float(value)}: .* a positive number"):
        parse_args(BASE + ["--peak-tflops", value])


def test_prefixed_copies_of_on_off_options_keep_their_negative_form():
    source = argparse.ArgumentParser()
    source.add_argument("--enable-tf32-matmul", action=argparse.BooleanOptionalAction, default=None)
    target = argparse.ArgumentParser()
    _copy_prefixed_actions(source._actions[1:], target.add_argument_group("sglang"), "sglang-")
    assert target.parse_args(["--sglang-enable-tf32-matmul"]).sglang_enable_tf32_matmul is True
    assert target.parse_args(["--sglang-no-enable-tf32-matmul"]).sglang_enable_tf32_matmul is False
    assert target.parse_args([]).sglang_enable_tf32_matmul is None


def test_every_upstream_loss_mask_type_parses_and_others_are_refused():
    for mask_type in LOSS_MASK_TYPES:
        assert parse_args(BASE + ["--loss-mask-type", mask_type]).loss_mask_type == mask_type
    assert "qwen3_5" in LOSS_MASK_TYPES
    with pytest.raises(ArgumentValidationError, match="--loss-mask-type .* use one of qwen, qwen3, qwen3_5"):
        parse_args(BASE + ["--loss-mask-type", "qwen4"])
