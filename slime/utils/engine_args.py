"""What the processes that talk to the engines read off slime's arguments: how long a request may be, how long to
retry while a failed engine is replaced, and the key engines require. One copy for the default rollout, the
multi-turn helpers, the agent rollout and the engine launchers.

Every field is read with a default: user agents and generate functions (slime.agent, examples/) call these with
namespaces they build themselves, holding only the fields they set."""

from __future__ import annotations

import argparse
import functools


@functools.lru_cache(maxsize=4)
def _config_context_length(path: str, trust_remote_code: bool) -> int:
    from transformers import AutoConfig  # here: the engine actors import this module and need no transformers

    from slime.utils.misc import load_pretrained

    config = load_pretrained(AutoConfig, path, trust_remote_code)
    config = getattr(config, "text_config", None) or config  # multimodal configs nest the language model's
    return int(getattr(config, "max_position_embeddings", None) or 4096)


def engine_context_length(args: argparse.Namespace) -> int:
    """Most prompt + response tokens an engine holds.

    `--sglang-context-length` on the SGLang backend, else the model config's `max_position_embeddings`
    (what SGLang and the CPU engine read), else 4096 (the CPU engine's fallback).
    """
    override = args.sglang_server_args.get("context_length")
    if override and args.rollout_backend != "cpu":  # the CPU engine ignores --sglang-*
        return int(override)
    return _config_context_length(args.hf_checkpoint, args.trust_remote_code)


# SGLang's --dtype spellings -> the CPU engine's. "auto" (SGLang: the checkpoint's dtype) keeps the CPU engine's
# float32: the trainer computes in float32 on CPU, and an engine in another precision samples from other log-probs.
_CPU_ENGINE_DTYPES = {"auto": None, "float32": None, "float": None, "bfloat16": "bfloat16", "float16": "float16",
                      "half": "float16"}  # fmt: skip


def cpu_engine_dtype(args: argparse.Namespace) -> str | None:
    """The CPU engine's parameter dtype for `--sglang-dtype`: "bfloat16", "float16", or None for its float32.

    bfloat16 runs the engine's matmuls on the CPU's bf16 units where it has them (AMX, AVX512-BF16): about 3x the
    float32 matmul rate there (bench/rollout_throughput.py --dtype bfloat16), at a log-prob gap to the float32
    trainer that `train/train_rollout_logprob_abs_diff` reports.

    Raises:
        ValueError: a dtype the CPU engine does not run, naming it and the choices.
    """
    dtype = args.sglang_server_args.get("dtype")
    if dtype is None:
        return None
    if dtype not in _CPU_ENGINE_DTYPES:
        raise ValueError(
            f"--sglang-dtype {dtype}: the CPU engine runs {', '.join(_CPU_ENGINE_DTYPES)}; use one or drop the flag"
        )
    return _CPU_ENGINE_DTYPES[dtype]


def context_limit(args: argparse.Namespace, evaluation: bool = False) -> int:
    """Most prompt + response tokens one request may reach: `--rollout-max-context-len` (`--eval-max-context-len`
    in eval), never more than the engine holds."""
    # SGLang refuses a request whose prompt + max_new_tokens reaches its context length, hence the - 1.
    limit = engine_context_length(args) - 1
    requested = (args.eval_max_context_len if evaluation else None) or args.rollout_max_context_len
    return limit if requested is None else min(requested, limit)


def engine_failover_window(args: argparse.Namespace) -> float:
    """Seconds a request keeps being retried while a failed engine is found and taken out of the router.

    0 without `--use-fault-tolerance`; otherwise long enough for the health monitor's next round
    (interval + probe timeout) plus a margin.
    """
    if not args.use_fault_tolerance:
        return 0.0
    return (
        args.rollout_health_check_first_wait
        + args.rollout_health_check_interval
        + args.rollout_health_check_timeout
        + 30.0
    )


# Engine processes get their key from this environment variable, not their command line: /proc/<pid>/cmdline is
# readable by every local user, /proc/<pid>/environ only by the job's own.
ENGINE_API_KEY_ENV = "SLIME_ENGINE_API_KEY"
# Largest control request body (weight pickles, LoRA adapters) the CPU engine reads; generate requests have less.
CPU_ENGINE_CONTROL_MAX_BODY_BYTES = 64 * 2**20


def engine_api_key(args: argparse.Namespace) -> str | None:
    """The key engines require (`--sglang-api-key`), or None when they take requests without one."""
    options = args.sglang_server_args
    # --sglang-api-key is an attribute only when SGLang registered it or it was given
    return options.get("api_key") or options.get("api-key") or getattr(args, "sglang_api_key", None) or None
