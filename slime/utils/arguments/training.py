"""The 'train and weight sync' group: trainer environment, how weights reach the engines, what is trained, and
the trainer-side hooks."""

from __future__ import annotations

import argparse

from slime.utils.arguments.flag_values import _json_object


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
        help="Push all weights every update, or (delta, with --update-weight-transport disk and the CPU engine) only "
        "the tensors that changed since the version the engines hold, encoded by --update-weight-delta-encoding. The "
        "first push, one after restarted engines or a failed push, and one after a refused delta are full.",
    )
    group.add_argument(
        "--update-weight-transport",
        choices=["nccl", "disk"],
        default="nccl",
        help="Disaggregated weight push: nccl, a collective broadcast from trainer rank 0 to every engine (gloo on "
        "CPU; the engines must reach rank 0), or disk, an HF folder of safetensors shards written to "
        "--update-weight-disk-dir that each engine loads with /update_weights_from_disk (for engines that share no "
        "network or process group with the trainer). --colocate always sends tensors.",
    )
    group.add_argument(
        "--update-weight-disk-dir",
        default=None,
        help="Disk weight sync: folder that training rank 0 writes and every engine reads at the same path (a "
        "shared filesystem across hosts). Each push is a new subfolder weights-v<version>-<random>, renamed into "
        "place when complete; nothing else in the folder is touched.",
    )
    group.add_argument(
        "--update-weight-disk-keep-files",
        action="store_true",
        help="Disk weight sync: keep every push's folder (default: delete the previous one once the engines have "
        "loaded the next; the newest stays).",
    )
    group.add_argument(
        "--update-weight-delta-encoding",
        choices=["xor", "overwrite"],
        default="xor",
        help="Delta sync: xor, the zstd-compressed bitwise xor of each changed tensor with the engines' copy "
        "(bit-exact; small updates leave most high-order bytes unchanged, which compress away), or overwrite, each "
        "changed tensor whole and uncompressed. Unchanged tensors are never written.",
    )
    group.add_argument(
        "--update-weight-delta-checksum",
        choices=["xxh3-128", "sha256"],
        default="xxh3-128",
        help="Delta sync: checksum of each changed tensor's new bytes, which the engine checks after rebuilding it; "
        "a mismatch makes the trainer push the full weights.",
    )
    group.add_argument(
        "--update-weight-local-checkpoint-dir",
        default=None,
        help="Delta sync: folder on training rank 0's local disk where it keeps its copy of the weights the engines "
        "hold (the base deltas are encoded against), as <dir>/slime-delta-base, cleared at start. Default: kept in "
        "rank 0's memory (one more copy of the weights). Upstream slime names with it the engines' local checkpoint "
        "that they patch; slime's CPU engine patches its live weights instead.",
    )
    group.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=512 * 1024**2,
        help="Bytes of parameters sent per weight-update bucket, and the largest safetensors shard of disk weight "
        "sync (default: 512 MiB).",
    )
    group.add_argument(
        "--update-weights-interval",
        type=int,
        default=1,
        help="Push weights to the engines every this many rollouts (train_async.py).",
    )
    group.add_argument(
        "--max-weight-staleness",
        type=int,
        default=None,
        help="Fully async rollout: train no prompt group whose oldest token was sampled more than this many weight "
        "pushes before the weights being trained (0: on-policy); see --staleness-policy. Default: unbounded.",
    )
    group.add_argument(
        "--staleness-policy",
        choices=["drop", "regenerate"],
        default="drop",
        help="What becomes of a group over --max-weight-staleness: drop (its prompts go back to the data source) "
        "or regenerate (generated again at once under the current weights).",
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
    group.add_argument(
        "--true-on-policy-mode",
        action="store_true",
        help="CPU engines and the FSDP trainer compute bit-identical log-probs for the same weights and tokens (miles' "
        "name): each sample is trained alone in its own row, and the engine recomputes every response's log-probs "
        "with the trainer's forward on the trainer's thread count. Costs one extra forward per response and the "
        "shared-prompt packing; float32 only.",
    )
    group.add_argument(
        "--freeze-indexer",
        action="store_true",
        help="DSA models (GLM-5, DeepSeek-V3.2): keep the lightning indexer's weights as loaded and train the rest. "
        "FSDP only.",
    )
    group.add_argument("--allgather-cp", action="store_true", help="All-gather context-parallel chunks (DSA models).")
    group.add_argument(
        "--enable-mtp-training",
        action="store_true",
        help="Megatron: train the checkpoint's first --mtp-num-layers multi-token-prediction layers on the response "
        "tokens, weighted by --mtp-loss-scaling-factor (Megatron's, default 0.1); logged as train/mtp_loss.",
    )
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
        help="f(args, version_dir, engines), run on training rank 0 after a disk weight sync wrote its folder and "
        "before the engines load it (e.g. to copy it to the engines' hosts).",
    )
