"""Run megatron-core outside the Ray trainer (conversion tools): one process or torchrun, GPU or CPU.

Without CUDA this applies the CPU patch of `cpu_compat` (gloo, fp32 or the checkpoint's dtype);
keep transformers models out of such a process.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_hf_checkpoint
from slime.backends.megatron_utils.config import config_from_hf, load_hf_config, megatron_flag, resolve_family
from slime.backends.megatron_utils.model import build_model
from slime.utils.arguments import _extract_unknown_flags
from slime.utils.atomic_dir import check_replaceable
from slime.utils.device import cuda_available
from slime.utils.http_utils import find_free_port

logger = logging.getLogger(__name__)

_PARALLEL_FLAGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def megatron_flags(argv: list[str]) -> dict[str, Any]:
    """Typed Megatron flags from a command line: `--num-layers 28 --swiglu` -> {"num_layers": 28, "swiglu": True}."""
    rest, found = _extract_unknown_flags(argv, set(), "--")
    if rest:
        raise SystemExit(f"unexpected arguments {rest}: every value must follow a --flag")
    return {flag[2:].replace("-", "_"): value for flag, value in found.items()}


def model_args(hf_dir: str, flags: dict[str, Any]) -> argparse.Namespace:
    """Megatron model flags derived from an HF config, overridden by the flags given (e.g. `MODEL_ARGS`).

    Without --bf16/--fp16 the parameters take the HF config's dtype, so a converted checkpoint keeps it.
    """
    args = config_from_hf(hf_dir)
    vars(args).update(flags)
    args.hf_checkpoint = hf_dir
    if not megatron_flag(args, "bf16") and not megatron_flag(args, "fp16"):
        hf_config = load_hf_config(hf_dir)
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
        args.bf16 = dtype == "bfloat16"
        args.fp16 = dtype == "float16"
    return args


def init_distributed(args: argparse.Namespace) -> None:
    """torch.distributed (torchrun's env, else a 1-process group) + Megatron's parallel state from `args`.

    One process runs with all parallel sizes 1 whatever the flags say (a torch_dist checkpoint loads
    under any layout); under torchrun the flags' sizes are used.
    """
    from slime.backends.megatron_utils.cpu_compat import apply_cpu_patch
    from slime.backends.megatron_utils.model import initialize_model_parallel_from_args

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        for name in _PARALLEL_FLAGS:
            if (megatron_flag(args, name) or 1) != 1:
                logger.info("one process: ignoring --%s %s", name.replace("_", "-"), megatron_flag(args, name))
            setattr(args, name, 1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
        apply_cpu_patch()
    initialize_model_parallel_from_args(args)


def shutdown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def export_checkpoint_to_hf(
    args: argparse.Namespace,
    checkpoint: str,
    output_dir: str,
    origin_hf_dir: str,
    model_name: str | None = None,
    dtype: str | None = None,
    iteration: int | None = None,
) -> None:
    """Load a Megatron checkpoint into a model built from `args` and write it as an HF folder (tools' core).

    Args:
        args: Model flags (from `model_args`).
        checkpoint: Checkpoint root or `iter_XXXXXXX` directory.
        output_dir: HF folder to write: absent, or an earlier slime export (replaced whole; anything else is
            refused before the checkpoint is read).
        origin_hf_dir: HF folder whose config and tokenizer files are copied.
        model_name: Family override (else `args.model_name`).
        dtype: torch dtype name for the saved weights (else the model's).
        iteration: Which iteration under a root (else the latest).
    """
    family = resolve_family(model_name or args.model_name)
    check_replaceable(output_dir, "--output-dir")  # before minutes of loading, on every rank alike
    init_distributed(args)
    model = build_model(args, wrap_with_ddp=False)
    # The way in for torch_dist checkpoints slime did not write: their index must still name only DCP's classes.
    loaded_iteration, _ = load_checkpoint(
        checkpoint, model, iteration=iteration, flag="--input-dir", require_marker=False
    )
    weights_dtype = getattr(torch, dtype) if dtype else None
    output = save_hf_checkpoint(
        model, output_dir, origin_hf_dir, family, dtype=weights_dtype, progress=True, flag="--output-dir"
    )
    if output is not None:
        print(f"iteration {loaded_iteration} -> {output}")
    shutdown()
