"""Convert a Megatron torch_dist checkpoint back into an HF folder.

The architecture comes from `--origin-hf-dir` (the HF model the checkpoint started from); its config,
tokenizer and chat template are copied next to the new safetensors weights. Megatron model flags on
the command line override the derived ones.

Usage:
    python tools/convert_torch_dist_to_hf.py --input-dir /root/Qwen3-4B_slime/iter_0000100 \\
        --output-dir /root/Qwen3-4B_step100 --origin-hf-dir /root/Qwen3-4B

`--input-dir` may also be the checkpoint root (then the tracker file picks the iteration).
Without CUDA it runs on the CPU with gloo.
"""

from __future__ import annotations

import argparse
import logging

import torch

from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_hf_checkpoint
from slime.backends.megatron_utils.config import resolve_family
from slime.backends.megatron_utils.model import build_model
from slime.backends.megatron_utils.standalone import init_distributed, megatron_flags, model_args, shutdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-dir", required=True, help="torch_dist checkpoint: an iter_XXXXXXX dir or its root.")
    parser.add_argument("--output-dir", required=True, help="Where to write the HF folder.")
    parser.add_argument("--origin-hf-dir", required=True, help="The HF folder the model came from.")
    parser.add_argument("--model-name", default=None, help="Model family (default: the config's model_type).")
    parser.add_argument("--dtype", default=None, help="Weight dtype, e.g. bfloat16 (default: the origin config's).")
    known, rest = parser.parse_known_args(argv)

    args = model_args(known.origin_hf_dir, megatron_flags(rest))
    family = resolve_family(known.model_name or args.model_name)
    init_distributed(args)
    model = build_model(args, wrap_with_ddp=False)
    iteration, _ = load_checkpoint(known.input_dir, model)
    dtype = getattr(torch, known.dtype) if known.dtype else None
    output = save_hf_checkpoint(model, known.output_dir, known.origin_hf_dir, family, dtype=dtype, progress=True)
    if output is not None:
        print(f"iteration {iteration} -> {output}")
    shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
