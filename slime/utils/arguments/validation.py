"""`validate_args`: the cross-flag rules, each failing with a message that names the flags and the fix, and the
defaults that depend on other flags."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import secrets
from urllib.parse import urlparse

from slime import algorithms
from slime.algorithms.aggregation import default_loss_agg_mode
from slime.algorithms.policy_losses import loss_kind
from slime.utils.arguments.algorithm import _estimator
from slime.utils.arguments.checkpoint import _validate_output_folders
from slime.utils.arguments.errors import _fail
from slime.utils.arguments.lora import _validate_lora
from slime.utils.arguments.rollout import (
    DEFAULT_DATA_SOURCE_PATH,
    DEFAULT_ROLLOUT_FUNCTION_PATH,
    _validate_multimodal,
)
from slime.utils.device import cuda_available
from slime.utils.engine_args import cpu_engine_dtype, engine_api_key
from slime.utils.eval_config import load_eval_config
from slime.utils.fp8 import rollout_fp8_block
from slime.utils.misc import load_function
from slime.utils.model_families import DSA_MODEL_TYPES, MTP_MODEL_TYPES, megatron_refusal
from slime.utils.moe_routing import routing_shape

# One logger for the whole parser, named as before the split into modules (log lines show the name).
logger = logging.getLogger(__package__)


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
    if args.use_dynamic_global_batch_size:
        # One optimizer step per rollout over what it returned: the LR schedule and step counter count one too.
        if gbs not in (None, samples) or steps not in (None, 1):
            _fail(
                f"--use-dynamic-global-batch-size trains each rollout in one step of its own size ({identity}); "
                f"drop --global-batch-size ({gbs}) and --num-steps-per-rollout ({steps})."
            )
        gbs, steps = samples, 1
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


def _external_engine_url(address: str) -> str:
    """`host:port` or `http(s)://host:port` of an engine slime did not start, as a base URL."""
    url = address.rstrip("/") if "://" in address else f"http://{address}"
    try:
        parsed = urlparse(url)
        valid = parsed.scheme in ("http", "https") and parsed.hostname and parsed.port and parsed.path == ""
    except ValueError:  # e.g. a port that is not a number
        valid = False
    if not valid:
        _fail(
            f"--rollout-external-engine-addrs {address!r} is not host:port (or http://host:port) of an engine's HTTP "
            "server, e.g. 127.0.0.1:30000."
        )
    return url


def _validate_external_engines(args: argparse.Namespace) -> None:
    """Engines started outside slime: none are launched, so they take no devices and slime cannot manage them."""
    addresses = args.rollout_external_engine_addrs
    if not addresses:
        return
    managed = {
        "--colocate": args.colocate,
        "--use-fault-tolerance": args.use_fault_tolerance,
        "--offload-rollout (or --offload)": args.offload if args.offload_rollout is None else args.offload_rollout,
    }
    given = [flag for flag, value in managed.items() if value]
    if given:
        _fail(
            f"--rollout-external-engine-addrs: slime does not start these engines, so it cannot share devices with, "
            f"restart or offload them; drop {', '.join(given)} (or let slime launch its own engines)."
        )
    if args.rollout_num_gpus not in (None, 0):
        _fail(
            f"--rollout-num-gpus {args.rollout_num_gpus} reserves devices for engines slime launches, but with "
            "--rollout-external-engine-addrs it launches none; drop --rollout-num-gpus."
        )
    args.rollout_external_engine_addrs = [_external_engine_url(address) for address in addresses]
    args.rollout_num_gpus = 0


def _validate_placement(args: argparse.Namespace) -> None:
    args.actor_world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    _validate_external_engines(args)
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
    if args.rollout_external_engine_addrs:
        args.rollout_num_engines = len(args.rollout_external_engine_addrs)

    args.use_critic = _estimator(args).critic
    if args.offload:
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
    if args.offload_train is None:
        # The critic shares the actor's GPUs, so one of them must step aside while the other runs.
        args.offload_train = args.colocate or args.use_critic
    if args.offload_rollout is None:
        args.offload_rollout = args.colocate

    trainer_threads, engine_threads = cpu_thread_counts(args)
    cores = os.cpu_count() or 1
    for threads, what, flag in ((trainer_threads, "trainer", "--train-num-threads"),
                                (engine_threads, "CPU engine", "--cpu-engine-num-threads")):  # fmt: skip
        if threads > cores:
            logger.warning(
                "%d %s threads exceed the %d cores; oversubscribed threads slow everything down. Lower %s or the "
                "process count.", threads, what, cores, flag,
            )  # fmt: skip


def cpu_thread_counts(args: argparse.Namespace) -> tuple[int, int]:
    """Threads of all trainer ranks and of all CPU engines of a disaggregated CPU run ((0, 0) otherwise).

    train.py runs them one after the other; train_async.py at the same time, so there their sum counts."""
    if args.rollout_backend != "cpu" or args.colocate:
        return 0, 0
    trainer_threads = 0 if args.debug_rollout_only else args.actor_world_size * args.train_num_threads
    engine_threads = 0 if args.debug_train_only else args.rollout_num_engines * args.cpu_engine_num_threads
    return trainer_threads, engine_threads


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
        and not args.custom_advantage_function_path
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

    per_token = args.calculate_per_token_loss
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
    _validate_opd(args)


def _validate_opd(args: argparse.Namespace) -> None:
    """On-policy distillation: its flags need --use-opd, which needs the advantages and a source of teacher log-probs
    (--opd-type megatron is refused before this runs)."""
    if not args.use_opd:
        given = [flag for flag, value in (("--opd-teacher-url", args.opd_teacher_url),) if value is not None]
        given += ["--opd-kl-coef"] if args.opd_kl_coef != 1.0 else []
        if given:
            _fail(f"{', '.join(given)} only take effect with --use-opd (on-policy distillation); add it or drop them.")
        return
    if args.opd_kl_coef < 0:
        _fail(
            f"--opd-kl-coef must be >= 0 (got {args.opd_kl_coef}): it weighs the student's reverse KL to the teacher."
        )
    if loss_kind(args.loss_type) == "sft_loss" or args.disable_compute_advantages_and_returns:
        _fail(
            "--use-opd (on-policy distillation) puts the teacher term into the advantages, which --loss-type sft_loss "
            "and --disable-compute-advantages-and-returns leave unused; use --loss-type policy_loss."
        )
    if args.opd_teacher_url is not None and not re.match(r"https?://[^/]+", args.opd_teacher_url):
        _fail(f"--opd-teacher-url {args.opd_teacher_url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:30000.")
    user_code = (
        args.custom_rm_path,
        args.custom_reward_post_process_path,
        args.custom_generate_function_path,
        args.custom_convert_samples_to_train_data_path,
        args.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION_PATH,
        args.load_debug_rollout_data,  # saved samples keep their teacher_log_probs
    )
    if args.opd_teacher_url is None and not any(user_code):
        _fail(
            "--use-opd (on-policy distillation) needs the teacher's log-probs: pass --opd-teacher-url http://HOST:PORT "
            "of an engine serving the teacher (python -m slime.backends.cpu_engine --model-path <teacher> on CPU, "
            "sglang.launch_server on GPU), or set Sample.teacher_log_probs in your --custom-rm-path, "
            "--custom-reward-post-process-path, generate or rollout function."
        )
    if args.opd_kl_coef == 0:
        logger.warning("--use-opd with --opd-kl-coef 0 asks the teacher but gives its term no weight.")


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
    if args.eval_config:
        try:
            load_eval_config(args.eval_config)
        except ValueError as error:
            _fail(str(error))
    if args.eval_interval is not None and not (args.eval_prompt_data or args.eval_config):
        _fail("--eval-interval needs eval data: --eval-prompt-data NAME PATH [NAME PATH ...] or --eval-config FILE.")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        _fail(f"--peak-tflops {args.peak_tflops}: pass the device's peak TFLOPs, a positive number (H100: 989).")


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
        if args.rollout_backend != "cpu":
            _fail(
                "--update-weight-mode delta needs --rollout-backend cpu: SGLang's /update_weights_from_disk loads "
                "full folders only and has no way to apply a delta to the weights it holds. Drop "
                "--update-weight-mode delta (disk sync then pushes full folders)."
            )
        if args.lora_rank:
            _fail("--update-weight-mode delta does not apply with --lora-rank: only the adapter is pushed. Drop one.")
    else:
        delta_only = {
            "--update-weight-local-checkpoint-dir": args.update_weight_local_checkpoint_dir is not None,
            "--update-weight-delta-encoding": args.update_weight_delta_encoding != "xor",
            "--update-weight-delta-checksum": args.update_weight_delta_checksum != "xxh3-128",
        }
        given = [flag for flag, set_ in delta_only.items() if set_]
        if given:
            _fail(f"{', '.join(given)} only take effect with --update-weight-mode delta; add it or drop them.")
    if args.save_interval is not None and not args.save:
        _fail("--save-interval needs --save (the checkpoint directory).")


def _validate_weight_transport(args: argparse.Namespace) -> None:
    if args.update_weight_transport == "disk":
        if args.colocate:
            _fail(
                "--update-weight-transport disk does not apply with --colocate: colocated engines get the tensors "
                "through shared memory. Drop one of them."
            )
        if not args.update_weight_disk_dir:
            _fail(
                "--update-weight-transport disk needs --update-weight-disk-dir DIR: a folder that training rank 0 "
                "writes and every engine reads at the same path."
            )
        return
    disk_only = {
        "--update-weight-disk-dir": args.update_weight_disk_dir,
        "--update-weight-disk-keep-files": args.update_weight_disk_keep_files,
        "--custom-update-weight-post-write-path": args.custom_update_weight_post_write_path,
    }
    given = [flag for flag, value in disk_only.items() if value]
    if given:
        _fail(f"{', '.join(given)} only take effect with --update-weight-transport disk; add it or drop them.")


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check cross-flag rules and fill the defaults that depend on other flags, in place.

    Fills: global_batch_size / num_steps_per_rollout (from the batch identity), actor_world_size,
    rollout_num_gpus (colocate; 1 on the CPU backend), rollout_num_engines, use_critic,
    offload_train / offload_rollout, eps_clip_high, over_sampling_batch_size,
    log_probs_max_tokens_per_gpu, eval_function_path, reward_key ("score" for --rm-type dapo), and
    debug_train_only when --load-debug-rollout-data is set. Calling it twice gives the same result.

    Args:
        args: a namespace from slime's parser.

    Returns:
        the same namespace.

    Raises:
        ArgumentValidationError: naming the flags at fault and the fix.
    """
    _validate_modes(args)
    _validate_batch_sizes(args)
    _validate_placement(args)
    _validate_weight_transport(args)
    _validate_algorithm(args)
    _validate_data(args)
    _validate_output_folders(args)
    _validate_engine_limits(args)
    _validate_flag_uses(args)
    _validate_agent(args)
    _validate_model_family(args)
    _validate_rollout_precision(args)
    _validate_true_on_policy(args)
    _validate_routing_replay(args)
    _validate_fully_async(args)
    _validate_lora(args)
    _validate_multimodal(args)
    return args


def _validate_rollout_precision(args: argparse.Namespace) -> None:
    """Engines that hold the trainer's weights rounded (block FP8: a block-FP8 --hf-checkpoint or --sglang-quantization
    fp8; CPU engines in bfloat16 or float16: --sglang-dtype): what compares or diffs their weights against the
    trainer's unrounded ones cannot hold."""
    try:
        block = rollout_fp8_block(args)
        dtype = cpu_engine_dtype(args) if args.rollout_backend == "cpu" else None
    except ValueError as error:
        _fail(str(error))
    if block is not None:
        engines = f"FP8 engines (block {block[0]}x{block[1]})"
    elif dtype is not None:
        engines = f"{dtype} CPU engines (--sglang-dtype)"
    else:
        return
    conflicts = [
        ("--check-weight-update-equal", args.check_weight_update_equal, "its 1e-3 log-prob bound"),
        ("--use-fault-tolerance", args.use_fault_tolerance, "a restarted engine's 1e-4 weight check"),
        ("--update-weight-mode delta", args.update_weight_mode == "delta", "a delta against the engine's weights"),
    ]
    for flag, given, check in conflicts:
        if given:
            _fail(
                f"{flag} with {engines}: {check} compares the engines' rounded weights with the trainer's "
                "unrounded ones, which the rounding alone fails. Drop it, or roll out in the trainer's precision."
            )


def _checkpoint_config(args: argparse.Namespace) -> dict | None:
    """`--hf-checkpoint`'s config.json, or None when there is none to read (yet)."""
    path = os.path.join(args.hf_checkpoint or "", "config.json")
    if not (args.hf_checkpoint and os.path.isfile(path)):
        return None
    with open(path) as f:
        return json.load(f)


def _validate_mtp(args: argparse.Namespace, config: dict | None) -> None:
    # Megatron's flag: on args only when given (or registered by megatron.training's parser).
    depth = getattr(args, "mtp_num_layers", None)
    if not (args.enable_mtp_training or depth):
        return
    if args.train_backend != "megatron":
        _fail(
            "--enable-mtp-training trains megatron-core's multi-token-prediction layers: use --train-backend "
            "megatron (the FSDP backend trains the transformers model, which leaves the checkpoint's MTP layers out)"
        )
    if not args.enable_mtp_training:
        _fail(
            f"--mtp-num-layers {depth} builds MTP layers that only --enable-mtp-training trains: add it, or drop "
            "--mtp-num-layers (SGLang's NEXTN speculative decoding drafts with the checkpoint's MTP weights as loaded)"
        )
    if not depth:
        _fail("--enable-mtp-training needs --mtp-num-layers N: how many of the checkpoint's MTP layers to train")
    unsupported = {
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        "--context-parallel-size": args.context_parallel_size,
    }
    for flag, size in unsupported.items():
        if size > 1:
            _fail(f"--enable-mtp-training with {flag} {size} is not supported yet; use {flag} 1")
    if args.lora_rank:
        _fail("--enable-mtp-training with --lora-rank is not supported: the MTP layers would train in full")
    if args.use_rollout_routing_replay:
        _fail(
            "--enable-mtp-training with --use-rollout-routing-replay is not supported: the engines report the "
            "experts of the main layers only, and the MTP layer's router would have none to replay"
        )
    if config is None:
        return
    model_type = str(config.get("model_type"))
    if model_type not in MTP_MODEL_TYPES:
        _fail(
            f"--enable-mtp-training: --hf-checkpoint {args.hf_checkpoint} is a {model_type} model; slime maps the "
            f"MTP layers of {', '.join(MTP_MODEL_TYPES)} checkpoints only"
        )
    in_checkpoint = int(config.get("num_nextn_predict_layers") or 0)
    if depth > in_checkpoint:
        fix = f"use --mtp-num-layers {in_checkpoint}" if in_checkpoint else "use a checkpoint that has MTP layers"
        _fail(
            f"--mtp-num-layers {depth}: --hf-checkpoint {args.hf_checkpoint} has {in_checkpoint} MTP layer(s) "
            f"(num_nextn_predict_layers in its config.json); {fix}"
        )


def _validate_model_family(args: argparse.Namespace) -> None:
    config = _checkpoint_config(args)
    _validate_mtp(args, config)
    if config is None:
        return
    model_type = str(config.get("model_type"))
    refusal = megatron_refusal(model_type)
    if args.train_backend == "megatron" and not args.model_name and refusal:
        _fail(f"--hf-checkpoint {args.hf_checkpoint}: {refusal}.")
    if args.freeze_indexer and model_type not in DSA_MODEL_TYPES:
        _fail(
            f"--freeze-indexer: --hf-checkpoint {args.hf_checkpoint} is a {model_type} model, which has no DSA "
            f"lightning indexer (those are {', '.join(DSA_MODEL_TYPES)}); drop the flag."
        )


def _validate_true_on_policy(args: argparse.Namespace) -> None:
    if not args.true_on_policy_mode:
        return
    if args.rollout_backend != "cpu":
        _fail(
            "--true-on-policy-mode needs --rollout-backend cpu: bit-identical log-probs on SGLang need its "
            "deterministic kernels matched by the trainer's, which slime does not set up yet. Use --rollout-backend "
            "cpu, or drop the flag and correct the gap with --use-tis."
        )
    why = {
        "--bf16": args.bf16,
        "--lora-rank": bool(args.lora_rank),
        "--multimodal-keys": bool(args.multimodal_keys),
        "--sglang-quantization fp8": rollout_fp8_block(args) is not None,
        "--sglang-dtype": cpu_engine_dtype(args) is not None,
    }
    given = [flag for flag, set_ in why.items() if set_]
    if given:
        _fail(
            f"--true-on-policy-mode with {', '.join(given)}: the engine's recomputation covers float32 text models "
            "without adapters; drop one of them."
        )


def _validate_routing_replay(args: argparse.Namespace) -> None:
    if not args.use_rollout_routing_replay:
        return
    if args.agent_function_path:
        _fail(
            "--use-rollout-routing-replay with --agent-function-path: the agent's OpenAI endpoint does not return "
            "the experts each token was routed to; use the default rollout or a --custom-generate-function-path "
            "that sets Sample.rollout_routed_experts."
        )
    config = _checkpoint_config(args)
    if config is not None and routing_shape(config) is None:
        _fail(
            f"--use-rollout-routing-replay: --hf-checkpoint {args.hf_checkpoint} is a dense model (its config.json "
            "names no experts); routing replay is for MoE models, drop the flag."
        )
    # Megatron's own flags under megatron.training, FSDP-only otherwise: absent from slime's Megatron subset.
    recompute = getattr(args, "recompute_granularity", None) or getattr(args, "recompute_activations", False)
    if args.train_backend == "megatron" and recompute and args.pipeline_model_parallel_size > 1:
        _fail(
            "--use-rollout-routing-replay with activation recompute and --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size}: a recomputed layer would replay another micro-batch's routing; "
            "drop the recompute flags or use --pipeline-model-parallel-size 1."
        )


def _validate_agent(args: argparse.Namespace) -> None:
    if args.agent_function_path and args.custom_generate_function_path:
        _fail(
            "--agent-function-path and --custom-generate-function-path both replace the generation of a sample; "
            "pass one of them (a custom generate function can drive its own multi-turn loop)."
        )
    if args.agent_function_path and args.apply_chat_template:
        _fail(
            "--agent-function-path: the agent sends chat messages and the trajectory proxy applies the chat template "
            "to them, so --apply-chat-template would template the prompt twice; drop --apply-chat-template."
        )
    if args.max_turns < 1:
        _fail(f"--max-turns is the most model turns of one sample and must be at least 1 (got {args.max_turns}).")


def _validate_engine_limits(args: argparse.Namespace) -> None:
    if args.cpu_engine_max_queued_requests < 1:
        _fail(f"--cpu-engine-max-queued-requests must be at least 1, got {args.cpu_engine_max_queued_requests}.")
    api_key = getattr(args, "sglang_api_key", None)  # forwarded: there only with SGLang installed, or when given
    if api_key is not None and not isinstance(api_key, str):  # the generic --sglang-* parser typed it
        _fail(f"--sglang-api-key was read as {api_key!r}, not text; use a key that is not a number or true/false.")
    if api_key is not None and not api_key.strip():
        _fail("--sglang-api-key needs a non-empty key: engines require it as 'Authorization: Bearer <key>'.")
    if not engine_api_key(args) and not args.rollout_external_engine_addrs:
        # A key for this job alone, so that no other local user can push weights into, or generate on, the engines
        # slime starts. Engines the user started keep theirs (pass it with --sglang-api-key).
        args.sglang_api_key = secrets.token_urlsafe(32)


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
    if args.distributed_backend == "nccl" and not cuda_available():
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


def _generates_in_background(args: argparse.Namespace) -> bool:
    """Whether the rollout function generates while the trainer trains: its `lifecycle` says so (the fully async
    rollout's does). Only a custom function is imported to ask, the default one generates each batch on demand."""
    if args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH:
        return False
    lifecycle = getattr(load_function(args.rollout_function_path), "lifecycle", None)
    return bool(getattr(lifecycle, "generates_in_background", False))


def _validate_fully_async(args: argparse.Namespace) -> None:
    in_background = (args.colocate or args.keep_old_actor) and _generates_in_background(args)
    if in_background and args.colocate:
        _fail(
            f"--rollout-function-path {args.rollout_function_path} generates while the trainer trains, so engines "
            "and trainer cannot share devices: drop --colocate."
        )
    bound = args.max_weight_staleness
    if in_background and args.keep_old_actor and (bound is None or bound > 1):
        _fail(
            "--keep-old-actor keeps the weights of the last two pushes, so with the fully async rollout it needs "
            "--max-weight-staleness 0 or 1 (no sample older than the previous push)."
        )
    if bound is None:
        if args.staleness_policy != "drop":
            _fail(f"--staleness-policy {args.staleness_policy} needs --max-weight-staleness (the bound it enforces).")
        return
    if bound < 0:
        _fail(f"--max-weight-staleness is a number of weight pushes and must be at least 0 (got {bound}).")
    if args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH:
        _fail(
            "--max-weight-staleness bounds the fully async rollout; the default rollout generates each batch with "
            "the current weights. Add --rollout-function-path "
            "slime.rollout.fully_async_rollout.generate_rollout_fully_async (with train_async.py), or drop it."
        )
    if args.debug_rollout_only:
        _fail("--max-weight-staleness counts the trainer's weight pushes, and --debug-rollout-only has no trainer.")
