"""What is generated and from what: the rollout, sampling, data, eval, reward and buffer groups."""

from __future__ import annotations

import argparse
import json
import os

from slime.utils.arguments.errors import _fail
from slime.utils.arguments.flag_values import _json_object, _NamePathPairs
from slime.utils.processing_utils import is_vision_language

DEFAULT_ROLLOUT_FUNCTION_PATH = "slime.rollout.sglang_rollout.generate_rollout"
DEFAULT_DATA_SOURCE_PATH = "slime.rollout.data_source.RolloutDataSourceWithBuffer"
# The modalities --multimodal-keys takes: the engines and the trainer handle images.
MULTIMODAL_TYPES = ("image",)


def _multimodal_keys(text: str) -> dict[str, str]:
    """argparse `type=` for --multimodal-keys: a JSON object from modality ("image") to a record field name."""
    value = _json_object(text)
    unknown = sorted(set(value) - set(MULTIMODAL_TYPES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unsupported modality {', '.join(map(repr, unknown))}; supported: {', '.join(MULTIMODAL_TYPES)} "
            '(write e.g. \'{"image": "images"}\')'
        )
    if not value or not all(isinstance(field, str) and field for field in value.values()):
        raise argparse.ArgumentTypeError(
            f'expected a record field name per modality, e.g. \'{{"image": "images"}}\', got {text!r}'
        )
    return value


def is_vision_language_checkpoint(path: str | None) -> bool:
    """Whether the HF folder's config.json describes a vision-language model (`is_vision_language`)."""
    config = os.path.join(path or "", "config.json")
    if not path or not os.path.isfile(config):
        return False
    with open(config) as f:
        return is_vision_language(json.load(f))


def _validate_multimodal(args: argparse.Namespace) -> None:
    """--multimodal-keys / --train-vision-tower against the checkpoint and the training backend."""
    vision_language = is_vision_language_checkpoint(args.hf_checkpoint)
    if args.train_backend == "megatron" and (vision_language or args.multimodal_keys):
        why = "--multimodal-keys" if args.multimodal_keys else f"--hf-checkpoint {args.hf_checkpoint}"
        _fail(
            f"{why}: vision-language models train with --train-backend fsdp only; the Megatron backend builds "
            "text-only GPT models (no vision tower, no M-RoPE positions). Pass --train-backend fsdp."
        )
    if args.multimodal_keys and args.hf_checkpoint and not vision_language:
        _fail(
            f"--multimodal-keys needs a vision-language model, but --hf-checkpoint {args.hf_checkpoint} has no "
            "vision_config in its config.json; point it at a vision-language checkpoint (Qwen2.5-VL, Qwen3-VL) or "
            "drop --multimodal-keys."
        )
    if args.train_vision_tower and not vision_language:
        _fail(
            f"--train-vision-tower: --hf-checkpoint {args.hf_checkpoint} has no vision tower (no vision_config in "
            "its config.json); drop the flag."
        )


def _add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rollout")
    group.add_argument("--hf-checkpoint", default=None, help="HF model folder: engine weights, tokenizer, config.")
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Let transformers (trainer, rollout, engines; SGLang's own flag too) run Python code shipped in the "
        "model folder (auto_map). Off by default: a model that needs it is refused, naming this flag.",
    )
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
        "--agent-function-path",
        default=None,
        help="async agent(base_url, sample, sampling_params) run per sample against the trajectory proxy's "
        "OpenAI endpoint (base_url ends in /v1); the session it drives becomes the sample.",
    )
    group.add_argument(
        "--max-turns",
        type=int,
        default=8,
        help="Most model turns one multi-turn / agent sample may take (the multi-turn helpers and the proxy stop it).",
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
        help="f(args, samples) -> DynamicFilterOutput | bool, called with one group's samples: keep the group or not.",
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
        help="host:port (or http://host:port) of SGLang-API engines started outside slime: slime launches none, "
        "registers these behind its router and pushes weights to them by --update-weight-transport (disk when "
        "they cannot reach the trainer; nccl needs --rollout-num-gpus-per-engine = their TP size). Engines with "
        "an API key take it from --sglang-api-key.",
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
        type=_multimodal_keys,
        default=None,
        metavar="JSON",
        help="Vision-language prompts: JSON mapping a modality to the record field holding its items, e.g. "
        '\'{"image": "images"}\' (images only). Each "<image>" in the prompt text takes the next image; without '
        "one, the images go before the text. Items: paths (relative to the data file or absolute), base64, data "
        "URLs, or Parquet image bytes. Needs a vision-language --hf-checkpoint and --train-backend fsdp.",
    )
    group.add_argument(
        "--train-vision-tower",
        action="store_true",
        help="Vision-language models: train the vision tower (and its merger) too. Off: it stays frozen and only "
        "the language model trains.",
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
    group.add_argument(
        "--use-dynamic-global-batch-size",
        action="store_true",
        help="Train each rollout in one optimizer step over however many samples it returned (rounded down to a "
        "multiple of the data-parallel size; the rest are dropped and counted): for generate functions that return "
        "several samples per prompt, or none.",
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
        help="Per-answer limit of the built-in rule-based graders; past it the worker is killed, the answer wrong.",
    )
    group.add_argument(
        "--rm-num-workers", type=int, default=1, help="Processes grading the built-in rewards (started on first use)."
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
        "--rollout-sample-filter-path",
        default=None,
        help="f(args, groups) setting sample.remove_sample (groups: the kept lists of samples).",
    )
    group.add_argument("--rollout-all-samples-process-path", default=None, help="f(args, all_samples, data_source).")
