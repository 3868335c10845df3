"""slime's command line: one parser for three kinds of flags.

1. Megatron flags (`--tensor-model-parallel-size`, `--lr`, `--num-layers`, ...).
   With `--train-backend megatron` and Megatron-LM's `megatron.training` importable, Megatron's
   own parser reads them and every Megatron flag passes through untouched; slime only changes a few
   defaults (see `MEGATRON_DEFAULT_OVERRIDES`). Otherwise slime registers the subset of Megatron
   flags it reads itself, under Megatron's names. Under `--train-backend fsdp` any other flag is an
   error (so typos are caught). Under `--train-backend megatron` without `megatron.training` (the
   pip wheel of megatron-core ships only `megatron.core`), unknown flags such as the model flags of
   `scripts/models/*.sh` are kept as typed values (`args.num_layers == 28`) and listed in
   `args.megatron_passthrough_args`, with a warning, because no Megatron parser exists to check them.
2. `--sglang-<flag>` goes to every SGLang engine and `--router-<flag>` to sglang-router. With the
   package installed, each field of its `ServerArgs` / `RouterArgs` is registered with its own type
   and default, and `args.sglang_server_args` / `args.router_args` hold every registered field.
   Without it (the CPU case for SGLang) any `--sglang-xxx [values]` is accepted: a bare flag is True,
   one value is typed (int, float, true/false, JSON list/object, else str), several values make a
   list; the dicts then hold only the flags given. Each value is also `args.sglang_<field>` /
   `args.router_<field>`. slime's own `--sglang-router-ip`, `--sglang-router-port`,
   `--sglang-router-request-timeout-secs`, `--sglang-server-concurrency` and `--sglang-config` are
   never forwarded.
3. slime's own flags, grouped as in `--help`.

Every registered flag has an effect: it is read after parsing, consumed by the parser itself
(`PARSE_TIME_FLAGS`), or refused at parse time with the reason and the alternative (`REFUSED_FLAGS`;
tests/test_every_flag.py keeps it so).

Errors: a malformed command line (unknown flag, bad choice, bad JSON, odd `--eval-prompt-data`
count) exits through argparse with status 2. A well-formed but inconsistent one (checked by
`validate_args`) raises `ArgumentValidationError`, whose message names the flags and the fix.

On a machine without CUDA the defaults switch to `--train-backend fsdp --rollout-backend cpu`,
one trainer process (`--actor-num-gpus-per-node 1`), one "GPU" per node and one rollout engine.
There a "GPU" in the `*-num-gpus*` flags is one CPU slot: trainer processes for the actor, engine
slots for rollout, so the number of CPU engines is
`--rollout-num-gpus / --rollout-num-gpus-per-engine`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import json
import logging
import os
import re
import sys
from typing import Any

import torch
import yaml

from slime import algorithms
from slime.algorithms.aggregation import default_loss_agg_mode
from slime.algorithms.policy_losses import loss_kind
from slime.utils.mask_utils import LOSS_MASK_TYPES

logger = logging.getLogger(__name__)

DEFAULT_ROLLOUT_FUNCTION_PATH = "slime.rollout.sglang_rollout.generate_rollout"
DEFAULT_DATA_SOURCE_PATH = "slime.rollout.data_source.RolloutDataSourceWithBuffer"

# The built-in algorithm names; the flags take their choices from the registries when the parser is built,
# so names registered by --custom-algorithm-module modules are valid too.
ADVANTAGE_ESTIMATORS = algorithms.ADVANTAGE_ESTIMATORS.names()
KL_LOSS_TYPES = algorithms.KL_ESTIMATORS.names()
LOSS_TYPES = algorithms.loss_type_choices()

# slime changes these Megatron defaults; the same values are the defaults of the fallback subset.
MEGATRON_DEFAULT_OVERRIDES: dict[str, Any] = {
    "lr": 1e-6,
    "lr_decay_style": "constant",
    "micro_batch_size": 1,
    "eval_interval": None,
    "seed": 1234,
    "clip_grad": 1.0,
    "distributed_timeout_minutes": 10,
}

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

_INT_PATTERN = re.compile(r"[-+]?\d+")
_FLOAT_PATTERN = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ArgumentValidationError(ValueError):
    """A combination of flags that cannot work; the message names the flags and the fix."""


# ---------------------------------------------------------------------------------------------
# Small argparse helpers
# ---------------------------------------------------------------------------------------------


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


def _copy_prefixed_actions(actions: list[argparse.Action], group: argparse._ArgumentGroup, flag_prefix: str) -> None:
    """Re-register each `--x` option as `--{flag_prefix}x` with dest `{flag_prefix}x` (dashes as "_").

    Type, default, nargs, choices and action class stay the package's own.
    """
    dest_prefix = flag_prefix.replace("-", "_")
    for action in actions:
        prefixed = copy.copy(action)
        prefixed.option_strings = [f"--{flag_prefix}{opt[2:]}" for opt in action.option_strings if opt.startswith("--")]
        prefixed.dest = dest_prefix + action.dest
        group._add_action(prefixed)


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
    fields = {f.name for f in dataclasses.fields(server_args.ServerArgs)}
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


# ---------------------------------------------------------------------------------------------
# slime's own flags
# ---------------------------------------------------------------------------------------------


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


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("train and weight sync")
    group.add_argument(
        "--train-env-vars",
        type=_json_object,
        default={},
        help='Extra environment variables for the trainer processes, as JSON: \'{"NCCL_DEBUG": "INFO"}\'.',
    )
    group.add_argument(
        "--update-weight-mode",
        choices=["full", "delta"],
        default="full",
        help="Push all weights, or only xor-encoded changes (delta needs --update-weight-transport disk).",
    )
    group.add_argument(
        "--update-weight-transport",
        choices=["nccl", "disk"],
        default="nccl",
        help="Disaggregated weight push: a collective broadcast from trainer to engines (gloo on CPU), "
        "or HF safetensors written to --update-weight-disk-dir.",
    )
    group.add_argument("--update-weight-disk-dir", default=None, help="Shared directory for disk weight sync.")
    group.add_argument(
        "--update-weight-disk-keep-files", action="store_true", help="Keep the files of each disk weight sync."
    )
    group.add_argument("--update-weight-delta-encoding", choices=["xor"], default="xor", help="Delta encoding.")
    group.add_argument("--update-weight-delta-checksum", default="xxh3-128", help="Checksum of each delta.")
    group.add_argument(
        "--update-weight-local-checkpoint-dir", default=None, help="Engine-local directory delta sync writes to."
    )
    group.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=512 * 1024**2,
        help="Bytes of parameters sent per weight-update bucket (default: 512 MiB).",
    )
    group.add_argument(
        "--update-weights-interval",
        type=int,
        default=1,
        help="Push weights to the engines every this many rollouts (train_async.py).",
    )
    group.add_argument(
        "--release-train",
        action="store_true",
        help="Kill the train actors after each step and recreate them from the checkpoint.",
    )
    group.add_argument(
        "--keep-old-actor",
        action="store_true",
        help="Take the old log-probs from the weights the engines generated the rollout with (kept on CPU for the "
        "last two pushes), not the current ones: train_async.py trains one push behind. FSDP only.",
    )
    group.add_argument(
        "--recompute-loss-function", action="store_true", help="Recompute the loss in backward to save memory."
    )
    group.add_argument(
        "--log-probs-chunk-size", type=int, default=-1, help="Tokens per log-prob chunk; -1 means no chunking."
    )
    group.add_argument(
        "--only-train-params-name-list",
        nargs="+",
        default=None,
        help="Train only the parameters whose name matches one of these regexes (re.search). FSDP only.",
    )
    group.add_argument(
        "--freeze-params-name-list",
        nargs="+",
        default=None,
        help="Freeze the parameters whose name matches one of these regexes (re.search). FSDP only.",
    )
    group.add_argument("--allgather-cp", action="store_true", help="All-gather context-parallel chunks (DSA models).")
    group.add_argument("--qwen-gdn-backend", default="fla", help="Kernel backend for Qwen gated delta-net layers.")
    group.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="FSDP backend: recompute each decoder layer's activations in backward "
        "(the Megatron backend uses Megatron's --recompute-* flags).",
    )
    group.add_argument("--custom-megatron-init-path", default=None, help="f(args), run after Megatron init.")
    group.add_argument(
        "--custom-megatron-before-log-prob-hook-path",
        default=None,
        help="f(args, model, store_prefix), run before each log-prob pass.",
    )
    group.add_argument(
        "--custom-megatron-before-train-step-hook-path",
        default=None,
        help="f(args, rollout_id, step_id, model, optimizer, opt_param_scheduler), run before each step.",
    )
    group.add_argument(
        "--custom-model-provider-path", default=None, help="f(pre_process, post_process, vp_stage) -> model."
    )
    group.add_argument(
        "--custom-update-weight-post-write-path",
        default=None,
        help="f(args, version_dir, engines), run after a disk weight sync wrote its files.",
    )


def _add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rollout")
    group.add_argument("--hf-checkpoint", default=None, help="HF model folder: engine weights, tokenizer, config.")
    group.add_argument("--model-name", default=None, help="Model family for weight-name conversion.")
    group.add_argument(
        "--rollout-function-path",
        default=DEFAULT_ROLLOUT_FUNCTION_PATH,
        help="generate_rollout(args, rollout_id, data_source, evaluation=False) producing the samples.",
    )
    group.add_argument(
        "--custom-generate-function-path",
        default=None,
        help="async generate(args, sample, sampling_params) -> Sample | list[Sample], replacing one generation.",
    )
    group.add_argument(
        "--rollout-sample-hook-path",
        nargs="+",
        action="extend",
        default=None,
        help="[async] hook(args, sample, *, rollout_id, evaluation) -> Sample | None before reward; repeatable.",
    )
    group.add_argument("--rollout-shuffle", action="store_true", help="Shuffle the prompt dataset.")
    group.add_argument("--rollout-seed", type=int, default=42, help="Seed for shuffling and sampling.")
    group.add_argument(
        "--over-sampling-batch-size",
        type=int,
        default=None,
        help="Prompts submitted per round when a dynamic filter may drop groups (default: --rollout-batch-size).",
    )
    group.add_argument(
        "--dynamic-sampling-filter-path",
        default=None,
        help="f(args, samples, **kw) -> DynamicFilterOutput | bool, deciding whether a group is kept.",
    )
    group.add_argument(
        "--partial-rollout",
        action="store_true",
        help="Keep unfinished generations aborted at the end of a rollout and continue them next time.",
    )
    group.add_argument(
        "--mask-offpolicy-in-partial-rollout",
        action="store_true",
        help="Mask the tokens a partial rollout generated with older weights out of the loss.",
    )
    group.add_argument(
        "--rollout-data-transport",
        choices=["object-store", "nixl"],
        default="object-store",
        help="How rollout data reaches the trainers.",
    )
    group.add_argument(
        "--rollout-external-engine-addrs",
        nargs="+",
        default=None,
        help="host:port of engines started outside slime, used instead of launching engines.",
    )
    group.add_argument(
        "--rollout-engine-start-timeout",
        type=float,
        default=600.0,
        help="Seconds an inference engine may take to become healthy before the run fails with its log tail.",
    )
    group.add_argument(
        "--custom-rollout-log-function-path",
        default=None,
        help="f(rollout_id, args, samples, extra_metrics, rollout_time) -> bool; True skips default logging.",
    )
    group.add_argument(
        "--custom-eval-rollout-log-function-path",
        default=None,
        help="f(rollout_id, args, data, extra_metrics) -> bool; True skips default logging.",
    )
    group.add_argument(
        "--rollout-data-postprocess-path", default=None, help="f(args, rollout_id, rollout_data) on the trainer."
    )

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


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--rollout-temperature", type=float, default=1.0, help="Sampling temperature (> 0).")
    group.add_argument("--rollout-top-p", type=float, default=1.0, help="Nucleus sampling threshold.")
    group.add_argument("--rollout-top-k", type=int, default=-1, help="Top-k sampling; -1 disables it.")
    group.add_argument(
        "--rollout-max-context-len",
        type=int,
        default=None,
        help="Prompt + response token limit (default: the engine's).",
    )
    group.add_argument("--rollout-max-prompt-len", type=int, default=None, help="Drop prompts longer than this.")
    group.add_argument(
        "--rollout-max-response-len",
        type=int,
        default=None,
        help="Max new tokens per response (default: whatever the context leaves after the prompt).",
    )
    group.add_argument(
        "--rollout-skip-special-tokens", action="store_true", help="Strip special tokens from response text."
    )
    group.add_argument("--rollout-stop", nargs="+", default=None, help="Stop strings.")
    group.add_argument("--rollout-stop-token-ids", nargs="+", type=int, default=None, help="Stop token ids.")


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--num-rollout", type=int, default=None, help="Rollout steps to run.")
    group.add_argument(
        "--num-epoch",
        type=int,
        default=None,
        help="Epochs over the prompt data; --num-rollout is then derived from the dataset size.",
    )
    group.add_argument(
        "--disable-rollout-global-dataset",
        dest="rollout_global_dataset",
        action="store_false",
        help="Do not load --prompt-data; the rollout function brings its own prompts.",
    )
    group.add_argument(
        "--data-source-path",
        default=DEFAULT_DATA_SOURCE_PATH,
        help="Class with get_samples(n), add_samples, save(id), load(id), __len__ feeding the rollout.",
    )
    group.add_argument("--prompt-data", default=None, help="Training prompts: .jsonl or .parquet.")
    group.add_argument("--input-key", default="input", help="Field holding the prompt (text or messages).")
    group.add_argument("--label-key", default=None, help="Field holding the label for the reward.")
    group.add_argument("--metadata-key", default="metadata", help="Field holding per-sample metadata.")
    group.add_argument("--tool-key", default="tools", help="Field holding tool definitions for the chat template.")
    group.add_argument(
        "--multimodal-keys",
        type=_json_object,
        default=None,
        help='Multimodal fields as JSON, e.g. \'{"image": "images"}\'.',
    )
    group.add_argument("--apply-chat-template", action="store_true", help="Render prompts with the chat template.")
    group.add_argument(
        "--apply-chat-template-kwargs",
        type=_json_object,
        default={},
        help="Extra apply_chat_template arguments as JSON, e.g. '{\"enable_thinking\": false}'.",
    )
    group.add_argument(
        "--start-rollout-id",
        type=int,
        default=None,
        help="First rollout id (default: continue from the loaded checkpoint, else 0).",
    )
    group.add_argument("--rollout-batch-size", type=int, default=None, help="Prompts per rollout step.")
    group.add_argument("--n-samples-per-prompt", type=int, default=1, help="Responses generated per prompt.")
    group.add_argument(
        "--num-steps-per-rollout",
        type=int,
        default=None,
        help="Optimizer steps per rollout (default: derived from --global-batch-size, else 1).",
    )
    group.add_argument("--balance-data", action="store_true", help="Balance tokens across data-parallel ranks.")
    group.add_argument("--balance-by-flops", action="store_true", help="Balance by estimated FLOPs, not tokens.")
    group.add_argument(
        "--use-dynamic-batch-size",
        action="store_true",
        help="Pack micro-batches up to --max-tokens-per-gpu tokens instead of --micro-batch-size samples.",
    )
    group.add_argument("--max-tokens-per-gpu", type=int, default=None, help="Token budget of one micro-batch.")
    group.add_argument(
        "--log-probs-max-tokens-per-gpu",
        type=int,
        default=None,
        help="Token budget for log-prob passes (default: --max-tokens-per-gpu).",
    )


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("eval")
    group.add_argument(
        "--eval-function-path", default=None, help="Eval rollout function (default: --rollout-function-path)."
    )
    group.add_argument(
        "--eval-prompt-data",
        nargs="+",
        action=_NamePathPairs,
        default=None,
        metavar="NAME PATH",
        help="Eval datasets as name/path pairs; repeatable. Stored as [(name, path), ...].",
    )
    group.add_argument("--eval-config", default=None, help="YAML describing eval datasets and their settings.")
    group.add_argument("--skip-eval-before-train", action="store_true", help="No eval at rollout 0.")
    group.add_argument("--eval-input-key", default=None, help="Prompt field of eval data (default: --input-key).")
    group.add_argument("--eval-label-key", default=None, help="Label field of eval data (default: --label-key).")
    group.add_argument("--eval-tool-key", default=None, help="Tools field of eval data (default: --tool-key).")
    group.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="Responses per eval prompt.")
    group.add_argument("--eval-temperature", type=float, default=None, help="(default: the rollout value)")
    group.add_argument("--eval-top-p", type=float, default=None, help="(default: the rollout value)")
    group.add_argument("--eval-top-k", type=int, default=None, help="(default: the rollout value)")
    group.add_argument("--eval-max-response-len", type=int, default=None, help="(default: the rollout value)")
    group.add_argument("--eval-max-prompt-len", type=int, default=None, help="(default: the rollout value)")
    group.add_argument("--eval-min-new-tokens", type=int, default=None, help="Minimum new tokens in eval.")
    group.add_argument("--eval-max-context-len", type=int, default=None, help="(default: the rollout value)")


def _add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("algorithm and loss")
    group.add_argument(
        "--custom-algorithm-module",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="Dotted module paths imported at startup, before the algorithm flags are checked, and in every "
        "trainer process. Their @register_advantage_estimator / @register_policy_loss / @register_kl_estimator "
        "/ @register_loss_aggregation functions (slime.algorithms) become choices of --advantage-estimator, "
        "--loss-type, --kl-loss-type and --loss-agg-mode.",
    )
    group.add_argument(
        "--advantage-estimator",
        choices=algorithms.ADVANTAGE_ESTIMATORS.names(),
        default="grpo",
        help="rloo: leave-one-out baseline; grpo / gspo / cispo / rloo / reinforce_plus_plus_baseline need "
        "--n-samples-per-prompt >= 2.",
    )
    group.add_argument(
        "--loss-type",
        choices=algorithms.loss_type_choices(),
        default="policy_loss",
        help="A registered policy loss (policy_loss = PPO clip, or the estimator's own: gspo, cispo), "
        "sft_loss, or custom_loss (needs --custom-loss-function-path).",
    )
    group.add_argument(
        "--custom-loss-function-path",
        default=None,
        help="f(args, batch, logits, sum_of_sample_mean) -> (loss, metrics) for --loss-type custom_loss.",
    )
    group.add_argument(
        "--custom-advantage-function-path",
        default=None,
        help="f(args, rollout_data) setting 'advantages' and 'returns', replacing the estimator.",
    )
    group.add_argument(
        "--custom-pg-loss-reducer-function-path",
        default=None,
        help="Upstream's pg-loss reducer hook; refused: register a loss aggregation and pick it with --loss-agg-mode.",
    )
    group.add_argument("--eps-clip", type=float, default=0.2, help="Lower PPO clip range.")
    group.add_argument("--eps-clip-high", type=float, default=None, help="Upper PPO clip range (default: --eps-clip).")
    group.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip bound for negative advantages.")
    group.add_argument("--value-clip", type=float, default=0.2, help="Critic value clip range.")
    group.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward.")
    group.add_argument("--use-kl-loss", action="store_true", help="Add a KL-to-reference term to the loss.")
    group.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss.")
    group.add_argument(
        "--kl-loss-type",
        choices=algorithms.KL_ESTIMATORS.names(),
        default="k1",
        help="KL estimator of the KL loss and of the --kl-coef reward penalty.",
    )
    group.add_argument(
        "--loss-agg-mode",
        choices=algorithms.LOSS_AGGREGATIONS.names(),
        default=None,
        help="How per-token losses become the step's loss (default: token-mean with --calculate-per-token-loss, "
        "else seq-mean-token-mean). seq-mean-token-sum-norm (Dr. GRPO) divides by --rollout-max-response-len.",
    )
    group.add_argument("--use-unbiased-kl", action="store_true", help="Importance-weight the KL loss.")
    group.add_argument("--entropy-coef", type=float, default=0.0, help="Entropy bonus weight.")
    group.add_argument("--gamma", type=float, default=1.0, help="Discount (ppo, reinforce_plus_plus).")
    group.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (ppo).")
    group.add_argument("--normalize-advantages", action="store_true", help="Whiten advantages over the batch.")
    group.add_argument(
        "--disable-grpo-std-normalization",
        action="store_true",
        help="Only subtract the group mean from rewards (Dr.GRPO).",
    )
    group.add_argument("--disable-rewards-normalization", action="store_true", help="Use raw rewards.")
    group.add_argument(
        "--disable-compute-advantages-and-returns",
        action="store_true",
        help="Do not compute advantages and returns before the loss (SFT: --loss-type sft_loss uses neither).",
    )
    group.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="Use the engines' log-probs as old log-probs instead of recomputing them.",
    )
    group.add_argument("--use-tis", action="store_true", help="Truncated importance sampling on rollout log-probs.")
    group.add_argument("--tis-clip", type=float, default=2.0, help="Upper bound of the TIS weight.")
    group.add_argument("--tis-clip-low", type=float, default=0.0, help="Lower bound of the TIS weight.")
    group.add_argument(
        "--custom-tis-function-path",
        default=None,
        help="f(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths).",
    )
    group.add_argument(
        "--get-mismatch-metrics",
        action="store_true",
        help="Log the train/rollout log-prob gap and train/train_rollout_kl, also under --use-rollout-logprobs "
        "(FSDP only).",
    )
    group.add_argument("--use-opsm", action="store_true", help="Off-policy sequence masking.")
    group.add_argument("--opsm-delta", type=float, default=1e-4, help="OPSM threshold.")
    group.add_argument("--use-routing-replay", action="store_true", help="MoE: replay the old routing in training.")
    group.add_argument(
        "--use-rollout-routing-replay", action="store_true", help="MoE: replay the engines' routed experts."
    )
    group.add_argument("--use-rollout-entropy", action="store_true", help="Log entropy of the rollout policy.")
    group.add_argument("--ref-load", default=None, help="Reference model checkpoint (default: the actor's start).")
    group.add_argument("--ref-ckpt-step", type=int, default=None, help="Step of --ref-load to use.")
    group.add_argument(
        "--ref-update-interval",
        type=int,
        default=None,
        help="Copy the actor's weights into the reference model every this many rollouts. FSDP only.",
    )
    group.add_argument(
        "--num-critic-only-steps", type=int, default=0, help="ppo: train only the critic for the first steps."
    )
    group.add_argument("--megatron-config-path", default=None, help="YAML of Megatron overrides per role.")
    group.add_argument(
        "--reset-optimizer-states",
        action="store_true",
        help="Zero the optimizer's moments and step count after each rollout. FSDP only.",
    )
    group.add_argument("--use-stateless-adam", action="store_true", help="Adam without persistent moments.")


def _add_opd_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("on-policy distillation")
    group.add_argument("--use-opd", action="store_true", help="Subtract opd-kl-coef x (student - teacher) log-prob.")
    group.add_argument("--opd-type", choices=["sglang", "megatron"], default="sglang", help="Where the teacher runs.")
    group.add_argument("--opd-kl-coef", type=float, default=1.0, help="Weight of the teacher term.")
    group.add_argument("--opd-teacher-load", default=None, help="Teacher checkpoint (--opd-type megatron).")
    group.add_argument("--opd-teacher-ckpt-step", type=int, default=None, help="Step of the teacher checkpoint.")


def _add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reward")
    group.add_argument(
        "--rm-type", default=None, help="Built-in reward: deepscaler, dapo, math, f1, gpqa, ifbench, remote_rm, ..."
    )
    group.add_argument("--reward-key", default=None, help="Key to read when a reward is a dict.")
    group.add_argument("--eval-reward-key", default=None, help="Same for eval (default: --reward-key).")
    group.add_argument("--group-rm", action="store_true", help="Score a whole group in one reward call.")
    group.add_argument("--rm-url", default=None, help="URL of a remote reward model (--rm-type remote_rm).")
    group.add_argument(
        "--rm-request-timeout-secs", type=float, default=120.0, help="Per-request limit for --rm-url; then retried."
    )
    group.add_argument(
        "--rm-max-retries", type=int, default=3, help="Retries of a --rm-url request (timeouts, 5xx, no connection)."
    )
    group.add_argument("--rm-retry-delay", type=float, default=1.0, help="Seconds before the first retry, doubled.")
    group.add_argument(
        "--rm-timeout-secs",
        type=float,
        default=5.0,
        help="Per-answer limit of the math/deepscaler/dapo graders; past it the worker is killed, the answer wrong.",
    )
    group.add_argument(
        "--rm-num-workers", type=int, default=1, help="Processes grading math answers (started on first use)."
    )
    group.add_argument("--custom-rm-path", default=None, help="async rm(args, sample) -> float.")
    group.add_argument(
        "--custom-reward-post-process-path", default=None, help="f(args, samples) -> (raw_rewards, rewards)."
    )
    group.add_argument(
        "--custom-convert-samples-to-train-data-path", default=None, help="f(args, samples) -> train data dict."
    )


def _add_buffer_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("buffer")
    group.add_argument(
        "--buffer-filter-path",
        default=None,
        help="f(args, rollout_id, buffer, num_samples) -> groups to take from the buffer (default: oldest first).",
    )
    group.add_argument("--rollout-buffer-url", default=None, help="URL of the HTTP trajectory buffer plugin.")
    group.add_argument(
        "--fetch-trajectory-retry-times", type=int, default=-1, help="Retries fetching it; -1 is unlimited."
    )
    group.add_argument("--min-batch-collection-ratio", type=float, default=1.0, help="Fraction of a batch to wait for.")
    group.add_argument("--rollout-task-type", default="math", help="Task type sent to the trajectory buffer.")
    group.add_argument("--loss-mask-type", default="qwen", help="Chat format used to build multi-turn loss masks.")
    group.add_argument(
        "--data-pad-size-multiplier", type=int, default=128, help="Pad packed sequences to a multiple of this."
    )
    group.add_argument(
        "--rollout-sample-filter-path", default=None, help="f(args, samples) setting sample.remove_sample."
    )
    group.add_argument("--rollout-all-samples-process-path", default=None, help="f(args, all_samples, data_source).")


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoint")
    group.add_argument(
        "--save-hf",
        default=None,
        help="Also save HF weights here at each save; may contain {rollout_id}.",
    )


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("--use-wandb", action="store_true")
    group.add_argument("--wandb-mode", choices=["online", "offline", "disabled"], default=None)
    group.add_argument("--wandb-dir", default=None)
    group.add_argument("--wandb-key", default=None)
    group.add_argument("--wandb-host", default=None)
    group.add_argument("--wandb-team", default=None)
    group.add_argument("--wandb-group", default=None)
    group.add_argument("--wandb-run-id", default=None)
    group.add_argument("--disable-wandb-random-suffix", action="store_true", help="Use --wandb-group as run name.")
    group.add_argument(
        "--wandb-always-use-train-step", action="store_true", help="Log every metric against the train step."
    )
    group.add_argument("--log-multi-turn", action="store_true", help="Log multi-turn statistics.")
    group.add_argument(
        "--log-passrate", action="store_true", help="Log pass@k over each prompt group (a reward >= 1 passes)."
    )
    group.add_argument("--log-reward-category", default=None, help="Metadata key to break rewards down by.")
    group.add_argument("--log-correct-samples", action="store_true", help="Log statistics of correct samples.")
    group.add_argument("--use-tensorboard", action="store_true")
    group.add_argument("--tb-project-name", default=None)
    group.add_argument("--tb-experiment-name", default=None)


def _add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("debug")
    group.add_argument("--debug-rollout-only", action="store_true", help="Start only the engines, no trainer.")
    group.add_argument("--debug-train-only", action="store_true", help="Start only the trainer, no engines.")
    group.add_argument(
        "--save-debug-rollout-data",
        default=None,
        help="Save each rollout's data to this path template, e.g. /tmp/rollout_{rollout_id}.pt.",
    )
    group.add_argument(
        "--load-debug-rollout-data",
        default=None,
        help="Train on saved rollout data from this path template instead of generating; implies --debug-train-only.",
    )
    group.add_argument(
        "--load-debug-rollout-data-subsample",
        type=float,
        default=None,
        help="Fraction of the loaded rollout data to keep.",
    )
    group.add_argument(
        "--save-debug-train-data",
        default=None,
        help="Save each data-parallel rank's train data to this {rollout_id} {rank} path template.",
    )
    group.add_argument("--dump-details", default=None, help="Directory for detailed per-step dumps.")
    group.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="After the first weight push, compare engine weights with the trainer's.",
    )
    group.add_argument("--http-proxy", default=None, help="Proxy for HTTP calls made by reward functions.")
    group.add_argument("--use-distributed-post", action="store_true", help="Spread HTTP posts over Ray workers.")


def _add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fault tolerance")
    group.add_argument("--use-fault-tolerance", action="store_true", help="Health-check engines and restart dead ones.")
    group.add_argument("--rollout-health-check-interval", type=float, default=30.0, help="Seconds between checks.")
    group.add_argument("--rollout-health-check-timeout", type=float, default=30.0, help="Seconds before a check fails.")
    group.add_argument(
        "--rollout-health-check-first-wait", type=float, default=0.0, help="Seconds before the first check."
    )


def _add_ci_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("CI")
    group.add_argument(
        "--ci-test",
        action="store_true",
        help="Fail the run when a checked metric crosses its threshold: ppo_kl and kl_loss exactly 0 on the first "
        "rollout (when it has one optimizer step), the train/rollout log-prob gap, and the --ci-* checks below.",
    )
    group.add_argument("--ci-disable-kl-checker", action="store_true", help="Skip the first-rollout KL == 0 check.")
    group.add_argument(
        "--ci-train-rollout-logprob-abs-diff-threshold",
        type=float,
        default=0.1,
        help="Largest allowed train/train_rollout_logprob_abs_diff (mean |train - rollout| log-prob) per rollout.",
    )
    group.add_argument(
        "--ci-save-grad-norm", default=None, help="Write each rollout's train/grad_norm to this {rollout_id} template."
    )
    group.add_argument(
        "--ci-load-grad-norm",
        default=None,
        help="Compare each rollout's train/grad_norm with the one saved at this {rollout_id} template (1%% tolerance).",
    )
    group.add_argument(
        "--ci-metric-checker-key", default=None, help="Metric that must reach the threshold, e.g. eval/gsm8k."
    )
    group.add_argument(
        "--ci-metric-checker-threshold",
        type=float,
        default=None,
        help="The run fails at its end unless some logged value of --ci-metric-checker-key is at least this.",
    )


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config file")
    group.add_argument(
        "--custom-config-path",
        default=None,
        help="YAML mapping of flag values applied over the command line at parse time. Keys are dests "
        "(use_tis) or flag names (--use-tis); keys that are no flag are set on args for custom functions.",
    )


def _add_forwarded_arguments(parser: argparse.ArgumentParser) -> None:
    sglang_actions = _forwarded_actions(_sglang_source_parser(), _SGLANG_EXCLUDED)
    if sglang_actions:
        group = parser.add_argument_group("SGLang server (--sglang-<ServerArgs field>)")
        _copy_prefixed_actions(sglang_actions, group, "sglang-")
    router_actions = _forwarded_actions(_router_source_parser(), _ROUTER_EXCLUDED)
    if router_actions:
        group = parser.add_argument_group("router (--router-<RouterArgs field>)")
        _copy_prefixed_actions(router_actions, group, "router-")


def add_slime_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register slime's own flags, plus `--sglang-*` / `--router-*` when those packages are installed.

    Usable as Megatron's `extra_args_provider`. Megatron-named flags (lr, batch sizes, save/load,
    ...) are not added here; see `add_megatron_subset_arguments`.

    Args:
        parser: the parser to extend.

    Returns:
        the same parser.
    """
    cuda = torch.cuda.is_available()
    _add_cluster_arguments(parser, cuda)
    _add_cpu_arguments(parser)
    _add_train_arguments(parser)
    _add_rollout_arguments(parser)
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


# ---------------------------------------------------------------------------------------------
# The Megatron flags slime reads, for when Megatron's parser is not used
# ---------------------------------------------------------------------------------------------


def add_megatron_subset_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the Megatron flags slime itself reads, with Megatron's names and slime's defaults.

    Used with `--train-backend fsdp` or when `megatron.training` is not importable.

    Args:
        parser: the parser to extend.

    Returns:
        the same parser.
    """
    cuda = torch.cuda.is_available()
    defaults = MEGATRON_DEFAULT_OVERRIDES

    optim = parser.add_argument_group("optimizer (Megatron names)")
    optim.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    optim.add_argument("--lr", type=float, default=defaults["lr"])
    optim.add_argument("--min-lr", type=float, default=0.0)
    optim.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default=defaults["lr_decay_style"],
    )
    optim.add_argument("--lr-warmup-iters", type=int, default=0, help="Warm-up optimizer steps.")
    optim.add_argument("--lr-warmup-fraction", type=float, default=None, help="Warm-up as a fraction of decay steps.")
    optim.add_argument("--lr-decay-iters", type=int, default=None, help="Decay steps (default: all steps).")
    optim.add_argument("--weight-decay", type=float, default=0.01)
    optim.add_argument("--adam-beta1", type=float, default=0.9)
    optim.add_argument("--adam-beta2", type=float, default=0.999)
    optim.add_argument("--adam-eps", type=float, default=1e-8)
    optim.add_argument("--clip-grad", type=float, default=defaults["clip_grad"], help="Gradient-norm clip.")
    optim.add_argument("--seed", type=int, default=defaults["seed"])
    optim.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Normalize the loss by the token count of the step, not per sample.",
    )
    optim.add_argument("--bf16", action="store_true", help="Train in bf16 (slow on CPUs without bf16 units).")
    optim.add_argument("--fp16", action="store_true")

    batch = parser.add_argument_group("batch (Megatron names)")
    batch.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step (default: rollout-batch-size x n-samples-per-prompt / num-steps-per-rollout).",
    )
    batch.add_argument("--micro-batch-size", type=int, default=defaults["micro_batch_size"])

    parallel = parser.add_argument_group("parallelism (Megatron names)")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--context-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1)
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default="nccl" if cuda else "gloo",
        help="torch.distributed backend of the trainers (default: nccl with CUDA, gloo without).",
    )
    parallel.add_argument("--distributed-timeout-minutes", type=int, default=defaults["distributed_timeout_minutes"])

    ckpt = parser.add_argument_group("checkpoint (Megatron names)")
    ckpt.add_argument("--save", default=None, help="Checkpoint directory to save to.")
    ckpt.add_argument("--load", default=None, help="Checkpoint directory to resume from.")
    ckpt.add_argument("--save-interval", type=int, default=None, help="Save every this many rollouts.")
    ckpt.add_argument("--async-save", action="store_true")
    ckpt.add_argument("--no-save-optim", action="store_true", default=None)
    ckpt.add_argument("--no-load-optim", action="store_true", default=None)
    ckpt.add_argument("--no-load-rng", action="store_true", default=None)
    ckpt.add_argument("--finetune", action="store_true", help="Load weights only and restart step counting.")

    misc = parser.add_argument_group("eval and logging (Megatron names)")
    misc.add_argument("--eval-interval", type=int, default=defaults["eval_interval"], help="Eval every N rollouts.")
    misc.add_argument("--wandb-project", default=None)
    misc.add_argument("--tensorboard-dir", default=None)
    misc.add_argument("--record-memory-history", action="store_true")
    return parser


# Megatron's attention backends and the HF attention implementation that does the same job under FSDP.
FSDP_ATTENTION_BACKENDS = {"auto": None, "flash": "flash_attention_2", "fused": "sdpa", "unfused": "eager"}


def add_fsdp_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron flags from recipes and docs, with their meaning under `--train-backend fsdp`.

    Registered only for the FSDP backend; under Megatron they are Megatron's own.

    Args:
        parser: the parser to extend.

    Returns:
        the same parser.
    """
    group = parser.add_argument_group("Megatron flags with an FSDP meaning")
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Recompute activations in backward: under FSDP the same as --gradient-checkpointing (whole layers).",
    )
    group.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="Either value turns on --gradient-checkpointing (FSDP recomputes whole decoder layers).",
    )
    group.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="uniform (every layer, what FSDP does); block is refused.",
    )
    group.add_argument(
        "--recompute-num-layers", type=int, default=None, help="Layers per recompute unit; FSDP's unit is 1 layer."
    )
    group.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Skip an optimizer step whose gradient norm is not finite, instead of stopping the run.",
    )
    group.add_argument(
        "--attention-backend",
        choices=list(FSDP_ATTENTION_BACKENDS),
        default="auto",
        help="flash: HF flash_attention_2 (needs flash-attn); fused: sdpa; unfused: eager; auto: the model's default.",
    )
    group.add_argument(
        "--ckpt-step", type=int, default=None, help="Load this rollout's checkpoint from --load instead of the latest."
    )
    return parser


def _import_megatron_arguments():
    try:
        return importlib.import_module("megatron.training.arguments")
    except ImportError:
        return None


def _parse_with_megatron(megatron_arguments, argv: list[str]) -> argparse.Namespace:
    """Megatron's parse_args over argv, with slime's flags and default overrides added."""
    cuda = torch.cuda.is_available()

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


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


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
    cuda = torch.cuda.is_available()

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


# ---------------------------------------------------------------------------------------------
# Flags that parse but are refused, flags the parser itself consumes, --custom-config-path
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a registered flag is refused at parse time, and what to use instead.

    A refused flag given at its default value is harmless; any other value (or one of `values`) is an error.

    Attributes:
        reason: what is missing, e.g. "on-policy distillation is not implemented yet".
        instead: what to do instead.
        backends: the `--train-backend`s under which it is refused (it works under the others).
        values: refuse only these values (None: every value other than the default).
        allowed: values accepted besides the default (they already mean what slime does).
    """

    reason: str
    instead: str
    backends: tuple[str, ...] = ("fsdp", "megatron")
    values: tuple[Any, ...] | None = None
    allowed: tuple[Any, ...] = ()


_NO_DISK_SYNC = Refusal(
    "only disk weight sync reads it, and disk (and delta) weight sync is not implemented",
    "drop it; weights reach the engines as tensors (--colocate) or by a collective broadcast",
)
_NO_OPD = Refusal(
    "only --use-opd reads it, and on-policy distillation is not implemented yet",
    "drop it (for a KL penalty towards a fixed model use --use-kl-loss with --ref-load <teacher>)",
)
_NO_BUFFER_PLUGIN = Refusal(
    "the HTTP trajectory-buffer plugin is not implemented",
    "produce trajectories with --rollout-function-path or --custom-generate-function-path",
)
_FSDP_ONLY = "implemented for --train-backend fsdp only so far"

# dest -> why it is refused. Keys are argparse dests (`--disable-x` may store into `x`).
REFUSED_FLAGS: dict[str, Refusal] = {
    # cluster and weight sync
    "prefill_num_servers": Refusal(
        "prefill/decode disaggregation is not implemented", "drop it; every engine serves prefill and decode"
    ),
    "rollout_external_engine_addrs": Refusal(
        "engines started outside slime are not supported",
        "drop it; slime launches its engines (--rollout-num-gpus, --rollout-num-gpus-per-engine)",
    ),
    "update_weight_transport": Refusal(
        "disk weight sync is not implemented",
        "drop it; weights reach the engines as tensors (--colocate) or by a collective broadcast (nccl; gloo on CPU)",
        values=("disk",),
    ),
    "update_weight_mode": Refusal(
        "delta weight sync is not implemented", "drop it; every update pushes the full weights", values=("delta",)
    ),
    "update_weight_disk_dir": _NO_DISK_SYNC,
    "update_weight_disk_keep_files": _NO_DISK_SYNC,
    "update_weight_local_checkpoint_dir": _NO_DISK_SYNC,
    "update_weight_delta_encoding": _NO_DISK_SYNC,
    "update_weight_delta_checksum": _NO_DISK_SYNC,
    "custom_update_weight_post_write_path": _NO_DISK_SYNC,
    "release_train": Refusal(
        "recreating the trainers after each step needs disk weight sync, which is not implemented",
        "drop it; --offload-train frees the trainer's GPU memory while the engines generate",
    ),
    "rollout_data_transport": Refusal(
        "NIXL transfer is not implemented", "drop it; rollout data goes through Ray's object store", values=("nixl",)
    ),
    "sglang_config": Refusal(
        "YAML server groups (prefill/decode/...) are not implemented", "pass engine options as --sglang-<flag>"
    ),
    # training
    "keep_old_actor": Refusal(_FSDP_ONLY, "use --train-backend fsdp, or drop it", backends=("megatron",)),
    "ref_update_interval": Refusal(_FSDP_ONLY, "use --train-backend fsdp, or drop it", backends=("megatron",)),
    "reset_optimizer_states": Refusal(_FSDP_ONLY, "use --train-backend fsdp, or drop it", backends=("megatron",)),
    "get_mismatch_metrics": Refusal(
        _FSDP_ONLY,
        "use --train-backend fsdp; without --use-rollout-logprobs the Megatron backend logs "
        "train/train_rollout_logprob_abs_diff anyway",
        backends=("megatron",),
    ),
    "only_train_params_name_list": Refusal(_FSDP_ONLY, "use --train-backend fsdp", backends=("megatron",)),
    "freeze_params_name_list": Refusal(_FSDP_ONLY, "use --train-backend fsdp", backends=("megatron",)),
    "recompute_loss_function": Refusal(
        "recomputing the loss in backward is not implemented",
        "to save memory use --gradient-checkpointing (FSDP) or Megatron's --recompute-* flags, or lower "
        "--max-tokens-per-gpu",
    ),
    "log_probs_chunk_size": Refusal(
        "chunked log-prob computation is not implemented (log-probs are computed per micro-batch)",
        "lower --max-tokens-per-gpu or --micro-batch-size to bound memory",
    ),
    "log_probs_max_tokens_per_gpu": Refusal(
        "log-prob passes use the training micro-batches, so the first step's ppo_kl is exactly 0",
        "set --max-tokens-per-gpu",
    ),
    "allgather_cp": Refusal("context-parallel all-gather for DSA models is not implemented", "drop it"),
    "qwen_gdn_backend": Refusal("Qwen3-Next gated delta-net layers are not supported", "drop it"),
    "custom_megatron_init_path": Refusal(
        "the Megatron init hook is not called (and the FSDP backend initializes no Megatron)",
        "run your setup at import time of a module passed to another hook, or in --custom-model-provider-path",
    ),
    "custom_megatron_before_log_prob_hook_path": Refusal(
        "the before-log-prob hook is not called yet",
        "use --custom-megatron-before-train-step-hook-path or --rollout-data-postprocess-path",
    ),
    "megatron_config_path": Refusal(
        "per-role Megatron YAML overrides are not implemented",
        "put the flags on the command line, or in --custom-config-path (a YAML of flag values)",
    ),
    "use_stateless_adam": Refusal("stateless Adam is not implemented", "drop it; --optimizer adam is used"),
    "async_save": Refusal("checkpoints are written synchronously", "drop it"),
    "record_memory_history": Refusal("CUDA memory-history recording is not implemented", "drop it"),
    # algorithm
    "custom_pg_loss_reducer_function_path": Refusal(
        "upstream's pg-loss reducer hook is not implemented",
        "register a loss aggregation (@register_loss_aggregation in a module passed to --custom-algorithm-module) "
        "and select it with --loss-agg-mode; Dr. GRPO's is built in: --loss-agg-mode seq-mean-token-sum-norm",
    ),
    "use_opsm": Refusal(
        "off-policy sequence masking (OPSM) is not implemented", "bound off-policy updates with --use-tis"
    ),
    "opsm_delta": Refusal("only --use-opsm reads it, and OPSM is not implemented", "drop it"),
    "use_routing_replay": Refusal("MoE routing replay is not implemented", "drop it"),
    "use_rollout_routing_replay": Refusal("MoE rollout routing replay (R3) is not implemented", "drop it"),
    "use_rollout_entropy": Refusal(
        "the engines' entropy is not recorded", "drop it (the trainer's entropy is in the train metrics)"
    ),
    "use_opd": Refusal(
        "on-policy distillation is not implemented yet",
        "drop it; for a KL penalty towards a fixed model use --use-kl-loss with --ref-load <teacher>",
    ),
    "opd_type": _NO_OPD,
    "opd_kl_coef": _NO_OPD,
    "opd_teacher_load": _NO_OPD,
    "opd_teacher_ckpt_step": _NO_OPD,
    # data, eval, buffer
    "multimodal_keys": Refusal("multimodal prompts are not supported yet", "drop it; prompts are text or messages"),
    "balance_by_flops": Refusal(
        "FLOP-balanced partitioning is not implemented", "use --balance-data (token-balanced data-parallel ranks)"
    ),
    "eval_config": Refusal(
        "eval YAML configs are not implemented",
        "use --eval-prompt-data NAME PATH [NAME PATH ...] with the --eval-* flags (--n-samples-per-eval-prompt, "
        "--eval-max-response-len, --eval-temperature, ...)",
    ),
    "rollout_buffer_url": _NO_BUFFER_PLUGIN,
    "fetch_trajectory_retry_times": _NO_BUFFER_PLUGIN,
    "min_batch_collection_ratio": _NO_BUFFER_PLUGIN,
    "rollout_task_type": _NO_BUFFER_PLUGIN,
    # Read by user code through slime.utils.mask_utils.MultiTurnLossMaskGenerator; every upstream type works.
    "loss_mask_type": Refusal(
        "loss masks come from the tokenizer's chat template, and this is none of upstream's type names",
        f"use one of {', '.join(LOSS_MASK_TYPES)} (all behave the same), or set Sample.loss_mask yourself",
        allowed=LOSS_MASK_TYPES,
    ),
    "data_pad_size_multiplier": Refusal("each backend pads packed sequences as it needs", "drop it"),
    # logging and debug
    "log_multi_turn": Refusal(
        "multi-turn statistics are not implemented", "log them from --custom-rollout-log-function-path"
    ),
    "dump_details": Refusal(
        "detailed dumps are not implemented", "use --save-debug-rollout-data and --save-debug-train-data"
    ),
    "http_proxy": Refusal("a proxy for slime's HTTP calls is not implemented", "drop it"),
    "use_distributed_post": Refusal(
        "spreading HTTP posts over Ray workers is not implemented",
        "drop it; the rollout process posts, at most --sglang-server-concurrency requests per engine",
    ),
    # Megatron flags with an FSDP meaning (registered under --train-backend fsdp only)
    "recompute_method": Refusal(
        "FSDP recomputes every decoder layer (uniform); block recompute is not implemented",
        "use --recompute-method uniform",
        values=("block",),
    ),
    "recompute_num_layers": Refusal(
        "FSDP recomputes one decoder layer at a time", "use --recompute-num-layers 1, or drop it", allowed=(1,)
    ),
}

# dest -> what the parser itself does with it (nothing after parsing reads these).
PARSE_TIME_FLAGS: dict[str, str] = {
    "offload": "sets --offload-train and --offload-rollout",
    "rollout_global_dataset": "lifts the --prompt-data requirement: the rollout function brings its own prompts",
    "num_gpus_per_node": "checks that one engine (--rollout-num-gpus-per-engine) fits on a node",
    "custom_config_path": "its YAML is applied over the command line by parse_args",
}


@functools.cache
def _registered_defaults() -> dict[str, tuple[str, Any]]:
    """dest -> (first option string, default) of every flag slime registers, for either backend."""
    found: dict[str, tuple[str, Any]] = {}
    for backend in ("megatron", "fsdp"):
        for action in build_parser(backend)._actions:
            if action.option_strings:
                found.setdefault(action.dest, (action.option_strings[0], action.default))
    return found


def refuse_unsupported_flags(args: argparse.Namespace) -> None:
    """Raise for a flag of `REFUSED_FLAGS` given a value it is refused at.

    Raises:
        ArgumentValidationError: naming the flag, the reason and what to use instead.
    """
    defaults = _registered_defaults()
    for dest, refusal in REFUSED_FLAGS.items():
        if args.train_backend not in refusal.backends or dest not in defaults or not hasattr(args, dest):
            continue
        flag, default = defaults[dest]
        value = getattr(args, dest)
        refused = value in refusal.values if refusal.values is not None else value != default
        if refused and value not in refusal.allowed:
            shown = "" if isinstance(value, bool) else f" {value}"
            backend = f" with --train-backend {args.train_backend}" if len(refusal.backends) == 1 else ""
            _fail(f"{flag}{shown} is not supported{backend}: {refusal.reason}. Instead: {refusal.instead}.")


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


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _fail(message: str) -> None:
    raise ArgumentValidationError(message)


def _validate_batch_sizes(args: argparse.Namespace) -> None:
    """Enforce rollout_batch_size x n_samples_per_prompt == global_batch_size x num_steps_per_rollout."""
    if args.rollout_batch_size is None:
        _fail("--rollout-batch-size is required: the number of prompts per rollout step.")
    if args.rollout_batch_size < 1 or args.n_samples_per_prompt < 1:
        _fail(
            f"--rollout-batch-size ({args.rollout_batch_size}) and --n-samples-per-prompt "
            f"({args.n_samples_per_prompt}) must be at least 1."
        )
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    identity = (
        f"--rollout-batch-size ({args.rollout_batch_size}) x --n-samples-per-prompt ({args.n_samples_per_prompt}) "
        f"= {samples} samples per rollout"
    )
    gbs, steps = args.global_batch_size, args.num_steps_per_rollout
    if gbs is None:
        steps = 1 if steps is None else steps
        if steps < 1 or samples % steps:
            _fail(f"{identity}, which --num-steps-per-rollout ({steps}) does not divide into equal steps.")
        gbs = samples // steps
    elif steps is None:
        if gbs < 1 or samples % gbs:
            _fail(f"{identity}, which is not a multiple of --global-batch-size ({gbs}); change one of them.")
        steps = samples // gbs
    elif gbs * steps != samples:
        _fail(
            f"{identity}, but --global-batch-size ({gbs}) x --num-steps-per-rollout ({steps}) = {gbs * steps}; "
            "they must be equal. Drop --global-batch-size or --num-steps-per-rollout to derive it."
        )
    args.global_batch_size, args.num_steps_per_rollout = gbs, steps


def _validate_placement(args: argparse.Namespace) -> None:
    args.actor_world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.colocate:
        if args.rollout_num_gpus is not None and args.rollout_num_gpus != args.actor_world_size:
            logger.warning(
                "--colocate: --rollout-num-gpus %s replaced by the actor's %s GPUs "
                "(--actor-num-nodes x --actor-num-gpus-per-node).",
                args.rollout_num_gpus,
                args.actor_world_size,
            )
        args.rollout_num_gpus = args.actor_world_size
    elif args.rollout_num_gpus is None:
        if args.rollout_backend == "cpu":
            args.rollout_num_gpus = 1  # one CPU engine slot
        elif not args.debug_train_only:
            _fail(
                "--rollout-num-gpus is required without --colocate: the GPUs the rollout engines get "
                "besides the actor's. Pass it, or --colocate to share the actor's GPUs."
            )
    if args.rollout_num_gpus is None:
        args.rollout_num_engines = 0
    else:
        if args.rollout_num_gpus_per_engine < 1 or args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
            _fail(
                f"--rollout-num-gpus ({args.rollout_num_gpus}) must be a multiple of "
                f"--rollout-num-gpus-per-engine ({args.rollout_num_gpus_per_engine})."
            )
        args.rollout_num_engines = args.rollout_num_gpus // args.rollout_num_gpus_per_engine

    args.use_critic = _estimator(args).critic
    if args.offload:
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
    if args.offload_train is None:
        # The critic shares the actor's GPUs, so one of them must step aside while the other runs.
        args.offload_train = args.colocate or args.use_critic
    if args.offload_rollout is None:
        args.offload_rollout = args.colocate

    if args.rollout_backend == "cpu" and not args.colocate:
        trainer_threads = 0 if args.debug_rollout_only else args.actor_world_size * args.train_num_threads
        engine_threads = 0 if args.debug_train_only else args.rollout_num_engines * args.cpu_engine_num_threads
        cores = os.cpu_count() or 1
        if trainer_threads + engine_threads > cores:
            logger.warning(
                "%d trainer threads + %d CPU engine threads exceed the %d cores; oversubscribed threads slow "
                "everything down. Lower --train-num-threads / --cpu-engine-num-threads or the process counts.",
                trainer_threads,
                engine_threads,
                cores,
            )


def _load_algorithm_modules(args: argparse.Namespace) -> None:
    try:
        algorithms.load_user_registrations(getattr(args, "custom_algorithm_module", None))
    except ValueError as e:
        _fail(str(e))


def _estimator(args: argparse.Namespace) -> algorithms.advantages.AdvantageEstimator:
    _load_algorithm_modules(args)
    try:
        return algorithms.ADVANTAGE_ESTIMATORS.get(args.advantage_estimator)
    except ValueError as e:
        _fail(str(e))


def _validate_algorithm_registries(args: argparse.Namespace) -> None:
    """Rules that come from the registered estimator, policy loss, KL estimator and loss aggregation."""
    estimator = _estimator(args)
    registered = {
        "--loss-type": (args.loss_type, algorithms.loss_type_choices()),
        "--kl-loss-type": (args.kl_loss_type, algorithms.KL_ESTIMATORS.names()),
        "--loss-agg-mode": (args.loss_agg_mode, algorithms.LOSS_AGGREGATIONS.names()),
    }
    for flag, (name, names) in registered.items():
        if name is not None and name not in names:
            _fail(
                f"{flag} {name} is not registered; choose from {', '.join(names)}, or register it in a module "
                "passed to --custom-algorithm-module."
            )

    # A group baseline with one sample per prompt subtracts each reward from itself: all advantages are 0.
    group_baseline_used = (
        estimator.group_rewards is not None
        and not args.disable_rewards_normalization
        and not args.custom_reward_post_process_path
        and not getattr(args, "custom_advantage_function_path", None)
        and loss_kind(args.loss_type) == "policy_loss"
        and not args.debug_rollout_only
    )
    if group_baseline_used and args.n_samples_per_prompt < 2:
        _fail(
            f"--advantage-estimator {args.advantage_estimator} compares each response with the other responses "
            f"to the same prompt, but --n-samples-per-prompt is {args.n_samples_per_prompt}: every advantage would "
            "be 0 and nothing would learn. Pass --n-samples-per-prompt 2 or more (e.g. 8), or "
            "--disable-rewards-normalization to train on raw rewards."
        )
    if estimator.whiten and not args.normalize_advantages:
        logger.warning(
            "--advantage-estimator %s normalizes advantages; turning on --normalize-advantages.",
            args.advantage_estimator,
        )
        args.normalize_advantages = True

    per_token = getattr(args, "calculate_per_token_loss", False)
    if per_token and args.loss_agg_mode not in (None, "token-mean"):
        _fail(
            f"--calculate-per-token-loss means --loss-agg-mode token-mean, but --loss-agg-mode is "
            f"{args.loss_agg_mode}; pass only one of them."
        )
    args.loss_agg_mode = default_loss_agg_mode(args)
    if args.loss_agg_mode == "seq-mean-token-sum-norm" and not args.rollout_max_response_len:
        _fail(
            "--loss-agg-mode seq-mean-token-sum-norm divides each sample's token sum by a constant response "
            "length; pass --rollout-max-response-len."
        )


def _validate_algorithm(args: argparse.Namespace) -> None:
    if args.rollout_temperature <= 0:
        _fail(
            f"--rollout-temperature must be > 0 (got {args.rollout_temperature}): log-probs are taken at this "
            "temperature. For near-greedy sampling use a small value such as 0.01, or --rollout-top-k 1."
        )
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        _fail("--loss-type custom_loss needs --custom-loss-function-path pointing at your loss function.")
    if args.disable_compute_advantages_and_returns and loss_kind(args.loss_type) == "policy_loss":
        _fail(
            "--disable-compute-advantages-and-returns leaves the rollout data without the advantages that "
            "--loss-type policy_loss needs; use it with --loss-type sft_loss (or custom_loss)."
        )
    _validate_algorithm_registries(args)
    if args.use_kl_loss and args.kl_loss_coef == 0:
        logger.warning("--use-kl-loss with --kl-loss-coef 0 computes the KL but gives it no weight.")
    if args.use_opd and args.opd_type == "megatron" and not args.opd_teacher_load:
        _fail("--use-opd --opd-type megatron needs --opd-teacher-load (the teacher checkpoint).")


def _validate_data(args: argparse.Namespace) -> None:
    if args.num_rollout is None and args.num_epoch is None and not args.debug_train_only:
        _fail("Pass --num-rollout (rollout steps) or --num-epoch (passes over --prompt-data).")
    if args.num_rollout is not None and args.num_epoch is not None:
        logger.warning("Both --num-rollout and --num-epoch given: --num-rollout %s wins.", args.num_rollout)
    custom_source = not args.rollout_global_dataset or args.data_source_path != DEFAULT_DATA_SOURCE_PATH
    if args.prompt_data is None and not custom_source and not (args.debug_train_only and args.load_debug_rollout_data):
        _fail(
            "--prompt-data is required (a .jsonl or .parquet of prompts), unless --data-source-path or "
            "--disable-rollout-global-dataset supplies prompts another way."
        )
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    if args.over_sampling_batch_size < args.rollout_batch_size:
        _fail(
            f"--over-sampling-batch-size ({args.over_sampling_batch_size}) must be at least --rollout-batch-size "
            f"({args.rollout_batch_size}): it is how many prompts are submitted per round to fill one batch."
        )
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        _fail("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of a micro-batch).")
    if args.log_probs_max_tokens_per_gpu is None:
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    if args.reward_key is None and (args.rm_type or "").strip() == "dapo" and not args.custom_rm_path:
        # dapo scores {"score", "acc", "pred"}: train on "score", as upstream's dapo recipes pass --reward-key.
        args.reward_key = "score"
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    if args.eval_interval is not None and not args.eval_prompt_data:
        _fail("--eval-interval needs eval data: --eval-prompt-data NAME PATH [NAME PATH ...].")


def _validate_modes(args: argparse.Namespace) -> None:
    if args.load_debug_rollout_data:
        if args.debug_rollout_only:
            _fail(
                "--load-debug-rollout-data trains on saved data (it implies --debug-train-only) and cannot be "
                "combined with --debug-rollout-only."
            )
        args.debug_train_only = True
    if args.debug_rollout_only and args.debug_train_only:
        _fail("--debug-rollout-only and --debug-train-only exclude each other; pass one of them.")
    if args.hf_checkpoint is None and not (args.debug_train_only and args.train_backend == "megatron" and args.load):
        _fail("--hf-checkpoint is required: the HF model folder (weights, tokenizer, config).")
    if args.update_weights_interval < 1:
        _fail(f"--update-weights-interval must be at least 1 (got {args.update_weights_interval}).")
    if args.update_weight_mode == "delta":
        if args.update_weight_transport != "disk":
            _fail("--update-weight-mode delta needs --update-weight-transport disk.")
        if args.colocate:
            _fail("--update-weight-mode delta does not work with --colocate (colocated engines get tensors directly).")
    if args.save_interval is not None and not args.save:
        _fail("--save-interval needs --save (the checkpoint directory).")


# ---- output folders (--save, --save-hf): never overwrite an earlier run or a folder slime did not write ----
def _validate_output_folders(args: argparse.Namespace) -> None:
    from slime.utils import atomic_dir, run_dir

    found = run_dir.holds_run(args.save)
    if found and not (args.load and os.path.realpath(args.load) == os.path.realpath(args.save)):
        _fail(
            f"--save {args.save} already holds a run ({', '.join(found)}); without --load pointing at it, this run "
            f"would start again and overwrite it. Pass --load {args.save} to resume it, or choose another --save "
            "for a new run."
        )
    save_hf = getattr(args, "save_hf", None)
    if not save_hf:
        return
    try:
        first = save_hf.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as e:
        _fail(f"--save-hf {save_hf!r} may contain only the placeholder {{rollout_id}} ({e!r}).")
    if first == save_hf:  # one fixed folder, replaced at every save: it must be absent or an earlier export
        problem = atomic_dir.replace_problem(save_hf, "--save-hf")
        if problem is not None:
            _fail(problem)


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check cross-flag rules and fill the defaults that depend on other flags, in place.

    Fills: global_batch_size / num_steps_per_rollout (from the batch identity), actor_world_size,
    rollout_num_gpus (colocate; 1 on the CPU backend), rollout_num_engines, use_critic,
    offload_train / offload_rollout, eps_clip_high, over_sampling_batch_size,
    log_probs_max_tokens_per_gpu, eval_function_path, reward_key ("score" for --rm-type dapo), and
    debug_train_only when --load-debug-rollout-data is set. Calling it twice gives the same result.

    Args:
        args: a namespace from this module's parser.

    Returns:
        the same namespace.

    Raises:
        ArgumentValidationError: naming the flags at fault and the fix.
    """
    _validate_modes(args)
    _validate_batch_sizes(args)
    _validate_placement(args)
    _validate_algorithm(args)
    _validate_data(args)
    _validate_output_folders(args)
    _validate_engine_limits(args)
    _validate_flag_uses(args)
    return args


def _validate_engine_limits(args: argparse.Namespace) -> None:
    if args.cpu_engine_max_queued_requests < 1:
        _fail(f"--cpu-engine-max-queued-requests must be at least 1, got {args.cpu_engine_max_queued_requests}.")
    api_key = getattr(args, "sglang_api_key", None)
    if api_key is not None and not isinstance(api_key, str):  # the generic --sglang-* parser typed it
        _fail(f"--sglang-api-key was read as {api_key!r}, not text; use a key that is not a number or true/false.")
    if api_key is not None and not api_key.strip():
        _fail("--sglang-api-key needs a non-empty key: engines require it as 'Authorization: Bearer <key>'.")


def _validate_flag_uses(args: argparse.Namespace) -> None:
    """Rules of the flags whose use depends on other flags (debug data, CI checks, recompute, freezing, ...)."""
    if not args.rollout_global_dataset and args.prompt_data is not None:
        _fail(
            "--disable-rollout-global-dataset says the rollout function brings its own prompts, but --prompt-data "
            "is given too; drop one of them."
        )
    # An SGLang engine's GPUs must sit on one node (the CPU engine is one process whatever the count).
    if args.rollout_backend == "sglang" and args.rollout_num_gpus_per_engine > args.num_gpus_per_node:
        _fail(
            f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} is more than --num-gpus-per-node "
            f"{args.num_gpus_per_node}: engines that span nodes are not supported; use at most "
            f"{args.num_gpus_per_node} GPUs per engine (or fix --num-gpus-per-node)."
        )
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        _fail("--distributed-backend nccl needs CUDA GPUs; use --distributed-backend gloo on this machine.")

    ci_flags = {
        "--ci-disable-kl-checker": args.ci_disable_kl_checker,
        "--ci-save-grad-norm": args.ci_save_grad_norm,
        "--ci-load-grad-norm": args.ci_load_grad_norm,
        "--ci-metric-checker-key": args.ci_metric_checker_key,
        "--ci-metric-checker-threshold": args.ci_metric_checker_threshold,
    }
    given = [flag for flag, value in ci_flags.items() if value not in (None, False)]
    if given and not args.ci_test:
        _fail(f"{', '.join(given)} only take effect with --ci-test; add --ci-test or drop them.")
    if (args.ci_metric_checker_key is None) != (args.ci_metric_checker_threshold is None):
        _fail("--ci-metric-checker-key and --ci-metric-checker-threshold go together; pass both or neither.")
    for flag, template in (
        ("--ci-save-grad-norm", args.ci_save_grad_norm),
        ("--ci-load-grad-norm", args.ci_load_grad_norm),
    ):
        if template is not None and "{rollout_id}" not in template:
            _fail(f"{flag} {template} must contain {{rollout_id}}: one file per rollout.")

    subsample = args.load_debug_rollout_data_subsample
    if subsample is not None:
        if not args.load_debug_rollout_data:
            _fail("--load-debug-rollout-data-subsample needs --load-debug-rollout-data (the saved rollouts).")
        if not 0 < subsample <= 1:
            _fail(
                f"--load-debug-rollout-data-subsample is the fraction of samples to keep, in (0, 1]; got {subsample}."
            )
    template = args.save_debug_train_data
    if template is not None:
        try:
            template.format(rollout_id=0, rank=0)
        except (KeyError, IndexError, ValueError) as e:
            _fail(f"--save-debug-train-data {template!r} may contain only {{rollout_id}} and {{rank}} ({e!r}).")
        if "{rollout_id}" not in template or "{rank}" not in template:
            _fail(
                f"--save-debug-train-data {template} must contain {{rollout_id}} and {{rank}}: one file per rollout "
                "and data-parallel rank, e.g. /tmp/train_{rollout_id}_{rank}.pt."
            )

    if args.ref_update_interval is not None:
        if args.ref_update_interval < 1:
            _fail(f"--ref-update-interval must be at least 1 (got {args.ref_update_interval}).")
        if not (args.use_kl_loss or args.kl_coef != 0):
            _fail("--ref-update-interval refreshes the reference model, which only --use-kl-loss or --kl-coef use.")
    for flag, patterns in (
        ("--only-train-params-name-list", args.only_train_params_name_list),
        ("--freeze-params-name-list", args.freeze_params_name_list),
    ):
        for pattern in patterns or []:
            try:
                re.compile(pattern)
            except re.error as e:
                _fail(f"{flag}: {pattern!r} is not a valid regular expression ({e}).")

    if args.keep_old_actor and (args.debug_train_only or args.use_rollout_logprobs):
        _fail(
            "--keep-old-actor takes the old log-probs from the weights pushed to the engines; it does nothing with "
            f"{'--debug-train-only (no engines)' if args.debug_train_only else '--use-rollout-logprobs'}: drop one."
        )

    if args.train_backend == "fsdp":
        if args.ckpt_step is not None and not args.load:
            _fail("--ckpt-step picks a checkpoint of --load; pass --load too.")
        recompute = args.recompute_activations or args.recompute_granularity is not None
        if (args.recompute_method is not None or args.recompute_num_layers is not None) and not recompute:
            _fail("--recompute-method / --recompute-num-layers go with --recompute-granularity full.")
        if args.attention_backend == "flash" and importlib.util.find_spec("flash_attn") is None:
            _fail("--attention-backend flash needs the flash-attn package; install it or drop the flag (sdpa).")
