"""Megatron's flags when Megatron's own parser is not used: the subset slime reads (with slime's defaults), and
the Megatron flags that have a meaning under --train-backend fsdp."""

from __future__ import annotations

import argparse
from typing import Any

from slime.utils.device import cuda_available

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


def add_megatron_subset_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the Megatron flags slime itself reads, with Megatron's names and slime's defaults.

    Used with `--train-backend fsdp` or when `megatron.training` is not importable.

    Args:
        parser: the parser to extend.

    Returns:
        the same parser.
    """
    cuda = cuda_available()
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
    optim.add_argument(
        "--bf16",
        action="store_true",
        help="Train in bf16 with float32 master weights (FSDP on CPU: under autocast, attention in float32; slow on CPUs without bf16 units).",
    )
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
