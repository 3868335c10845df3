"""Flags that parse but are refused (`REFUSED_FLAGS`, with the reason and what to use instead) and the check
`parse_args` runs, plus the flags the parser itself consumes (`PARSE_TIME_FLAGS`)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

from slime.utils.arguments.errors import _fail
from slime.utils.arguments.parser import build_parser
from slime.utils.mask_utils import LOSS_MASK_TYPES


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


_OPD_ENGINE_TEACHER = (
    "serve the teacher with an engine and pass --opd-type sglang --opd-teacher-url http://HOST:PORT "
    "(python -m slime.backends.cpu_engine --model-path <teacher> on CPU, sglang.launch_server on GPU)"
)
_NO_TRAINER_TEACHER = Refusal(
    "only --opd-type megatron reads it, and a teacher loaded in the trainer is not implemented", _OPD_ENGINE_TEACHER
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
    "release_train": Refusal(
        "recreating the trainers after each step is not implemented",
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
    "freeze_indexer": Refusal(_FSDP_ONLY, "use --train-backend fsdp", backends=("megatron",)),
    "true_on_policy_mode": Refusal(
        "implemented for --train-backend fsdp only so far (the engine recomputes log-probs with the HF forward the "
        "FSDP trainer runs, not with Megatron's kernels)",
        "use --train-backend fsdp",
        backends=("megatron",),
    ),
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
    "use_routing_replay": Refusal(
        "replaying the trainer's own old-policy routing is not implemented",
        "replay the engines' routing with --use-rollout-routing-replay (R3)",
    ),
    "use_rollout_entropy": Refusal(
        "the engines' entropy is not recorded", "drop it (the trainer's entropy is in the train metrics)"
    ),
    # A second set of weights swapped into the model, like the reference, needs each backend to read a second
    # checkpoint into its own shard layout; neither does yet.
    "opd_type": Refusal(
        "a teacher loaded in the trainer (on-policy distillation with --opd-type megatron) is not implemented",
        _OPD_ENGINE_TEACHER,
        values=("megatron",),
    ),
    "opd_teacher_load": _NO_TRAINER_TEACHER,
    "opd_teacher_ckpt_step": _NO_TRAINER_TEACHER,
    # data, eval, buffer
    "balance_by_flops": Refusal(
        "FLOP-balanced partitioning is not implemented", "use --balance-data (token-balanced data-parallel ranks)"
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
